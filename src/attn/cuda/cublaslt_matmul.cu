// cuBLASLt plans of the linears (see cublaslt_matmul.h).
#include "attn/cuda/cublaslt_matmul.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "attn/cuda/device_info.h"
#include "common/error.h"

namespace dsv4::cuda {
namespace {

// One handle per process (the linears run on one device). Never destroyed:
// destroying it at exit can run after the CUDA context is gone.
cublasLtHandle_t lt_handle() {
  static cublasLtHandle_t handle = [] {
    cublasLtHandle_t h = nullptr;
    const cublasStatus_t s = cublasLtCreate(&h);
    if (s != CUBLAS_STATUS_SUCCESS) throw Error("cuBLASLt: cublasLtCreate failed (status " + std::to_string(int(s)) + ")");
    return h;
  }();
  return handle;
}

// A 256-byte device buffer of zeros, never freed (like the handle): the
// scale pointers of block-scaled descriptors while their algorithm is chosen.
const void* scale_placeholder() {
  static void* p = [] {
    void* q = nullptr;
    if (cudaMalloc(&q, 256) != cudaSuccess || cudaMemset(q, 0, 256) != cudaSuccess)
      throw Error("cuBLASLt: cannot allocate the scale placeholder");
    return q;
  }();
  return p;
}

std::string status_text(cublasStatus_t s) {
  const char* name = cublasLtGetStatusName(s);
  return std::string(name ? name : "unknown") + " (" + std::to_string(int(s)) + ")";
}

// Records the first failing call; later calls are skipped.
struct Status {
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  std::string what;
  void operator()(cublasStatus_t s, const char* call) {
    if (status == CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_SUCCESS) status = s, what = call;
  }
  bool ok() const { return status == CUBLAS_STATUS_SUCCESS; }
};

template <typename T>
void set_desc(Status& st, cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v, const char* what) {
  if (st.ok()) st(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)), what);
}

template <typename T>
void set_layout(Status& st, cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr, const T& v) {
  if (st.ok()) st(cublasLtMatrixLayoutSetAttribute(l, attr, &v, sizeof(v)), "cublasLtMatrixLayoutSetAttribute");
}

template <typename T>
T algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return T{};
  return v;
}

int sm_count() {  // 0 where the runtime cannot say (no split then)
  int sms = 0;
  return query_sm_count(&sms) == cudaSuccess ? sms : 0;
}

// How many ways to split k for a block-scaled FP8 problem whose heuristic
// algorithm does not split it and covers `tiles` output tiles: when they fill
// at most an eighth of the SMs, the largest of 2, 4, 8 that keeps the grid
// within one wave and at least 4 blocks of 128 k per part (1: no split).
// cuBLASLt offers one block-scaled FP8 algorithm per shape, and for wq_a+wkv
// at up to 128 rows (12 tiles of 128 x 128, k = 4096) it runs on a tenth of
// the SMs. Measured (docs/perf-notes.md, runs Q2-Q3): split 8 takes it from
// 13.9-14.1 to 7.5-9.0 us at 32-128 rows, the same bits in those runs. At
// 24-32 tiles the gain is not general (split 4: wq_a+wkv at 256 rows 14.3 ->
// 10.9 us, one 1024 x 4096 group at 512 rows 14.6 -> 16.2), so they keep
// the heuristic's choice.
int fp8_k_splits(int tiles, int64_t k_blocks, int sms) {
  if (tiles <= 0 || 8 * tiles > sms) return 1;
  int splits = 1;
  for (int s : {2, 4, 8})
    if (tiles * s <= sms && k_blocks % s == 0 && k_blocks / s >= 4) splits = s;
  return splits;
}

}  // namespace

struct LtMatmul::Impl {
  LtProblem p;
  bool supported = false;
  std::string reason;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  // (a fixed array: nvcc 13.0's front end fails on std::vector of this type)
  cublasLtMatmulHeuristicResult_t results[kMaxCandidates] = {};  // state SUCCESS only
  int count = 0;
  int chosen = 0;

  ~Impl() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }

  void layout(Status& st, cublasLtMatrixLayout_t& l, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
              int64_t stride) {
    if (!st.ok()) return;
    st(cublasLtMatrixLayoutCreate(&l, type, uint64_t(rows), uint64_t(cols), ld), "cublasLtMatrixLayoutCreate");
    if (p.batch > 1) {
      const int32_t count = p.batch;
      set_layout(st, l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, count);
      set_layout(st, l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
    }
  }

  void build() {
    Status st;
    const bool fp8 = p.kind == LtKind::kFp8BlockScaled;
    const cudaDataType_t ab = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    const cudaDataType_t dt = p.kind == LtKind::kBf16ToF32 ? CUDA_R_32F : CUDA_R_16BF;
    st(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    set_desc(st, desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "TRANSA");
    set_desc(st, desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "TRANSB");
    if (fp8) {
      const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      set_desc(st, desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, a_mode, "A_SCALE_MODE");
      set_desc(st, desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, b_mode, "B_SCALE_MODE");
      // The heuristic rejects block scale modes without scale pointers
      // (CUBLAS_STATUS_INVALID_VALUE, measured): give it a placeholder; run()
      // sets the real ones before every call.
      const void* placeholder = scale_placeholder();
      set_desc(st, desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, placeholder, "A_SCALE_POINTER");
      set_desc(st, desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, placeholder, "B_SCALE_POINTER");
      const int8_t fast_accum = 0;  // block scaling has no fast-accumulation mode
      set_desc(st, desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum, "FAST_ACCUM");
    }
    layout(st, a, ab, p.k, p.m, p.lda, p.stride_a);
    layout(st, b, ab, p.k, p.n, p.ldb, p.stride_b);
    layout(st, d, dt, p.m, p.n, p.ldd, p.stride_d);
    cublasLtMatmulPreference_t pref = nullptr;
    if (st.ok()) st(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    if (st.ok()) {
      const uint64_t ws = p.workspace_bytes;
      st(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
         "MAX_WORKSPACE_BYTES");
    }
    cublasLtMatmulHeuristicResult_t found_results[kMaxCandidates] = {};
    int found = 0;
    if (st.ok())
      st(cublasLtMatmulAlgoGetHeuristic(lt_handle(), desc, a, b, d, d, pref, kMaxCandidates, found_results, &found),
         "cublasLtMatmulAlgoGetHeuristic");
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (!st.ok()) {
      reason = "cuBLASLt: " + st.what + ": " + status_text(st.status);
      return;
    }
    for (int i = 0; i < found; ++i)
      if (found_results[i].state == CUBLAS_STATUS_SUCCESS) results[count++] = found_results[i];
    if (count == 0) {
      reason = "cuBLASLt: no algorithm for this shape";
      return;
    }
    supported = true;
    if (fp8 && algo_config<int32_t>(results[0].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1) {
      const int sms = sm_count();
      const int splits = fp8_k_splits(int(results[0].wavesCount * float(sms) + 0.5f), p.k / 128, sms);
      const int c = splits > 1 ? add_split(splits) : -1;
      if (c >= 0) chosen = c;
    }
  }

  // Candidate 0's algorithm with k split `splits` ways, the parts summed in
  // fp32, when cuBLASLt accepts it within the workspace: its index, or -1.
  int add_split(int splits) {
    if (!supported || count == kMaxCandidates || splits < 1) return -1;
    cublasLtMatmulHeuristicResult_t r = results[0];
    const int32_t n = splits;
    const uint32_t scheme = splits > 1 ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE : CUBLASLT_REDUCTION_SCHEME_NONE;
    if (cublasLtMatmulAlgoConfigSetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &n, sizeof(n)) !=
            CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme)) !=
            CUBLAS_STATUS_SUCCESS)
      return -1;
    cublasLtMatmulHeuristicResult_t checked{};
    if (cublasLtMatmulAlgoCheck(lt_handle(), desc, a, b, d, d, &r.algo, &checked) != CUBLAS_STATUS_SUCCESS ||
        checked.workspaceSize > p.workspace_bytes)
      return -1;
    r.workspaceSize = checked.workspaceSize;
    r.wavesCount = checked.wavesCount;
    results[count] = r;
    return count++;
  }
};

LtMatmul::LtMatmul(const LtProblem& p) : impl_(std::make_unique<Impl>()) {
  impl_->p = p;
  impl_->build();
}

LtMatmul::~LtMatmul() = default;

const LtProblem& LtMatmul::problem() const { return impl_->p; }
bool LtMatmul::supported() const { return impl_->supported; }
const std::string& LtMatmul::reason() const { return impl_->reason; }
int LtMatmul::candidates() const { return impl_->count; }
int LtMatmul::chosen() const { return impl_->chosen; }

void LtMatmul::choose(int candidate) {
  DSV4_REQUIRE(candidate >= 0 && candidate < candidates(),
               "cuBLASLt: candidate " + std::to_string(candidate) + " of " + std::to_string(candidates()));
  impl_->chosen = candidate;
}

int LtMatmul::add_split_candidate(int splits) { return impl_->add_split(splits); }

int LtMatmul::splits() const {
  if (!impl_->supported) return 0;
  const cublasLtMatmulAlgo_t& algo = impl_->results[impl_->chosen].algo;
  return std::max(1, int(algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)));
}

std::string LtMatmul::describe(int candidate) const {
  DSV4_REQUIRE(candidate >= 0 && candidate < candidates(),
               "cuBLASLt: candidate " + std::to_string(candidate) + " of " + std::to_string(candidates()));
  const cublasLtMatmulHeuristicResult_t& r = impl_->results[candidate];
  const cublasLtMatmulAlgo_t& a = r.algo;
  return "id " + std::to_string(algo_config<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID)) + " tile " +
         std::to_string(algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID)) + " stages " +
         std::to_string(algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID)) + " splitk " +
         std::to_string(algo_config<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) + " red " +
         std::to_string(algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)) + " swz " +
         std::to_string(algo_config<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)) + " cluster " +
         std::to_string(algo_config<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)) + " ws " +
         std::to_string(r.workspaceSize) + " waves " + std::to_string(r.wavesCount);
}

void LtMatmul::run(const void* a, const float* a_scales, const void* b, const float* b_scales, void* d,
                   void* workspace, CUstream_st* stream) {
  Impl& im = *impl_;
  DSV4_REQUIRE(im.supported, "cuBLASLt: running an unsupported plan (" + im.reason + ")");
  Status st;
  if (im.p.kind == LtKind::kFp8BlockScaled) {
    set_desc(st, im.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(a_scales), "A_SCALE_POINTER");
    set_desc(st, im.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(b_scales), "B_SCALE_POINTER");
  }
  const float alpha = 1.0f, beta = 0.0f;
  const cublasLtMatmulAlgo_t* algo = &im.results[im.chosen].algo;
  if (st.ok())
    st(cublasLtMatmul(lt_handle(), im.desc, &alpha, a, im.a, b, im.b, &beta, d, im.d, d, im.d, algo, workspace,
                      im.p.workspace_bytes, stream),
       "cublasLtMatmul");
  if (!st.ok()) throw Error("cuBLASLt: " + st.what + ": " + status_text(st.status));
}

LtMatmul& LtPlans::get(const LtProblem& p) {
  for (auto& plan : plans_)
    if (plan->problem() == p) return *plan;
  plans_.push_back(std::make_unique<LtMatmul>(p));
  return *plans_.back();
}

}  // namespace dsv4::cuda
