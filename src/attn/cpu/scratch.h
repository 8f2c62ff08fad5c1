#pragma once
// Activation buffers the CPU backend's ops reuse from layer to layer and step
// to step (the CPU's workspace). Each op sizes a buffer to its step with
// `sized` (a vector keeps its capacity) and writes every element it later
// reads, so once the largest step has run nothing more is allocated. With a
// fresh vector per op and layer, 28% of `dsv4 run`'s cycles went to zeroing
// new pages and the faults under it (perf-notes, "The CPU path").
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsv4 {

struct CpuScratch {
  std::vector<float> cq, q, o;            // the layer's q latent, q heads and attention output
  std::vector<float> kv;                  // the layer's kv before its cache insert
  std::vector<float> u;                   // wo_a's output, wo_b's input
  std::vector<uint16_t> q_bits, o_bits;   // q and o as bf16 bits for the attention kernel
  std::vector<float> xq;                  // a Linear's FP8-quantized input
  std::vector<float> proj;                // a compressor's [a | g] rows

  // Bytes held (capacity, not size): the workspace the backend reports.
  int64_t bytes() const {
    const auto f = [](const auto& v) { return int64_t(v.capacity() * sizeof(v[0])); };
    return f(cq) + f(q) + f(o) + f(kv) + f(u) + f(q_bits) + f(o_bits) + f(xq) + f(proj);
  }
};

// v resized to n elements and its data. Elements kept from an earlier use
// hold stale values: the caller writes before it reads.
template <class T>
T* sized(std::vector<T>& v, size_t n) {
  v.resize(n);
  return v.data();
}

}  // namespace dsv4
