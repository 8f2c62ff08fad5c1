#pragma once
// A kernel timeline of one replayed step through CUPTI's activity records
// (what Nsight Systems reads; the lent H200 has no nsys). Unlike Nsight
// Compute, it leaves concurrent streams and PDL overlap as they are, so it
// shows which chain of a laned step is critical and where the GPU sits idle.
//   KernelTrace t; t.start(); <one step>; t.stop(); t.write_csv(f); t.summary();
// Without CUPTI (DSV4_HAVE_CUPTI undefined) start() throws.
#include <cxxabi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef DSV4_HAVE_CUPTI
#include <cupti.h>
#endif

namespace dsv4::bench {

struct KernelRecord {
  std::string name;  // demangled, template arguments kept (they tell instantiations apart)
  uint32_t stream = 0;
  uint64_t start = 0, end = 0;  // ns, GPU clock
  int grid = 0;                 // CTAs
};

class KernelTrace {
 public:
  void start();
  void stop();  // flushes: every record of the step is in after it
  void write_csv(const std::string& path) const;
  void summary(int top) const;

 private:
  static inline std::vector<KernelRecord> records_;
#ifdef DSV4_HAVE_CUPTI
  static void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records);
  static void CUPTIAPI completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid);
#endif
};

inline std::string demangle(const char* name) {
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : name;
  std::free(d);
  return s;
}

// "void ns::(anonymous namespace)::gemv_kernel<...>(Args)" -> "gemv_kernel".
inline std::string kernel_base_name(std::string n) {
  for (const std::string anon = "(anonymous namespace)::"; n.find(anon) != std::string::npos;)
    n.erase(n.find(anon), anon.size());
  if (n.rfind("void ", 0) == 0) n.erase(0, 5);
  n = n.substr(0, n.find_first_of("<("));
  if (const size_t c = n.rfind("::"); c != std::string::npos) n = n.substr(c + 2);
  return n;
}

#ifdef DSV4_HAVE_CUPTI
inline void check_cupti(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  throw std::runtime_error(std::string("CUPTI ") + what + ": " + (msg ? msg : "unknown"));
}

inline void CUPTIAPI KernelTrace::requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = size_t(8) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = kBytes;
  *max_records = 0;
}

inline void CUPTIAPI KernelTrace::completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    records_.push_back({demangle(k->name), k->streamId, k->start, k->end, k->gridX * k->gridY * k->gridZ});
  }
  std::free(buffer);
}

inline void KernelTrace::start() {
  records_.clear();
  check_cupti(cuptiActivityRegisterCallbacks(requested, completed), "register callbacks");
  check_cupti(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernel records");
}

inline void KernelTrace::stop() {
  check_cupti(cuptiActivityFlushAll(1), "flush");
  check_cupti(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "disable kernel records");
  std::sort(records_.begin(), records_.end(),
            [](const KernelRecord& a, const KernelRecord& b) { return a.start < b.start; });
}
#else
inline void KernelTrace::start() { throw std::runtime_error("built without CUPTI: no kernel trace"); }
inline void KernelTrace::stop() {}
#endif

inline void KernelTrace::write_csv(const std::string& path) const {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  const uint64_t t0 = records_.empty() ? 0 : records_.front().start;
  std::fprintf(f, "start_ns,end_ns,stream,ctas,kernel\n");
  for (const KernelRecord& r : records_)
    std::fprintf(f, "%llu,%llu,%u,%d,\"%s\"\n", (unsigned long long)(r.start - t0), (unsigned long long)(r.end - t0),
                 r.stream, r.grid, r.name.c_str());
  std::fclose(f);
}

// Span, time with at least one kernel running, and per kernel (name without
// template arguments): launches, summed and mean duration, the `top` largest.
// A kernel launched with PDL (pdl.cuh) starts before the kernel it waits
// for ends, so its duration includes that wait: the CSV's end times, not
// the durations, give the chain.
inline void KernelTrace::summary(int top) const {
  if (records_.empty()) return;
  uint64_t busy = 0, reach = records_.front().start, last_end = 0;
  for (const KernelRecord& r : records_) {
    const uint64_t from = std::max(r.start, reach);
    if (r.end > from) busy += r.end - from;
    reach = std::max(reach, r.end);
    last_end = std::max(last_end, r.end);
  }
  const double span = double(last_end - records_.front().start);
  std::printf("trace: %zu kernels, span %.1f us, some kernel running %.1f us (%.0f%%)\n", records_.size(), span / 1e3,
              busy / 1e3, 100.0 * busy / span);
  struct Sum {
    int n = 0;
    double ns = 0;
  };
  std::map<std::string, Sum> by;
  for (const KernelRecord& r : records_) {
    Sum& b = by[kernel_base_name(r.name)];
    b.n++, b.ns += double(r.end - r.start);
  }
  std::vector<std::pair<std::string, Sum>> v(by.begin(), by.end());
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
  std::printf("| kernel | launches | sum us | mean us |\n|---|---|---|---|\n");
  for (int i = 0; i < int(v.size()) && i < top; ++i)
    std::printf("| %s | %d | %.1f | %.2f |\n", v[i].first.c_str(), v[i].second.n, v[i].second.ns / 1e3,
                v[i].second.ns / 1e3 / v[i].second.n);
}

}  // namespace dsv4::bench
