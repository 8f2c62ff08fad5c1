#pragma once
// Bytes that grow in place: anonymous memory mapped with room to spare (room
// is address space only; a page takes memory when it is first written) and
// grown by mremap, which moves page tables, not bytes. A cache arena in a
// std::vector doubled by copying every byte (zeroing the new half first),
// holding both copies for the moment: `plan_bench 128 65536` (128 requests
// at 64K tokens of context on the CPU backend) saw one growth take 4.2 s,
// and a growth could need three times the cache's memory. Bytes never
// written read as zero.
#include <cstddef>
#include <cstdint>

namespace dsv4 {

class HostArena {
 public:
  HostArena() = default;
  ~HostArena();
  HostArena(HostArena&& other) noexcept;
  HostArena& operator=(HostArena&& other) noexcept;
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Address space held (the mapping); memory is what has been written of it.
  size_t reserved() const { return reserved_; }
  uint8_t& operator[](size_t i) { return data_[i]; }

  // Grows to `bytes` (never shrinks). Throws Error when the system refuses
  // the address space. Pointers into the arena are invalid afterwards.
  void grow(size_t bytes);

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0, reserved_ = 0;
};

}  // namespace dsv4
