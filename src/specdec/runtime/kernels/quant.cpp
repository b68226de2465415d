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

#include "ops.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace {

enum Type : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

int block_elems(int t) { return t >= Q4_K ? 256 : 32; }
int block_bytes(int t) {
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
bool kquant(int t) { return t >= Q4_K; }

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

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

void quantize_row(const float* x, int64_t K, int B, int8_t* q, float* d) {
  for (int64_t b = 0; b < K / B; b++) {
    const float* xb = x + b * B;
    float amax = 0.f;
    for (int j = 0; j < B; j++) amax = std::max(amax, std::fabs(xb[j]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    d[b] = amax / 127.f;
    for (int j = 0; j < B; j++) q[b * B + j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
  }
}

// ---- weights, decoded per block into an L1 buffer ------------------------------------------------------
// K-quant super-block: value_j = D * sc[j/16] * c_j - M * m[j/16]; c unsigned bytes.
struct SuperBlock {
  alignas(64) uint8_t c[256];
  alignas(64) int16_t sc[8][16];  // per 32 codes: lanes 0-7 the first 16's scale, 8-15 the second's
  alignas(32) int16_t m[16];      // offset per 16 (multiplies the activation sums per 16)
  float D, M;
};

// Q4_K/Q5_K's twelve bytes of 6-bit scales and mins -> sc[8], m[8] (llama.cpp's k_quants layout)
inline void scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  uint32_t u[3], o[4];
  std::memcpy(u, q, 12);
  o[0] = u[0] & 0x3f3f3f3f;                                            // sc0..3
  o[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);      // sc4..7
  o[2] = u[1] & 0x3f3f3f3f;                                            // m0..3
  o[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);  // m4..7
  std::memcpy(sc, o, 8);
  std::memcpy(m, o + 2, 8);
}

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

// the eight lanes in one fixed order
inline float hsum(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// One output of one weight row over activation rows n0..n0+R-1, its decoded super-blocks shared: each
// weight vector and scale vector is loaded once per R rows. Per row, the integer lanes and the float steps
// are those of any other R (and of dot_q4k_one), so an output's bits never depend on the tile.
template <int R>
void dot_k_rows(const SuperBlock* buf, int64_t nb, int64_t K, const Acts& a, int64_t n0, float* y, int64_t ystride) {
  const int8_t* xq[R];
  __m256 acc[R];
  for (int r = 0; r < R; r++) {
    xq[r] = a.q.data() + (n0 + r) * K;
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < nb; i++) {
    const SuperBlock& s = buf[i];
    __m256i isum[R];
#ifdef __AVX512BW__
    // two sub-blocks per instruction; adding the halves gives every lane the very integer the AVX2
    // loop sums (integer sums are exact), so both builds give the same bits
    __m512i wide[R];
    for (int r = 0; r < R; r++) wide[r] = _mm512_setzero_si512();
    for (int k = 0; k < 4; k++) {
      const __m512i w = _mm512_load_si512(s.c + 64 * k);
      const __m512i sc = _mm512_load_si512(s.sc[2 * k]);
      for (int r = 0; r < R; r++) {
        const __m512i p = _mm512_maddubs_epi16(w, _mm512_loadu_si512(xq[r] + i * 256 + 64 * k));
#ifdef __AVX512VNNI__
        wide[r] = _mm512_dpwssd_epi32(wide[r], p, sc);  // the same integer as madd + add
#else
        wide[r] = _mm512_add_epi32(wide[r], _mm512_madd_epi16(p, sc));
#endif
      }
    }
    for (int r = 0; r < R; r++)
      isum[r] = _mm256_add_epi32(_mm512_castsi512_si256(wide[r]), _mm512_extracti64x4_epi64(wide[r], 1));
#else
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int k = 0; k < 8; k++) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(s.c + 32 * k));
      const __m256i sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(s.sc[k]));
      for (int r = 0; r < R; r++) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + i * 256 + 32 * k));
        const __m256i p = _mm256_maddubs_epi16(w, x);  // |pair| <= 2 * 63 * 127: no saturation
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, sc));
      }
    }
#endif
    const __m256i m = _mm256_load_si256(reinterpret_cast<const __m256i*>(s.m));
    for (int r = 0; r < R; r++) {
      const int16_t* bs = a.bsum.data() + (n0 + r) * (K / 16) + i * 16;
      const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)), m);
      const float xd = a.d256[(n0 + r) * nb + i];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(s.D * xd), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-s.M * xd), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) y[(n0 + r) * ystride] = hsum(acc[r]);
}

#ifdef __AVX512BW__
constexpr int KTILE = 8;
#else
constexpr int KTILE = 4;
#endif

// one output of one weight row over N activation rows
// (rows n0..n0+N-1; y points at row n0's output)
void dot_k(int t, const uint8_t* row, int64_t K, const Acts& a, int64_t n0, int64_t N, std::vector<SuperBlock>& buf,
           float* y, int64_t ystride) {
  const int64_t nb = K / 256;
  for (int64_t i = 0; i < nb; i++) decode_k(t, row + i * block_bytes(t), buf[i]);
  y -= n0 * ystride;
  N += n0;
  int64_t n = n0;
  for (; n + KTILE <= N; n += KTILE) dot_k_rows<KTILE>(buf.data(), nb, K, a, n, y, ystride);
  switch (N - n) {
    case 7: dot_k_rows<7>(buf.data(), nb, K, a, n, y, ystride); break;
    case 6: dot_k_rows<6>(buf.data(), nb, K, a, n, y, ystride); break;
    case 5: dot_k_rows<5>(buf.data(), nb, K, a, n, y, ystride); break;
    case 4: dot_k_rows<4>(buf.data(), nb, K, a, n, y, ystride); break;
    case 3: dot_k_rows<3>(buf.data(), nb, K, a, n, y, ystride); break;
    case 2: dot_k_rows<2>(buf.data(), nb, K, a, n, y, ystride); break;
    case 1: dot_k_rows<1>(buf.data(), nb, K, a, n, y, ystride); break;
    default: break;
  }
}

// Per block and activation row: the integer dot product in eight lanes (four codes each, exact), converted
// to fp32 and multiplied by the block's weight scale times the row's, FMA into an accumulator that even
// blocks and odd blocks each have their own of; per 8 blocks, the offsets (Moff times the row's scaled code
// sums) by FMA into a third. At the end: the two accumulators added lane by lane, then each accumulator's
// lanes summed in one fixed order. No horizontal step per block: the integer work sets the pace.
// Activation rows n0..n0+R-1 share each weight vector load; per row the steps are those of any other R,
// and the AVX-512 build (two blocks per vector: lanes 0-7 the even block) does per lane what AVX2 does.
template <int R, class Src>
void dot_32_rows256(bool sgn, Src& src, int64_t K, const Acts& a, int64_t n0, float* y, int64_t ystride) {
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
  __m256 acc[2][R];
  for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nbp; i++) {
    __m256 dw;
    const __m256i w = src.block(i, dw);
    if (i < nb) {
      const __m256i wa = sgn ? _mm256_sign_epi8(w, w) : w;
      for (int r = 0; r < R; r++) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + 32 * i));
        if (sgn) x = _mm256_sign_epi8(x, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        const __m256i v = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wa, x);
#else
        const __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, x), _mm256_set1_epi16(1));
#endif
        acc[i & 1][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dw, _mm256_loadu_ps(xd[r] + 8 * i)),
                                        acc[i & 1][r]);
      }
    }
    if ((i + 1) % 8 == 0) {
      const __m256 wm = _mm256_loadu_ps(src.moff(i - 7));
      for (int r = 0; r < R; r++) off[r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(xs[r] + i - 7), off[r]);
    }
  }
  for (int r = 0; r < R; r++) y[(n0 + r) * ystride] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + hsum(off[r]);
}

#ifdef __AVX512BW__
// The same per lane as dot_32_rows256, two blocks per 16-lane vector (lanes 0-7 the even block).
template <int R, class Src>
void dot_32_rows512(bool sgn, Src& src, int64_t K, const Acts& a, int64_t n0, float* y, int64_t ystride) {
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
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nbp; i += 2) {
    if (i < nb) {  // past the row: only the offsets' group is completed
      __m512 dw;
      const __m512i w = src.pair(i, dw);
      // signed codes: |w| times x with w's sign (x = -x where w < 0; where w = 0 the product is 0 anyway)
      const __m512i wa = sgn ? _mm512_abs_epi8(w) : w;
      const __mmask64 neg = sgn ? _mm512_movepi8_mask(w) : 0;
      for (int r = 0; r < R; r++) {
        __m512i x = _mm512_loadu_si512(xq[r] + 32 * i);
        if (sgn) x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
#ifdef __AVX512VNNI__
        const __m512i v = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, x);
#else
        const __m512i v = _mm512_madd_epi16(_mm512_maddubs_epi16(wa, x), _mm512_set1_epi16(1));
#endif
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dw, _mm512_loadu_ps(xd[r] + 8 * i)), acc[r]);
      }
    } else {
      __m512 dw;
      src.pair(i, dw);
    }
    if ((i + 2) % 8 == 0) {
      const __m256 wm = _mm256_loadu_ps(src.moff(i - 6));
      for (int r = 0; r < R; r++) off[r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(xs[r] + i - 6), off[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    const __m256 both = _mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1)));
    y[(n0 + r) * ystride] = hsum(both) + hsum(off[r]);
  }
}
#endif

// Calls of many rows run 16-lane vectors; calls of a few, decoded in registers, run 8-lane ones: measured in
// a SmolLM2 forward, 16-lane FP work at one row made every linear ~40% slower (the clock drops under it).
template <class Src>
void dot_32_tiles(bool sgn, Src& src, int64_t K, const Acts& a, int64_t n, int64_t N, float* y, int64_t ystride) {
#ifdef __AVX512BW__
  for (; n + 8 <= N; n += 8) dot_32_rows512<8>(sgn, src, K, a, n, y, ystride);
  switch (N - n) {
    case 7: dot_32_rows512<7>(sgn, src, K, a, n, y, ystride); break;
    case 6: dot_32_rows512<6>(sgn, src, K, a, n, y, ystride); break;
    case 5: dot_32_rows512<5>(sgn, src, K, a, n, y, ystride); break;
    case 4: dot_32_rows512<4>(sgn, src, K, a, n, y, ystride); break;
    case 3: dot_32_rows512<3>(sgn, src, K, a, n, y, ystride); break;
    case 2: dot_32_rows512<2>(sgn, src, K, a, n, y, ystride); break;
    case 1: dot_32_rows512<1>(sgn, src, K, a, n, y, ystride); break;
    default: break;
  }
#else
  for (; n + 4 <= N; n += 4) dot_32_rows256<4>(sgn, src, K, a, n, y, ystride);
  switch (N - n) {
    case 3: dot_32_rows256<3>(sgn, src, K, a, n, y, ystride); break;
    case 2: dot_32_rows256<2>(sgn, src, K, a, n, y, ystride); break;
    case 1: dot_32_rows256<1>(sgn, src, K, a, n, y, ystride); break;
    default: break;
  }
#endif
}

constexpr int DIRECT32 = 3;  // calls of at most this many rows decode weights in registers

template <int T>
void dot_32_direct(const uint8_t* row, int64_t K, const Acts& a, int64_t n0, int64_t N, float* y, int64_t ystride) {
  Direct<T> src{row, K / 32};
  switch (N) {
    case 3: return dot_32_rows256<3>(T == Q8_0, src, K, a, n0, y, ystride);
    case 2: return dot_32_rows256<2>(T == Q8_0, src, K, a, n0, y, ystride);
    default: return dot_32_rows256<1>(T == Q8_0, src, K, a, n0, y, ystride);
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
  *y = hsum(acc);
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
        for (int64_t g = 0; g < K / 16; g++) {
          int s = 0;
          for (int j = 0; j < 16; j++) s += q[g * 16 + j];
          a.bsum[n * (K / 16) + g] = static_cast<int16_t>(s);
        }
      }
      if (need32) {
        std::vector<float> d(K / 32);
        quantize_row(xr, K, 32, q, d.data());
        for (int64_t b = 0; b < K / 32; b++) {
          int s = 0;
          for (int j = 0; j < 32; j++) s += q[b * 32 + j];
          a.s32[n * a.nb32 + b] = d[b] * static_cast<float>(s);
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

void quantize_blocks(const float* x, int64_t K, int B, int8_t* q, float* d) { quantize_row(x, K, B, q, d); }

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
