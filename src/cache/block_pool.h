#pragma once
// A fixed set of page ids handed out and taken back. Capacity is set at
// start-up; running out is reported to the caller, never papered over.
#include <cstdint>
#include <vector>

namespace dsv4 {

class BlockPool {
 public:
  explicit BlockPool(int32_t num_pages);

  // A free page id, or -1 when none is left.
  int32_t allocate();
  // Returns a page; throws Error on a double free or a foreign id.
  void release(int32_t page);

  int32_t capacity() const { return int32_t(in_use_.size()); }
  int32_t free_count() const { return int32_t(free_.size()); }
  int32_t used_count() const { return capacity() - free_count(); }

 private:
  std::vector<int32_t> free_;   // stack; lowest ids handed out first
  std::vector<bool> in_use_;
};

}  // namespace dsv4
