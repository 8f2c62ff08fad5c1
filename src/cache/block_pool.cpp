#include "cache/block_pool.h"

#include <string>

#include "common/error.h"

namespace dsv4 {

BlockPool::BlockPool(int32_t num_pages) : capacity_(num_pages) {
  DSV4_REQUIRE(num_pages >= 0, "block pool: negative capacity");
}

int32_t BlockPool::allocate() {
  int32_t p = -1;
  if (!free_.empty()) {  // every released id is below the high-water mark
    p = free_.top();
    free_.pop();
  } else if (high_water_ < capacity_) {
    p = high_water_++;
    refs_.push_back(0);
    hashes_.push_back(0);
  } else {
    return -1;
  }
  refs_[size_t(p)] = 1;
  return p;
}

void BlockPool::check_in_use(int32_t page, const char* what) const {
  if (page < 0 || page >= capacity_) throw Error("block pool: page " + std::to_string(page) + " is not from this pool");
  if (ref_count(page) <= 0) throw Error("block pool: page " + std::to_string(page) + " " + what + " but it is not in use");
}

void BlockPool::retain(int32_t page) {
  check_in_use(page, "retained");
  ++refs_[size_t(page)];
}

void BlockPool::release(int32_t page) {
  check_in_use(page, "released");
  if (--refs_[size_t(page)] > 0) return;
  hashes_[size_t(page)] = 0;
  free_.push(page);
}

void BlockPool::set_hash(int32_t page, uint64_t hash) {
  check_in_use(page, "given a hash");
  hashes_[size_t(page)] = hash;
}

}  // namespace dsv4
