// The step metadata built on the GPU (attn/cuda/device_step.h) against the
// CPU's (step/step.h): bitwise equal for every real token, and padding rows
// (a decode batch padded to a graph's size) with slots -1 and empty lists.
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
// t < real; rows past it are padding.
void expect_same(const StepMetadata& s, const cuda::DeviceStep& d, int launched) {
  const StepView h = s.view(), g = d.view();
  const int real = s.num_tokens();
  auto rows = [&](const int32_t* host, const int32_t* dev, int width, int32_t pad, const char* what) {
    const std::vector<int32_t> got = download(dev, int64_t(launched) * width);
    for (int t = 0; t < launched; ++t)
      for (int i = 0; i < width; ++i) {
        const int32_t want = t < real && host ? host[int64_t(t) * width + i] : pad;
        ASSERT_EQ(got[size_t(t) * width + i], want) << what << " token " << t << " entry " << i;
      }
  };
  rows(h.swa_slot, g.swa_slot, 1, -1, "swa_slot");
  rows(h.c4a_slot, g.c4a_slot, 1, -1, "c4a_slot");
  rows(h.c128a_slot, g.c128a_slot, 1, -1, "c128a_slot");
  rows(h.c4a_state_slot, g.c4a_state_slot, 1, -1, "c4a_state_slot");
  rows(h.c128a_state_slot, g.c128a_state_slot, 1, -1, "c128a_state_slot");
  rows(h.window_indices, g.window_indices, kWindow, -1, "window");
  rows(h.window_lengths, g.window_lengths, 1, 0, "window length");
  rows(h.c128a_lengths, g.c128a_lengths, 1, 0, "c128a length");
  // The device lists are as wide as the capacity: the host's columns, then -1.
  const int wh = s.dims().c128a_width, wd = g.dims.c128a_width;
  const std::vector<int32_t> got = download(g.c128a_indices, int64_t(launched) * wd);
  for (int t = 0; t < launched; ++t)
    for (int j = 0; j < wd; ++j) {
      const int32_t want = t < real && j < wh ? h.c128a_indices[int64_t(t) * wh + j] : -1;
      ASSERT_EQ(got[size_t(t) * wd + j], want) << "c128a token " << t << " entry " << j;
    }
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
}

TEST_F(DeviceStepTest, AStepBeyondTheCapacityIsRefused) {
  Caches c;
  std::vector<RunError> errors;
  c.blocks.open_request(1);
  cuda::DeviceStep d(capacity(64, 1));
  const StepMetadata s = plan_step({{1, 0, 65}}, c.config, c.blocks, errors);
  EXPECT_THROW(d.stage(s), Error);
}
