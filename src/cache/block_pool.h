#pragma once
// A fixed set of page ids handed out and taken back, with a reference count
// per page so that a page can later be shared by several requests (prefix
// reuse): a page returns to the free list when its last holder releases it.
// Capacity is set at start-up; running out is reported to the caller, never
// papered over. Free pages are handed out lowest id first, so the pages in
// use stay compact and storage that grows on demand follows the high-water
// mark; the pool's own memory follows it too (ids never handed out cost
// nothing, whatever the capacity).
#include <cstdint>
#include <functional>
#include <queue>
#include <vector>

namespace dsv4 {

class BlockPool {
 public:
  explicit BlockPool(int32_t num_pages);

  // A free page id with one reference, or -1 when none is left.
  int32_t allocate();
  // One more holder of a page in use (a request sharing it).
  void retain(int32_t page);
  // Drops one reference; the page is free again at zero. Throws Error on a
  // page that is not in use or not from this pool.
  void release(int32_t page);

  int32_t capacity() const { return capacity_; }
  int32_t free_count() const { return capacity_ - high_water_ + int32_t(free_.size()); }
  int32_t used_count() const { return capacity() - free_count(); }
  int32_t ref_count(int32_t page) const { return page >= 0 && page < high_water_ ? refs_[size_t(page)] : 0; }
  // One past the highest page id ever handed out.
  int32_t high_water() const { return high_water_; }

  // Room for prefix reuse: the content hash of the 128-token block a page
  // holds (0: none). Cleared when the page is freed.
  void set_hash(int32_t page, uint64_t hash);
  uint64_t hash(int32_t page) const { return page >= 0 && page < high_water_ ? hashes_[size_t(page)] : 0; }

 private:
  void check_in_use(int32_t page, const char* what) const;

  int32_t capacity_ = 0;
  int32_t high_water_ = 0;  // ids [0, high_water_) have been handed out
  // Released ids below the high-water mark, lowest on top.
  std::priority_queue<int32_t, std::vector<int32_t>, std::greater<int32_t>> free_;
  std::vector<int32_t> refs_;     // [high_water_]
  std::vector<uint64_t> hashes_;  // [high_water_]
};

}  // namespace dsv4
