// The GGML block formats the kernels read, and what every kernel on them shares: the type ids and block
// sizes (llama.cpp's ggml-common.h; the gguf package's GGMLQuantizationType and GGML_QUANT_SIZES, which the
// Python side reads), fp16 scales, the K-quants' packed 6-bit scales, the int8 quantizer of activation
// rows and the horizontal sums.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ggml {

enum Type : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr bool kquant(int t) { return t >= Q4_K; }
constexpr int64_t block_elems(int t) { return kquant(t) ? 256 : 32; }
constexpr int64_t block_bytes(int t) {  // 0: a type the kernels do not read
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K/Q5_K's twelve bytes of 6-bit scales and mins (llama.cpp's k_quants layout), read as three
// little-endian words u0, u1, u2 -> sc[0], sc[1]: scales 0-3 and 4-7 as the four bytes of a word; m: the
// mins alike. One source for a word (WordOps) and for a vector of words, one output per lane (the x16
// kernel's own Ops): and_(U, mask), or_(U, U), shr(U, bits), shl(U, bits) on 32-bit lanes.
template <class Ops, class U>
inline void k4_scales_mins(U u0, U u1, U u2, U* sc, U* m) {
  sc[0] = Ops::and_(u0, 0x3f3f3f3f);
  sc[1] = Ops::or_(Ops::and_(u2, 0x0f0f0f0f), Ops::shl(Ops::and_(Ops::shr(u0, 6), 0x03030303), 4));
  m[0] = Ops::and_(u1, 0x3f3f3f3f);
  m[1] = Ops::or_(Ops::and_(Ops::shr(u2, 4), 0x0f0f0f0f), Ops::shl(Ops::and_(Ops::shr(u1, 6), 0x03030303), 4));
}

struct WordOps {
  static uint32_t and_(uint32_t a, uint32_t m) { return a & m; }
  static uint32_t or_(uint32_t a, uint32_t b) { return a | b; }
  static uint32_t shr(uint32_t a, int n) { return a >> n; }
  static uint32_t shl(uint32_t a, int n) { return a << n; }
};

// the twelve bytes at q -> sc[8], m[8]
inline void scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  uint32_t u[3], o[4];
  std::memcpy(u, q, 12);
  k4_scales_mins<WordOps>(u[0], u[1], u[2], o, o + 2);
  std::memcpy(sc, o, 8);
  std::memcpy(m, o + 2, 8);
}

// ---- activations ---------------------------------------------------------------------------------------
// One row of K floats -> int8 codes q with one scale d per block of B (x ~ q * d, d = max|x| / 127), as
// llama.cpp's Q8_0 / Q8_K activations; every quantized linear's rows.
inline void quantize_row(const float* x, int64_t K, int B, int8_t* q, float* d) {
  for (int64_t b = 0; b < K / B; b++) {
    const float* xb = x + b * B;
    float amax = 0.f;
    for (int j = 0; j < B; j++) amax = std::max(amax, std::fabs(xb[j]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    for (int j = 0; j < B; j++) q[b * B + j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
  }
}

// the sum of n codes (the offset formats' and the K-quant mins' term; exact)
inline int code_sum(const int8_t* q, int n) {
  int s = 0;
  for (int j = 0; j < n; j++) s += q[j];
  return s;
}

// ---- horizontal sums: two fixed orders, each kept by the kernels that use it (changing one would change
// those kernels' bits) --------------------------------------------------------------------------------------
// ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)): the halves folded (the quantized linears)
inline float hsum_folded(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)): neighbours paired (the fused ops, as their hsum8)
inline float hsum_paired(__m256 v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

}  // namespace ggml
