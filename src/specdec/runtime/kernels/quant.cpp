// Linears on GGUF-quantized weights, read in the file's own block formats (never de-quantized to a float
// matrix): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (super-blocks of 256).
//
// Each activation row is quantized on its own to int8 (like llama.cpp's Q8_0 / Q8_K activations): blocks
// of 32 with one fp32 scale for the 32-blocks, blocks of 256 with one scale and sums per 16 for K-quants.
// A weight block's integer codes meet the row's int8 codes in integer dot products (vpmaddubsw/vpmaddwd,
// vpdpbusd), which are exact whatever their order; per block, fp32 scales are then applied by FMA into
// fp32 lanes in block order, and the lanes are summed in one fixed order. So every output (n, o) is the
// same sequence of operations whatever else shares the call: batch invariant by construction. The AVX2
// and AVX-512 code do the same per lane: the same bits on either machine.
//
// Weight rows are decoded block by block into small L1 buffers (codes as bytes, scales as vectors) once
// per output, then every activation row of the call reuses them; a call of at most three rows decodes
// 32-blocks in registers instead (the same values, so the same bits).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ggml_blocks.h"
#include "ops.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace {

using namespace ggml;

// ---- activations ---------------------------------------------------------------------------------------
// One row of K floats -> int8 codes q, with per-block scale d (x ~ q * d); B = 32 or 256.
// 32-blocks also keep s = d * sum(q) (the offset formats' term); 256-blocks keep int16 sums per 16.
struct Acts {
  int64_t N = 0, K = 0;
  std::vector<int8_t> q;
  // 32-blocks, rows padded to a multiple of 8 blocks (zeros): d32x each block's scale eight times (one per
  // integer lane of its dot product), s32 per block
  int64_t nb32 = 0;  // Decoded::pad8(K / 32)
  std::vector<float> d32x, s32, d256;
  std::vector<int16_t> bsum;
  bool has32 = false, has256 = false;
};

// ---- weights, decoded per block into an L1 buffer ------------------------------------------------------
// K-quant super-block: value_j = D * sc[j/16] * c_j - M * m[j/16]; c unsigned bytes.
struct SuperBlock {
  alignas(64) uint8_t c[256];
  alignas(64) int16_t sc[8][16];  // per 32 codes: lanes 0-7 the first 16's scale, 8-15 the second's
  alignas(32) int16_t m[16];      // offset per 16 (multiplies the activation sums per 16)
  float D, M;
};

// per 32 codes one scale (Q4_K, Q5_K): both halves of the vector alike; the mins per 16, each twice
inline void set_scales_32(SuperBlock& s, const uint8_t* sc, const uint8_t* m) {
  for (int k = 0; k < 8; k++)
    _mm256_store_si256(reinterpret_cast<__m256i*>(s.sc[k]), _mm256_set1_epi16(sc[k]));
  const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m));
  _mm256_store_si256(reinterpret_cast<__m256i*>(s.m), _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)));
}

// Q4_K/Q5_K's common head: d, dmin, then the packed scales and mins
void header_k4(const uint8_t* b, SuperBlock& s) {
  s.D = h2f(b);
  s.M = h2f(b + 2);
  uint8_t sc[8], m[8];
  scales_mins_k4(b + 4, sc, m);
  set_scales_32(s, sc, m);
}

void decode_q4k(const uint8_t* b, SuperBlock& s) {
  header_k4(b, s);
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; c++) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
    _mm256_store_si256(reinterpret_cast<__m256i*>(s.c + 64 * c), _mm256_and_si256(v, lo4));
    _mm256_store_si256(reinterpret_cast<__m256i*>(s.c + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4));
  }
}

void decode_q5k(const uint8_t* b, SuperBlock& s) {
  header_k4(b, s);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  for (int c = 0; c < 4; c++) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * c));
    const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one);
    const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one);
    _mm256_store_si256(reinterpret_cast<__m256i*>(s.c + 64 * c),
                       _mm256_or_si256(_mm256_and_si256(v, lo4), _mm256_slli_epi16(h0, 4)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(s.c + 64 * c + 32),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), _mm256_slli_epi16(h1, 4)));
  }
}

void decode_q6k(const uint8_t* b, SuperBlock& s) {
  s.D = s.M = h2f(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
  // sc[k]: the low half sc16[2k] eight times, the high half sc16[2k+1]; a byte shuffle per k
  const __m256i first = _mm256_permute4x64_epi64(sc16, 0x44), second = _mm256_permute4x64_epi64(sc16, 0xEE);
  for (int k = 0; k < 8; k++) {
    const int lo = (2 * k) % 8, hi = (2 * k + 1) % 8;
    const __m256i pick = _mm256_setr_epi8(2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1,
                                          2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1,
                                          2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1,
                                          2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(s.sc[k]), _mm256_shuffle_epi8(k < 4 ? first : second, pick));
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(s.m), _mm256_slli_epi16(sc16, 5));  // codes are stored + 32
  const __m256i lo4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; h++) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
    const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    auto hi = [&](int shift) {
      return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, shift), three), 4);
    };
    uint8_t* out = s.c + 128 * h;
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), _mm256_or_si256(_mm256_and_si256(a, lo4), hi(0)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_or_si256(_mm256_and_si256(bb, lo4), hi(2)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), lo4), hi(4)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + 96),
                       _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bb, 4), lo4), hi(6)));
  }
}

void decode_k(int t, const uint8_t* b, SuperBlock& s) {
  if (t == Q4_K) decode_q4k(b, s);
  else if (t == Q5_K) decode_q5k(b, s);
  else decode_q6k(b, s);
}

// 32-block: value_j = D * c_j + Moff; c unsigned bytes (Q8_0: signed, Moff = 0).
struct Block32 {
  alignas(32) uint8_t c[32];
  float D, Moff;
};

// 32 bits -> 32 bytes, 0x10 where the bit is set (the fifth bit of Q5_0/Q5_1 codes)
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

inline __m256i nibbles(const uint8_t* qs) {  // 16 bytes -> codes 0..15 (low nibbles first)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), lo4), _mm_and_si128(v, lo4));
}

inline __m256i decode_32(int t, const uint8_t* b, float& D, float& Moff) {
  const float d = h2f(b);
  D = d;
  uint32_t qh;
  switch (t) {
    case Q8_0: Moff = 0.f; return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    case Q4_0: Moff = -8.f * d; return nibbles(b + 2);
    case Q4_1: Moff = h2f(b + 2); return nibbles(b + 4);
    case Q5_0:
      std::memcpy(&qh, b + 2, 4);
      Moff = -16.f * d;
      return _mm256_or_si256(nibbles(b + 6), fifth_bits(qh));
    default:  // Q5_1
      std::memcpy(&qh, b + 4, 4);
      Moff = h2f(b + 2);
      return _mm256_or_si256(nibbles(b + 8), fifth_bits(qh));
  }
}

void decode_32(int t, const uint8_t* b, Block32& s) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(s.c), decode_32(t, b, s.D, s.Moff));
}

// Where a tile of activation rows reads a weight row's 32-blocks from. Both give the same codes and
// scales (zero past the row's nb blocks: they add +0), so the same bits: `Decoded`, a row decoded once
// into an L1 buffer for the many tiles of a long call; `Direct`, decoded in registers for a call of one tile.
struct Decoded {
  std::vector<uint8_t> c;  // codes (Q8_0: signed)
  std::vector<float> Dx, Moff;  // each block's scale eight times (a pair of blocks: one 16-lane load)
  explicit Decoded(int64_t nb) : c(pad8(nb) * 32, 0), Dx(pad8(nb) * 8, 0.f), Moff(pad8(nb), 0.f) {}
  static int64_t pad8(int64_t nb) { return (nb + 7) / 8 * 8; }
  void fill(int t, const uint8_t* row, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
      float d;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c.data() + 32 * i),
                          decode_32(t, row + i * block_bytes(t), d, Moff[i]));
      _mm256_storeu_ps(Dx.data() + 8 * i, _mm256_set1_ps(d));
    }
  }
#ifdef __AVX512BW__
  __m512i pair(int64_t i, __m512& d) const {
    d = _mm512_loadu_ps(Dx.data() + 8 * i);
    return _mm512_loadu_si512(c.data() + 32 * i);
  }
#endif
  __m256i block(int64_t i, __m256& d) const {
    d = _mm256_loadu_ps(Dx.data() + 8 * i);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c.data() + 32 * i));
  }
  const float* moff(int64_t i0) const { return Moff.data() + i0; }
};

// One weight row of type T decoded in registers (one activation row: no buffer to write and read back).
template <int T>
struct Direct {
  const uint8_t* row;
  int64_t nb;
  alignas(32) float mo[8] = {};  // the offsets of the current group of 8 blocks
  __m256i block(int64_t i, __m256& d) {
    float s = 0.f;
    __m256i c = _mm256_setzero_si256();
    mo[i % 8] = 0.f;
    if (i < nb) c = decode_32(T, row + i * block_bytes(T), s, mo[i % 8]);
    d = _mm256_set1_ps(s);
    return c;
  }
#ifdef __AVX512BW__
  __m512i pair(int64_t i, __m512& d) {
    __m256 d0, d1;
    const __m256i c0 = block(i, d0), c1 = block(i + 1, d1);
    d = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1);
  }
#endif
  const float* moff(int64_t) const { return mo; }
};

// A forward streams its weights from memory, and a row's dot products leave few loads in flight: each
// output asks for the weight row after next up front (measured: a SmolLM2 Q4_1 forward at one row 1.3x
// faster, Qwen2.5-1.5B Q4_K_M 1.05x). Past the last row it is harmless: a prefetch never faults.
inline void prefetch_row_after_next(const uint8_t* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(row + 2 * bytes + off), _MM_HINT_T0);
}

// The vector steps of the dot products below at either width: Lanes8 holds one 32-block (or 32 K-quant
// codes) a vector, Lanes16 two. One source per kernel; per lane both widths do the same integer and float
// steps (integer sums are exact, the float ones the same per lane), so both give the same bits.
struct Lanes8 {
  static constexpr int W = 1;  // 32-blocks per vector
  using VI = __m256i;
  using VF = __m256;
  using Sign = __m256i;  // what gives x a weight's signs: the weight itself (vpsignb)
  static VI load(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }
  static VI loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static VF loadf(const float* p) { return _mm256_loadu_ps(p); }
  static VI izero() { return _mm256_setzero_si256(); }
  static VF zero() { return _mm256_setzero_ps(); }
  template <class Src>
  static VI blocks(Src& src, int64_t i, VF& d) { return src.block(i, d); }
  static VI abs8(VI w) { return _mm256_sign_epi8(w, w); }
  static Sign signs(bool, VI w) { return w; }
  static VI with_sign(VI x, Sign w) { return _mm256_sign_epi8(x, w); }
  static VI dot4(VI u, VI x) {  // per 32-bit lane the four products u8 x s8, summed (exact)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
  }
  static VI maddubs(VI w, VI x) { return _mm256_maddubs_epi16(w, x); }
  static VI madd_add(VI acc, VI p, VI sc) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc)); }
  static VF cvt(VI v) { return _mm256_cvtepi32_ps(v); }
  static VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  static VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256i fold(VI v) { return v; }  // -> the eight lanes of one block
  static __m256 fold(VF even, VF odd) { return _mm256_add_ps(even, odd); }  // the even and odd blocks' sums
};

#ifdef __AVX512BW__
struct Lanes16 {
  static constexpr int W = 2;  // lanes 0-7 the even block, 8-15 the odd one
  using VI = __m512i;
  using VF = __m512;
  using Sign = __mmask64;  // the weight's negative bytes
  static VI load(const void* p) { return _mm512_load_si512(p); }
  static VI loadu(const void* p) { return _mm512_loadu_si512(p); }
  static VF loadf(const float* p) { return _mm512_loadu_ps(p); }
  static VI izero() { return _mm512_setzero_si512(); }
  static VF zero() { return _mm512_setzero_ps(); }
  template <class Src>
  static VI blocks(Src& src, int64_t i, VF& d) { return src.pair(i, d); }
  static VI abs8(VI w) { return _mm512_abs_epi8(w); }
  static Sign signs(bool sgn, VI w) { return sgn ? _mm512_movepi8_mask(w) : 0; }
  static VI with_sign(VI x, Sign neg) { return _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x); }
  static VI dot4(VI u, VI x) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1));
#endif
  }
  static VI maddubs(VI w, VI x) { return _mm512_maddubs_epi16(w, x); }
  static VI madd_add(VI acc, VI p, VI sc) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, p, sc);  // the same integer as madd + add
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc));
#endif
  }
  static VF cvt(VI v) { return _mm512_cvtepi32_ps(v); }
  static VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  static VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256i fold(VI v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }
  static __m256 fold(VF both, VF) {  // one accumulator: its halves
    return _mm256_add_ps(_mm512_castps512_ps256(both), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(both), 1)));
  }
};
using Widest = Lanes16;
#else
using Widest = Lanes8;
#endif
constexpr int TILE = 4 * Widest::W;  // activation rows per pass of the many-row kernels

// One output of one weight row over activation rows n0..n0+R-1, its decoded super-blocks shared: each
// weight vector and scale vector is loaded once per R rows. Per row, the integer lanes and the float steps
// are those of any other R (and of dot_q4k_one), so an output's bits never depend on the tile. With 16
// lanes, two sub-blocks per instruction; adding the halves gives every lane the very integer the 8-lane
// loop sums.
template <class V, int R>
void dot_k_rows(const SuperBlock* buf, int64_t nb, int64_t K, const Acts& a, int64_t n0, float* y, int64_t ystride) {
  constexpr int W = V::W;
  const int8_t* xq[R];
  __m256 acc[R];
  for (int r = 0; r < R; r++) {
    xq[r] = a.q.data() + (n0 + r) * K;
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < nb; i++) {
    const SuperBlock& s = buf[i];
    typename V::VI wide[R];
    for (int r = 0; r < R; r++) wide[r] = V::izero();
    for (int k = 0; k < 8 / W; k++) {
      const typename V::VI w = V::load(s.c + 32 * W * k);
      const typename V::VI sc = V::load(s.sc[W * k]);
      for (int r = 0; r < R; r++) {
        const typename V::VI p = V::maddubs(w, V::loadu(xq[r] + i * 256 + 32 * W * k));  // |pair| <= 2 * 63 * 127
        wide[r] = V::madd_add(wide[r], p, sc);
      }
    }
    const __m256i m = _mm256_load_si256(reinterpret_cast<const __m256i*>(s.m));
    for (int r = 0; r < R; r++) {
      const int16_t* bs = a.bsum.data() + (n0 + r) * (K / 16) + i * 16;
      const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)), m);
      const float xd = a.d256[(n0 + r) * nb + i];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(V::fold(wide[r])), _mm256_set1_ps(s.D * xd), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-s.M * xd), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) y[(n0 + r) * ystride] = hsum_folded(acc[r]);
}

// one output of one weight row over N activation rows
// (rows n0..n0+N-1; y points at row n0's output)
void dot_k(int t, const uint8_t* row, int64_t K, const Acts& a, int64_t n0, int64_t N, std::vector<SuperBlock>& buf,
           float* y, int64_t ystride) {
  const int64_t nb = K / 256;
  for (int64_t i = 0; i < nb; i++) decode_k(t, row + i * block_bytes(t), buf[i]);
  y -= n0 * ystride;
  N += n0;
  int64_t n = n0;
  for (; n + TILE <= N; n += TILE) dot_k_rows<Widest, TILE>(buf.data(), nb, K, a, n, y, ystride);
  switch (N - n) {
    case 7: dot_k_rows<Widest, 7>(buf.data(), nb, K, a, n, y, ystride); break;
    case 6: dot_k_rows<Widest, 6>(buf.data(), nb, K, a, n, y, ystride); break;
    case 5: dot_k_rows<Widest, 5>(buf.data(), nb, K, a, n, y, ystride); break;
    case 4: dot_k_rows<Widest, 4>(buf.data(), nb, K, a, n, y, ystride); break;
    case 3: dot_k_rows<Widest, 3>(buf.data(), nb, K, a, n, y, ystride); break;
    case 2: dot_k_rows<Widest, 2>(buf.data(), nb, K, a, n, y, ystride); break;
    case 1: dot_k_rows<Widest, 1>(buf.data(), nb, K, a, n, y, ystride); break;
    default: break;
  }
}

// Per block and activation row: the integer dot product in eight lanes (four codes each, exact), converted
// to fp32 and multiplied by the block's weight scale times the row's, FMA into an accumulator that even
// blocks and odd blocks each have their own of (with 16 lanes: its two halves); per 8 blocks, the offsets
// (Moff times the row's scaled code sums) by FMA into a third. At the end: the two accumulators added lane
// by lane, then each accumulator's lanes summed in one fixed order. No horizontal step per block: the
// integer work sets the pace. Activation rows n0..n0+R-1 share each weight vector load; per row the steps
// are those of any other R.
template <class V, int R, class Src>
void dot_32_rows(bool sgn, Src& src, int64_t K, const Acts& a, int64_t n0, float* y, int64_t ystride) {
  constexpr int W = V::W, NA = 2 / W;  // accumulators per row
  const int64_t nbp = a.nb32;
  const int8_t* xq[R];  // past a row's end: the next row's codes or padding, times zero codes
  const float* xd[R];
  const float* xs[R];
  __m256 off[R];
  for (int r = 0; r < R; r++) {
    xq[r] = a.q.data() + (n0 + r) * K;
    xd[r] = a.d32x.data() + (n0 + r) * nbp * 8;
    xs[r] = a.s32.data() + (n0 + r) * nbp;
    off[r] = _mm256_setzero_ps();
  }
  const int64_t nb = K / 32;
  typename V::VF acc[NA][R];
  for (int j = 0; j < NA; j++)
    for (int r = 0; r < R; r++) acc[j][r] = V::zero();
  for (int64_t i = 0; i < nbp; i += W) {
    typename V::VF dw;
    const typename V::VI w = V::blocks(src, i, dw);  // past the row: only the offsets' group is completed
    if (i < nb) {
      // signed codes: |w| times x with w's sign (where w = 0 the product is 0 anyway)
      const typename V::VI wa = sgn ? V::abs8(w) : w;
      const typename V::Sign neg = V::signs(sgn, w);
      for (int r = 0; r < R; r++) {
        typename V::VI x = V::loadu(xq[r] + 32 * i);
        if (sgn) x = V::with_sign(x, neg);
        typename V::VF& ar = acc[(i / W) & (NA - 1)][r];
        ar = V::fma(V::cvt(V::dot4(wa, x)), V::mul(dw, V::loadf(xd[r] + 8 * i)), ar);
      }
    }
    if ((i + W) % 8 == 0) {
      const __m256 wm = _mm256_loadu_ps(src.moff(i + W - 8));
      for (int r = 0; r < R; r++) off[r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(xs[r] + i + W - 8), off[r]);
    }
  }
  for (int r = 0; r < R; r++) y[(n0 + r) * ystride] = hsum_folded(V::fold(acc[0][r], acc[NA - 1][r])) + hsum_folded(off[r]);
}

// Calls of many rows run the widest vectors; calls of a few, decoded in registers, run 8-lane ones: measured
// in a SmolLM2 forward, 16-lane FP work at one row made every linear ~40% slower (the clock drops under it).
template <class Src>
void dot_32_tiles(bool sgn, Src& src, int64_t K, const Acts& a, int64_t n, int64_t N, float* y, int64_t ystride) {
  for (; n + TILE <= N; n += TILE) dot_32_rows<Widest, TILE>(sgn, src, K, a, n, y, ystride);
  switch (N - n) {
#ifdef __AVX512BW__
    case 7: dot_32_rows<Widest, 7>(sgn, src, K, a, n, y, ystride); break;
    case 6: dot_32_rows<Widest, 6>(sgn, src, K, a, n, y, ystride); break;
    case 5: dot_32_rows<Widest, 5>(sgn, src, K, a, n, y, ystride); break;
    case 4: dot_32_rows<Widest, 4>(sgn, src, K, a, n, y, ystride); break;
#endif
    case 3: dot_32_rows<Widest, 3>(sgn, src, K, a, n, y, ystride); break;
    case 2: dot_32_rows<Widest, 2>(sgn, src, K, a, n, y, ystride); break;
    case 1: dot_32_rows<Widest, 1>(sgn, src, K, a, n, y, ystride); break;
    default: break;
  }
}

constexpr int DIRECT32 = 3;  // calls of at most this many rows decode weights in registers

template <int T>
void dot_32_direct(const uint8_t* row, int64_t K, const Acts& a, int64_t n0, int64_t N, float* y, int64_t ystride) {
  Direct<T> src{row, K / 32};
  switch (N) {
    case 3: return dot_32_rows<Lanes8, 3>(T == Q8_0, src, K, a, n0, y, ystride);
    case 2: return dot_32_rows<Lanes8, 2>(T == Q8_0, src, K, a, n0, y, ystride);
    default: return dot_32_rows<Lanes8, 1>(T == Q8_0, src, K, a, n0, y, ystride);
  }
}

// one output of one weight row over activation rows n0..n0+N-1 (y points at row n0's output)
void dot_32(int t, const uint8_t* row, int64_t K, const Acts& a, int64_t n0, int64_t N, Decoded& buf, float* y,
            int64_t ystride) {
  y -= n0 * ystride;
  if (N <= DIRECT32) {
    switch (t) {
      case Q8_0: return dot_32_direct<Q8_0>(row, K, a, n0, N, y, ystride);
      case Q4_0: return dot_32_direct<Q4_0>(row, K, a, n0, N, y, ystride);
      case Q4_1: return dot_32_direct<Q4_1>(row, K, a, n0, N, y, ystride);
      case Q5_0: return dot_32_direct<Q5_0>(row, K, a, n0, N, y, ystride);
      default: return dot_32_direct<Q5_1>(row, K, a, n0, N, y, ystride);
    }
  }
  buf.fill(t, row, K / 32);
  dot_32_tiles(t == Q8_0, buf, K, a, n0, n0 + N, y, ystride);
}

// One activation row on Q4_K: the weights decoded in registers, no buffer. The same integer lanes and the
// same float steps as dot_k (scale vectors hold one value per 32 codes), so the same bits.
void dot_q4k_one(const uint8_t* row, int64_t K, const Acts& a, float* y) {
  const int64_t nb = K / 256;
  const int8_t* xq = a.q.data();
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; i++) {
    const uint8_t* b = row + i * 144;
    if (i + 2 < nb) _mm_prefetch(reinterpret_cast<const char*>(b + 288), _MM_HINT_T0);
    uint8_t sc[8], m[8];
    scales_mins_k4(b + 4, sc, m);
    __m256i isum = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * 256 + 64 * c));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * 256 + 64 * c + 32));
      const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v, lo4), x0), _mm256_set1_epi16(sc[2 * c]));
      const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), x1),
                                           _mm256_set1_epi16(sc[2 * c + 1]));
      isum = _mm256_add_epi32(isum, _mm256_add_epi32(p0, p1));
    }
    const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m));
    const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsum.data() + i * 16)),
                                           _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)));
    const float xd = a.d256[i];
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(h2f(b) * xd), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-h2f(b + 2) * xd), acc);
  }
  *y = hsum_folded(acc);
}

void quantize_acts(const float* x, int64_t N, int64_t K, bool need32, bool need256, Acts& a) {
  a.N = N;
  a.K = K;
  a.has32 = need32;
  a.has256 = need256;
  a.q.resize(N * K);  // one layout per call: qlinear refuses to mix block families
  if (need32) {  // dot_32 reads whole groups of 8 blocks: codes past the last row, scales per row padded
    a.q.resize(N * K + 8 * 32, 0);
    a.nb32 = Decoded::pad8(K / 32);
    a.d32x.assign(N * a.nb32 * 8, 0.f);
    a.s32.assign(N * a.nb32, 0.f);
  }
  if (need256) {
    a.d256.resize(N * (K / 256));
    a.bsum.resize(N * (K / 16));
  }
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; n++) {
      const float* xr = x + n * K;
      int8_t* q = a.q.data() + n * K;
      if (need256) {
        quantize_row(xr, K, 256, q, a.d256.data() + n * (K / 256));
        for (int64_t g = 0; g < K / 16; g++) a.bsum[n * (K / 16) + g] = static_cast<int16_t>(code_sum(q + g * 16, 16));
      }
      if (need32) {
        std::vector<float> d(K / 32);
        quantize_row(xr, K, 32, q, d.data());
        for (int64_t b = 0; b < K / 32; b++) {
          a.s32[n * a.nb32 + b] = d[b] * static_cast<float>(code_sum(q + b * 32, 32));
          for (int j = 0; j < 8; j++) a.d32x[(n * a.nb32 + b) * 8 + j] = d[b];
        }
      }
    }
  });
}

}  // namespace

// x [..., K] fp32; ws: weights [O_i, K / block * bytes] uint8 in GGUF layout, types: their GGML type ids;
// the outputs of all segments side by side -> [..., sum O_i] (+ bias, then + residual when given).
torch::Tensor qlinear(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types,
                      const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.device().is_cpu(), "x must be fp32 on the CPU");
  TORCH_CHECK(ws.size() == types.size() && !ws.empty(), "one type per weight");
  const int64_t K = x.size(-1);
  int64_t O = 0;
  bool k32 = false, k256 = false;
  for (size_t i = 0; i < ws.size(); i++) {
    const int t = static_cast<int>(types[i]);
    TORCH_CHECK(block_bytes(t) > 0, "unsupported weight type ", t);
    TORCH_CHECK(K % block_elems(t) == 0, "K must be a multiple of the block size");
    TORCH_CHECK(ws[i].scalar_type() == torch::kUInt8 && ws[i].is_contiguous() && ws[i].dim() == 2 &&
                    ws[i].size(1) == K / block_elems(t) * block_bytes(t),
                "weights do not match x");
    (kquant(t) ? k256 : k32) = true;
    O += ws[i].size(0);
  }
  TORCH_CHECK(!(k32 && k256), "one call mixes 32-block and K-quant weights");
  const auto xs = x.reshape({-1, K}).contiguous();
  const int64_t N = xs.size(0);
  Acts acts;
  quantize_acts(xs.data_ptr<float>(), N, K, k32, k256, acts);
  auto y = torch::empty({N, O}, x.options());
  float* yp = y.data_ptr<float>();
  // segment starts, so one parallel loop covers every output row of every segment
  std::vector<int64_t> start(ws.size() + 1, 0);
  for (size_t i = 0; i < ws.size(); i++) start[i + 1] = start[i] + ws[i].size(0);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K / 8));
  // activation rows in chunks that stay in L2 while every weight row of the range meets them (a weight
  // row is decoded again per chunk: cheap next to a chunk's dot products)
  const int64_t chunk = std::max<int64_t>(8, (128 << 10) / K / 8 * 8);
  at::parallel_for(0, O, grain, [&](int64_t lo, int64_t hi) {
    std::vector<SuperBlock> kb(k256 ? K / 256 : 0);
    Decoded b32(k32 ? K / 32 : 0);
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t nn = std::min(chunk, N - n0);
      size_t seg = 0;
      for (int64_t o = lo; o < hi; o++) {
        while (o >= start[seg + 1]) seg++;
        const int t = static_cast<int>(types[seg]);
        const uint8_t* row = ws[seg].data_ptr<uint8_t>() + (o - start[seg]) * ws[seg].size(1);
        float* yo = yp + n0 * O + o;
        prefetch_row_after_next(row, ws[seg].size(1));
        if (t == Q4_K && N == 1) dot_q4k_one(row, K, acts, yo);
        else if (kquant(t)) dot_k(t, row, K, acts, n0, nn, kb, yo, O);
        else dot_32(t, row, K, acts, n0, nn, b32, yo, O);
      }
    }
  });
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == O, "bias must be fp32 [O]");
    y.add_(*bias);
  }
  if (residual.has_value()) y = residual->reshape({-1, O}) + y;  // the layer's skip, added last
  auto shape = x.sizes().vec();
  shape.back() = O;
  return y.view(shape);
}

// rows of a GGUF-quantized matrix [R, bytes] as fp32 [len(ids), K] (embedding lookups, tests)
torch::Tensor qdequant(const torch::Tensor& w, int64_t type, int64_t K, const torch::Tensor& ids) {
  const int t = static_cast<int>(type);
  TORCH_CHECK(block_bytes(t) > 0 && K % block_elems(t) == 0, "unsupported type or K");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) == K / block_elems(t) * block_bytes(t));
  const auto idx = ids.to(torch::kLong).contiguous();
  const int64_t n = idx.numel();
  auto out = torch::empty({n, K}, torch::kFloat);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; r++) TORCH_CHECK(ip[r] >= 0 && ip[r] < w.size(0), "row index out of range");
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    SuperBlock s;
    Block32 b;
    for (int64_t r = lo; r < hi; r++) {
      const uint8_t* row = w.data_ptr<uint8_t>() + ip[r] * w.size(1);
      float* y = out.data_ptr<float>() + r * K;
      if (kquant(t)) {
        for (int64_t i = 0; i < K / 256; i++) {
          decode_k(t, row + i * block_bytes(t), s);
          for (int j = 0; j < 256; j++)
            y[i * 256 + j] = s.D * static_cast<float>(s.sc[j / 32][(j % 32) / 16 * 8]) * static_cast<float>(s.c[j]) -
                             s.M * static_cast<float>(s.m[j / 16]);
        }
      } else {
        for (int64_t i = 0; i < K / 32; i++) {
          decode_32(t, row + i * block_bytes(t), b);
          for (int j = 0; j < 32; j++) {
            const float c = t == Q8_0 ? static_cast<float>(static_cast<int8_t>(b.c[j])) : static_cast<float>(b.c[j]);
            y[i * 32 + j] = b.D * c + b.Moff;
          }
        }
      }
    }
  });
  return out;
}
