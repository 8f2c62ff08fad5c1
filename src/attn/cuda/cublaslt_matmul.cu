// cuBLASLt plans of the linears (see cublaslt_matmul.h).
#include "attn/cuda/cublaslt_matmul.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

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

}  // namespace

struct LtMatmul::Impl {
  LtProblem p;
  bool supported = false;
  std::string reason;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};

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
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (st.ok())
      st(cublasLtMatmulAlgoGetHeuristic(lt_handle(), desc, a, b, d, d, pref, 1, &result, &found),
         "cublasLtMatmulAlgoGetHeuristic");
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (!st.ok()) {
      reason = "cuBLASLt: " + st.what + ": " + status_text(st.status);
      return;
    }
    if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      reason = "cuBLASLt: no algorithm for this shape";
      return;
    }
    algo = result.algo;
    supported = true;
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
  if (st.ok())
    st(cublasLtMatmul(lt_handle(), im.desc, &alpha, a, im.a, b, im.b, &beta, d, im.d, d, im.d, &im.algo, workspace,
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
