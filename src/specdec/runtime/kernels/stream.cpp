// Memory-bound linears for decode steps and verify trees, and the module that binds every kernel op
// (specdec.runtime.stream loads it). y[n, o] = (sum_k x[n, k] * w[o, k]) * scale[o] + bias[o]: x and y fp32;
// w fp32, bf16, fp16 or int8, widened to fp32 in registers, so accumulation is always fp32.
//
// Why hand-written: a decode step streams every weight once, and oneDNN's/MKL's small-N kernels read
// them at ~60% of this machine's bandwidth. Weights are stored in panels of 16 outputs, [O/16][K][16],
// so each thread reads one contiguous stream while up to 6 (AVX2) or 12 (AVX-512) rows of x reuse every
// loaded vector.
//
// Batch invariant by construction: every output (n, o) is one fp32 lane accumulating x[n, k] * w[o, k]
// by FMA for k = 0, 1, ..., K-1 in order, then one multiply by its scale and one add of its bias. How
// many rows share the call, and which are computed together, never changes that sequence.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"

namespace {

constexpr int P = 16;  // outputs per panel: two 8-lane vectors

#ifdef __AVX512F__
// One 16-lane vector per panel row of x. Same per-lane operations as the AVX2 build (FMA, then one
// multiply and one add), so both builds give the same bits.
constexpr int RB = 12;  // rows of x per pass over a panel
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const at::BFloat16* w) {  // bf16 -> fp32: a 16-bit shift, exact
  __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 load16(const at::Half* w) {  // fp16 -> fp32, exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
inline __m512 load16(const int8_t* w) {  // int8 -> fp32, exact
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// The accumulators are named variables, not an array: GCC spilled an array to the stack every step.
#define SPECDEC_ROW(r) \
  if constexpr (R > r) a##r = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r * K + k]), a##r);
#define SPECDEC_OUT(r)                                                                                       \
  if constexpr (R > r) {                                                                                     \
    __m512 v = _mm512_add_ps(_mm512_mul_ps(a##r, _mm512_loadu_ps(scale)), _mm512_loadu_ps(bias));            \
    if (res) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, res + r * O));                                    \
    _mm512_mask_storeu_ps(y + r * O, m, v);                                                                  \
  }

template <int R, typename W>
void panel(const float* x, int64_t K, const W* p, const float* scale, const float* bias, const float* res,
           float* y, int64_t O, int valid) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
         a9 = a0, a10 = a0, a11 = a0;
  for (int64_t k = 0; k < K; k++) {
    const __m512 wv = load16(p + k * P);
    SPECDEC_ROW(0) SPECDEC_ROW(1) SPECDEC_ROW(2) SPECDEC_ROW(3) SPECDEC_ROW(4) SPECDEC_ROW(5)
    SPECDEC_ROW(6) SPECDEC_ROW(7) SPECDEC_ROW(8) SPECDEC_ROW(9) SPECDEC_ROW(10) SPECDEC_ROW(11)
  }
  const __mmask16 m = static_cast<__mmask16>((1u << valid) - 1);
  SPECDEC_OUT(0) SPECDEC_OUT(1) SPECDEC_OUT(2) SPECDEC_OUT(3) SPECDEC_OUT(4) SPECDEC_OUT(5)
  SPECDEC_OUT(6) SPECDEC_OUT(7) SPECDEC_OUT(8) SPECDEC_OUT(9) SPECDEC_OUT(10) SPECDEC_OUT(11)
}
#undef SPECDEC_ROW
#undef SPECDEC_OUT

#else
constexpr int RB = 6;  // rows of x per pass over a panel
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::BFloat16* w) {  // bf16 -> fp32: a 16-bit shift, exact
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline __m256 load8(const at::Half* w) {  // fp16 -> fp32 (F16C), exact
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
inline __m256 load8(const int8_t* w) {  // int8 -> fp32, exact
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

// Two 8-lane vectors per panel row of x; named accumulators (GCC spilled an array every step).
#define SPECDEC_ROW(r)                                                  \
  if constexpr (R > r) {                                                \
    const __m256 xb = _mm256_broadcast_ss(x + r * K + k);               \
    a##r##0 = _mm256_fmadd_ps(w0, xb, a##r##0);                         \
    a##r##1 = _mm256_fmadd_ps(w1, xb, a##r##1);                         \
  }
#define SPECDEC_OUT(r)                                                  \
  if constexpr (R > r) store(a##r##0, a##r##1, scale, bias, res ? res + r * O : nullptr, y + r * O, valid);

inline void store(__m256 lo, __m256 hi, const float* scale, const float* bias, const float* res, float* y,
                  int valid) {
  alignas(32) float out[P];
  _mm256_store_ps(out, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(scale)), _mm256_loadu_ps(bias)));
  _mm256_store_ps(out + 8, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(scale + 8)), _mm256_loadu_ps(bias + 8)));
  if (res) {
    for (int j = 0; j < valid; j++) y[j] = out[j] + res[j];
  } else {
    std::memcpy(y, out, sizeof(float) * valid);
  }
}

template <int R, typename W>
void panel(const float* x, int64_t K, const W* p, const float* scale, const float* bias, const float* res,
           float* y, int64_t O, int valid) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t k = 0; k < K; k++) {
    const __m256 w0 = load8(p + k * P), w1 = load8(p + k * P + 8);
    SPECDEC_ROW(0) SPECDEC_ROW(1) SPECDEC_ROW(2) SPECDEC_ROW(3) SPECDEC_ROW(4) SPECDEC_ROW(5)
  }
  SPECDEC_OUT(0) SPECDEC_OUT(1) SPECDEC_OUT(2) SPECDEC_OUT(3) SPECDEC_OUT(4) SPECDEC_OUT(5)
}
#undef SPECDEC_ROW
#undef SPECDEC_OUT
#endif

// the last N % RB rows: panel<rem>
template <int R, typename W>
void tail(int rem, const float* x, int64_t K, const W* p, const float* s, const float* b, const float* r, float* y,
          int64_t O, int valid) {
  if constexpr (R > 0) {
    if (rem == R) panel<R>(x, K, p, s, b, r, y, O, valid);
    else tail<R - 1>(rem, x, K, p, s, b, r, y, O, valid);
  }
}

template <typename W>
void run(const float* x, int64_t N, int64_t K, const W* w, int64_t O, const float* scale, const float* bias,
         const float* res, float* y) {
  const int64_t panels = (O + P - 1) / P;
  const int64_t grain = std::max<int64_t>(1, 16384 / (K * P * int64_t(sizeof(W))) + 1);
  at::parallel_for(0, panels, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) {
      const W* p = w + i * K * P;
      const int64_t o = i * P;
      const int valid = static_cast<int>(std::min<int64_t>(P, O - o));
      const float *s = scale + o, *b = bias + o;
      int64_t n = 0;
      for (; n + RB <= N; n += RB) panel<RB>(x + n * K, K, p, s, b, res ? res + n * O + o : nullptr, y + n * O + o, O, valid);
      tail<RB - 1>(static_cast<int>(N - n), x + n * K, K, p, s, b, res ? res + n * O + o : nullptr, y + n * O + o, O,
                   valid);
    }
  });
}

}  // namespace

// w [O, K] -> panels [ceil(O/16) * K * 16], zero-padded
torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "w must be [O, K]");
  const int64_t O = w.size(0), K = w.size(1), panels = (O + P - 1) / P;
  auto padded = torch::zeros({panels * P, K}, w.options());
  padded.narrow(0, 0, O).copy_(w);
  return padded.view({panels, P, K}).transpose(1, 2).contiguous().view({-1});
}

// x [..., K] fp32; packed from pack(); scale and bias fp32 [ceil(O/16) * 16] (padded) -> [..., O];
// with residual [..., O]: residual + that (the layer's skip connection, the same bits as adding after)
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t O, const torch::Tensor& scale,
                     const torch::Tensor& bias, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.device().is_cpu(), "x must be fp32 on the CPU");
  const int64_t K = x.size(-1), panels = (O + P - 1) / P;
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == panels * P * K, "packed weights do not match x");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == panels * P);
  TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.is_contiguous() && bias.numel() == panels * P);
  const auto xs = x.reshape({-1, K}).contiguous();
  const int64_t N = xs.size(0);
  auto shape = x.sizes().vec();
  shape.back() = O;
  auto y = torch::empty({N, O}, x.options());
  const float *xp = xs.data_ptr<float>(), *sp = scale.data_ptr<float>(), *bp = bias.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* rp = nullptr;
  torch::Tensor r;
  if (residual.has_value()) {
    r = residual->reshape({-1, O}).contiguous();
    TORCH_CHECK(r.scalar_type() == torch::kFloat && r.size(0) == N, "residual must be fp32 and match the output");
    rp = r.data_ptr<float>();
  }
  switch (packed.scalar_type()) {
    case torch::kFloat: run(xp, N, K, packed.data_ptr<float>(), O, sp, bp, rp, yp); break;
    case torch::kBFloat16: run(xp, N, K, packed.data_ptr<at::BFloat16>(), O, sp, bp, rp, yp); break;
    case torch::kHalf: run(xp, N, K, packed.data_ptr<at::Half>(), O, sp, bp, rp, yp); break;
    case torch::kChar: run(xp, N, K, packed.data_ptr<int8_t>(), O, sp, bp, rp, yp); break;
    default: TORCH_CHECK(false, "weights must be fp32, bf16, fp16 or int8");
  }
  return y.view(shape);
}

#define SPECDEC_STR_(x) #x
#define SPECDEC_STR(x) SPECDEC_STR_(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
#ifdef SPECDEC_BUILD_KEY  // what it was built from (kernel_build.build_key): a stale install is not used
  m.attr("build_key") = SPECDEC_STR(SPECDEC_BUILD_KEY);
#endif
  m.def("pack", &pack);
  m.def("linear", &linear, py::arg("x"), py::arg("packed"), py::arg("O"), py::arg("scale"), py::arg("bias"),
        py::arg("residual") = py::none());
  m.def("qlinear", &qlinear, py::arg("x"), py::arg("ws"), py::arg("types"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("qdequant", &qdequant);
  m.def("qlinear16", &qlinear16, py::arg("x"), py::arg("ws"), py::arg("types"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("repack16", &repack16);
  m.def("unpack16", &unpack16);
  m.def("qdequant16", &qdequant16);
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_store", &rope_store);
  m.def("attend", &attend, py::arg("q"), py::arg("kc"), py::arg("vc"), py::arg("start"), py::arg("mask") = py::none());
  m.def("rope_store_many", &rope_store_many);
  m.def("attend_many", &attend_many);
  m.def("uniform64", &uniform64);
  m.def("race", &race);
  bind_layers(m);
}
