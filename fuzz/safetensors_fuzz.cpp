// Fuzz target for the safetensors parser (SPEC §3). Every input must either
// parse into views that lie inside the input, or throw dsv4::Error; any other
// exception, a crash or a sanitizer report is a bug. What parses must also
// survive a round trip through the writer, and an amplified copy: its tensors
// replicated under new names to a header of about a thousand entries (inputs
// are capped at a few KB, so only amplification reaches large headers; a
// parser slower than linear shows up as libFuzzer timeouts), which must parse
// to the same bytes, and must be refused once a repeated name is appended.
//
// Built twice: with clang + libFuzzer (fuzz_safetensors), and with the
// project's compiler plus the replay main() below (fuzz_safetensors_replay),
// which runs files and directories of inputs once each.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "model/safetensors.h"

namespace {

// Aborts (a finding) when an invariant of a successful parse is broken.
void check(bool cond) {
  if (!cond) __builtin_trap();
}

void check_parsed(const dsv4::SafetensorsFile& f, const uint8_t* data, size_t size) {
  std::vector<dsv4::TensorData> copy;
  uint64_t sum = 0;
  for (const auto& t : f.tensors()) {
    check(f.find(t.name) == &t);
    check(uint64_t(t.numel()) * dsv4::dtype_size(t.dtype) == t.bytes.size());
    if (!t.bytes.empty()) check(t.bytes.data() >= data && t.bytes.data() + t.bytes.size() <= data + size);
    for (uint8_t b : t.bytes) sum += b;  // reads every byte, so ASan sees any stray view
    copy.push_back({t.name, t.dtype, t.shape, t.bytes});
  }
  const auto image = dsv4::serialize_safetensors(copy, f.metadata());
  const auto again = dsv4::SafetensorsFile::parse(image, "round trip");
  check(again->tensors().size() == f.tensors().size() && again->metadata() == f.metadata());
  for (const auto& t : again->tensors()) {
    const auto* orig = f.find(t.name);
    check(orig && orig->dtype == t.dtype && orig->shape == t.shape &&
          std::equal(t.bytes.begin(), t.bytes.end(), orig->bytes.begin(), orig->bytes.end()));
  }
  (void)sum;
}

// About kEntries entries and at most kBytes of data in the amplified image.
constexpr size_t kEntries = 1024, kBytes = 1 << 18;

void check_amplified(const dsv4::SafetensorsFile& f) {
  const auto& tensors = f.tensors();
  if (tensors.empty()) return;
  size_t bytes = 0;
  for (const auto& t : tensors) bytes += t.bytes.size();
  const size_t copies = std::max<size_t>(1, std::min(kEntries / tensors.size(), kBytes / std::max<size_t>(bytes, 1)));
  std::vector<dsv4::TensorData> big;
  for (size_t c = 0; c < copies; ++c)  // "<c>/<name>": unique whatever the names hold
    for (const auto& t : tensors) big.push_back({std::to_string(c).append("/").append(t.name), t.dtype, t.shape, t.bytes});
  const auto image = dsv4::serialize_safetensors(big, f.metadata());
  const auto again = dsv4::SafetensorsFile::parse(image, "amplified");
  check(again->tensors().size() == big.size());
  for (const auto& t : big) {
    const auto* got = again->find(t.name);
    check(got && got->dtype == t.dtype && got->shape == t.shape &&
          std::equal(got->bytes.begin(), got->bytes.end(), t.bytes.begin(), t.bytes.end()));
  }
  // The last name once more, as the header object's first member (the end of
  // the object may be inside __metadata__, whose members are no tensors).
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(image[size_t(i)]) << (8 * i);
  std::string header(image.begin() + 8, image.begin() + 8 + long(n));
  const std::string repeat = nlohmann::json(big.back().name).dump()
                                 .append(R"(:{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)");
  header.insert(header.find('{') + 1, repeat);
  std::vector<uint8_t> dup(8 + header.size());
  for (int i = 0; i < 8; ++i) dup[size_t(i)] = uint8_t(uint64_t(header.size()) >> (8 * i));
  std::copy(header.begin(), header.end(), dup.begin() + 8);
  dup.insert(dup.end(), image.begin() + 8 + long(n), image.end());
  bool refused = false;
  try {
    dsv4::SafetensorsFile::parse(dup, "amplified with a repeat");
  } catch (const dsv4::Error& e) {
    refused = std::string(e.what()).find("appears twice in the header") != std::string::npos;
  }
  check(refused);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<dsv4::SafetensorsFile> f;
  try {
    f = dsv4::SafetensorsFile::parse({data, size}, "fuzz input");
  } catch (const dsv4::Error&) {
    return 0;  // rejected with a message: the expected outcome for most inputs
  }
  check_parsed(*f, data, size);
  check_amplified(*f);
  return 0;
}

#ifdef DSV4_FUZZ_REPLAY
// Runs each file given, or each file of each directory given, through the target.
int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    if (fs::is_directory(argv[i])) {
      for (const auto& e : fs::directory_iterator(argv[i]))
        if (e.is_regular_file()) inputs.push_back(e.path());
    } else {
      inputs.emplace_back(argv[i]);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  for (const auto& p : inputs) {
    std::ifstream in(p, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "cannot read %s\n", p.c_str());
      return 1;
    }
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
  }
  std::printf("replayed %zu inputs\n", inputs.size());
  return inputs.empty() ? 1 : 0;  // an empty corpus means a wrong path, not a pass
}
#endif
