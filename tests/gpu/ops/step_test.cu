// The step metadata built on the GPU (attn/cuda/device_step.h) against the
// CPU's (step/step.h): bitwise equal for every real token (lists up to their
// lengths), and padding rows (a decode batch padded to a graph's size) with
// slots -1 and empty lists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "attn/cuda/device_step.h"
#include "common/error.h"
#include "support/cuda_device.h"

using namespace dsv4;

namespace {

class DeviceStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_cuda_device()) GTEST_SKIP() << "no CUDA device";
  }
};

std::vector<int32_t> download(const int32_t* d, int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  EXPECT_EQ(cudaMemcpy(v.data(), d, size_t(n) * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

// Row t of every derived array on the device equals the host's, tokens
// t < real; rows past it are padding (slots -1, lengths 0). A list row is
// compared up to its length: the device writes no more (device_step.h).
void expect_same(const StepMetadata& s, const cuda::DeviceStep& d, int launched) {
  const StepView h = s.view(), g = d.view();
  const int real = s.num_tokens();
  auto rows = [&](const int32_t* host, const int32_t* dev, int32_t pad, const char* what) {
    const std::vector<int32_t> got = download(dev, launched);
    for (int t = 0; t < launched; ++t) ASSERT_EQ(got[size_t(t)], t < real ? host[t] : pad) << what << " token " << t;
  };
  rows(h.swa_slot, g.swa_slot, -1, "swa_slot");
  rows(h.c4a_slot, g.c4a_slot, -1, "c4a_slot");
  rows(h.c128a_slot, g.c128a_slot, -1, "c128a_slot");
  rows(h.c4a_state_slot, g.c4a_state_slot, -1, "c4a_state_slot");
  rows(h.c128a_state_slot, g.c128a_state_slot, -1, "c128a_state_slot");
  rows(h.window_lengths, g.window_lengths, 0, "window length");
  rows(h.c128a_lengths, g.c128a_lengths, 0, "c128a length");
  // The lists' rows (the device's as wide as the capacity) up to their lengths.
  auto lists = [&](const int32_t* host, const int32_t* dev, int wh, int wd, const int32_t* lengths, const char* what) {
    const std::vector<int32_t> got = download(dev, int64_t(real) * wd);
    for (int t = 0; t < real; ++t) {
      ASSERT_LE(lengths[t], wh) << what << " token " << t;
      for (int j = 0; j < lengths[t]; ++j)
        ASSERT_EQ(got[size_t(t) * wd + j], host[int64_t(t) * wh + j]) << what << " token " << t << " entry " << j;
    }
  };
  lists(h.window_indices, g.window_indices, kWindow, kWindow, h.window_lengths, "window");
  lists(h.c128a_indices, g.c128a_indices, s.dims().c128a_width, g.dims.c128a_width, h.c128a_lengths, "c128a");
  int32_t real_on_device = -1;
  ASSERT_EQ(cudaMemcpy(&real_on_device, d.real_tokens(), 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(real_on_device, real);
}

struct Caches {
  ModelConfig config = preset_config("mini");
  CacheSpec spec{config, CacheFormats{}};
  BlockManager blocks{spec, CacheLimits::for_workload(spec, 4, 4096, 2048)};
};

StepDims capacity(int tokens, int runs) {
  StepDims d;
  d.tokens = tokens, d.runs = runs;
  d.table_width[0] = 40, d.table_width[1] = 20, d.table_width[2] = 20, d.table_width[3] = 600, d.table_width[4] = 20;
  d.c128a_width = 128;
  return d;
}

}  // namespace

TEST_F(DeviceStepTest, PrefillAndDecodeMatchTheHostBitwise) {
  Caches c;
  std::vector<RunError> errors;
  for (int id : {1, 2, 3}) c.blocks.open_request(id);
  cuda::DeviceStep d(capacity(2048, 4));
  // A mixed step: prefills of different lengths, one ending mid-block.
  StepMetadata s1 = plan_step({{1, 0, 1300}, {2, 0, 3}, {3, 0, 131}}, c.config, c.blocks, errors);
  ASSERT_TRUE(errors.empty());
  d.stage(s1);
  d.copy(nullptr), d.build(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_same(s1, d, s1.num_tokens());
  for (const dsv4::Run& r : s1.runs) c.blocks.commit(r.request, r.start_pos + r.len);
  // A decode step of 3 padded to 4 rows: the padding row reads nothing.
  StepMetadata s2 = plan_step({{1, 1300, 1}, {2, 3, 1}, {3, 131, 1}}, c.config, c.blocks, errors);
  d.stage(s2);
  d.copy(nullptr), d.build(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_same(s2, d, 4);
  for (const dsv4::Run& r : s2.runs) c.blocks.commit(r.request, r.start_pos + r.len);
  // Fewer runs than the step before: the rows it left behind are not read.
  StepMetadata s3 = plan_step({{3, 132, 1}}, c.config, c.blocks, errors);
  ASSERT_TRUE(errors.empty());
  d.stage(s3);
  d.copy(nullptr), d.build(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_same(s3, d, 1);
}

TEST_F(DeviceStepTest, AStepBeyondTheCapacityIsRefused) {
  Caches c;
  std::vector<RunError> errors;
  c.blocks.open_request(1);
  cuda::DeviceStep d(capacity(64, 1));
  const StepMetadata s = plan_step({{1, 0, 65}}, c.config, c.blocks, errors);
  EXPECT_THROW(d.stage(s), Error);
}
