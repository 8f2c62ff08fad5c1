#include "cache/host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "common/error.h"

namespace dsv4 {

HostArena::~HostArena() {
  if (data_) munmap(data_, reserved_);
}

HostArena::HostArena(HostArena&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      reserved_(std::exchange(other.reserved_, 0)) {}

HostArena& HostArena::operator=(HostArena&& other) noexcept {
  if (this != &other) {
    if (data_) munmap(data_, reserved_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    reserved_ = std::exchange(other.reserved_, 0);
  }
  return *this;
}

void HostArena::grow(size_t bytes) {
  if (bytes <= size_) return;
  if (bytes > reserved_) {
    // Twice the room each time (address space, not memory): a run that
    // grows page by page remaps O(log n) times.
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t want = std::max(bytes, 2 * reserved_);
    const size_t room = (want + page - 1) / page * page;
    void* p = data_ ? mremap(data_, reserved_, room, MREMAP_MAYMOVE)
                    : mmap(nullptr, room, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    DSV4_REQUIRE(p != MAP_FAILED, "host cache: cannot map " + std::to_string(room) + " bytes for an arena: " +
                                      std::strerror(errno));
    data_ = static_cast<uint8_t*>(p);
    reserved_ = room;
  }
  size_ = bytes;
}

}  // namespace dsv4
