#include "cache/block_pool.h"

#include <string>

#include "common/error.h"

namespace dsv4 {

BlockPool::BlockPool(int32_t num_pages) : in_use_(size_t(num_pages > 0 ? num_pages : 0), false) {
  require(num_pages >= 0, "block pool: negative capacity");
  free_.reserve(size_t(num_pages));
  for (int32_t p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

int32_t BlockPool::allocate() {
  if (free_.empty()) return -1;
  const int32_t p = free_.back();
  free_.pop_back();
  in_use_[size_t(p)] = true;
  return p;
}

void BlockPool::release(int32_t page) {
  require(page >= 0 && page < capacity(), "block pool: page " + std::to_string(page) + " is not from this pool");
  require(in_use_[size_t(page)], "block pool: page " + std::to_string(page) + " released twice");
  in_use_[size_t(page)] = false;
  free_.push_back(page);
}

}  // namespace dsv4
