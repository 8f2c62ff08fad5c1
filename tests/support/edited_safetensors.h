#pragma once
// Safetensors files edited by a test: every tensor with its own bytes, changed
// in place by the test, then written back as a new file.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/safetensors.h"

namespace dsv4::test {

struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
using TensorListEdit = std::function<void(std::vector<OwnedTensor>&)>;

// Writes `from`'s tensors to `to`, after `edit` (when set) changed the list.
inline void rewrite_safetensors(const std::filesystem::path& from, const std::filesystem::path& to,
                                const TensorListEdit& edit) {
  const auto f = SafetensorsFile::open(from);
  std::vector<OwnedTensor> ts;
  for (const auto& t : f->tensors()) ts.push_back({t.name, t.dtype, t.shape, {t.bytes.begin(), t.bytes.end()}});
  if (edit) edit(ts);
  std::vector<TensorData> out;
  for (const auto& t : ts) out.push_back({t.name, t.dtype, t.shape, t.bytes});
  write_safetensors(to, out);
}

// The tensor called `name`; a test bug when there is none.
inline OwnedTensor& find_tensor(std::vector<OwnedTensor>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return t;
  throw std::runtime_error("test bug: no tensor " + name);
}

}  // namespace dsv4::test
