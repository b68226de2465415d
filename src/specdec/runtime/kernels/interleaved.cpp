// Linears on 32-block weights (Q4_0, Q4_1, Q5_0, Q8_0) and K-quants (Q4_K, Q6_K) re-laid 16 output rows at a time ("x16").
//
// Why: a one-row forward spends its time on each block's float steps, not on bytes. In the file's layout
// a 32-block of one output is a dot product of its own: eight integer lanes of four codes, then
// convert, scale and accumulate, ~12 instructions for 32 multiply-adds, so a SmolLM2 Q4_1 forward at one
// row streamed its weights at a third of the memory's speed. Re-laid, one 64-byte vector holds four codes
// of each of 16 outputs, an activation dword is broadcast to all of them, and eight integer steps give all
// 16 outputs their whole block sum: the float steps are then paid once per block for 16 outputs.
//
// Layout: per group of 16 rows and block b, one record of 16x the block's bytes (the tensor keeps its size):
//   Q4_0 [d fp16 x16][codes 256 B]  Q4_1 [d fp16 x16][m fp16 x16][codes 256 B]  Q8_0 [d fp16 x16][codes 512 B]
//   Q5_0 [d fp16 x16][fifth bits 4 B x16][codes 256 B]
// Q4 codes: byte 64h + 4o + i is the file's qs byte 4h + i of output o, so its low nibble is element 4h + i
// and its high nibble element 16 + 4h + i: vector h, masked, is step h; shifted, step h + 4. Q8_0 codes:
// byte 64j + 4o + i is element 4j + i of output o (step j). Q5_0's fifth bits, transposed so that one
// vector serves all eight steps: byte 32 + 4o + i, bit j is the fifth bit of element 4j + i (step j, byte i),
// moved to bit 4 of each byte by one 16-bit shift and a mask; its codes (0..31) take an offset of -16 d.
//
// Numerics (every build, every N): per activation row n, output o and block b, the integer S = sum of the
// 32 code products (exact, in any order); then acc_o = fma(float(S), d_o,b * x_n,b, acc_o) and, for the
// offset formats, off_o = fma(m_o,b, s_n,b, off_o), in block order; y = acc_o + off_o. Each output is its
// own lane: the AVX2 code (8 lanes) and the AVX-512 code (16) do the same per output, so the same bits,
// and no row's result depends on another row's (batch invariant).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ggml_blocks.h"
#include "ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using namespace ggml;

constexpr int G = 16;  // outputs per group
// the codes follow the fp16 scales (and Q4_1's offsets, Q5_0's fifth bits)
constexpr int64_t codes_at(int t) { return t == Q4_1 ? 64 : t == Q5_0 ? 96 : 32; }

struct Acts16 {
  std::vector<int8_t> q;  // [N][K]
  std::vector<uint8_t> qu;  // [N][K] q + 128 (q ^ 0x80), for Q8_0 on vpdpbusd: a broadcast straight from memory
  std::vector<float> d;  // [N][K / B]: the scale of each block of B (32, or 256 for K-quants)
  std::vector<float> s;  // B = 32: [N][K / 32] the block's scale * the sum of its codes
  // B = 256: [N][K / 64] the sums of each 32 codes as int16 pairs, per super-block the blocks (0, 2), (1, 3),
  // (4, 6), (5, 7): the Q4_K mins' term on vpmaddwd, whose four pairs meet the lanes' four min bytes
  std::vector<uint32_t> bsp;
  std::vector<int32_t> b16;  // B = 256: [N][K / 16] 32 times the sum of each 16 codes (Q6_K's offset)
  std::vector<uint32_t> b16p;  // B = 256: [N][K / 32] the sums of 16 codes (2g, 2g + 1) as int16 pairs (vpmaddwd)
};

void quantize16(const float* x, int64_t N, int64_t K, int B, bool unsigned_copy, Acts16& a) {
  const int64_t nb = K / B, n32 = K / 32;
  a.q.resize(N * K);
  if (unsigned_copy) a.qu.resize(N * K);
  a.d.resize(N * nb);
  if (B == 32) a.s.resize(N * nb);
  else a.bsp.assign(N * n32 / 2, 0), a.b16.resize(N * n32 * 2), a.b16p.resize(N * n32);
  at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; n++) {
      int8_t* q = a.q.data() + n * K;
      quantize_row(x + n * K, K, B, q, a.d.data() + n * nb);
      if (unsigned_copy)
        for (int64_t k = 0; k < K; k++) a.qu[n * K + k] = static_cast<uint8_t>(q[k]) ^ 0x80;
      for (int64_t b = 0; b < n32; b++) {
        const int s = code_sum(q + b * 32, 32);
        if (B == 32) {
          a.s[n * nb + b] = a.d[n * nb + b] * static_cast<float>(s);
          continue;
        }
        const int64_t j = b % 8;  // |s| <= 32 * 128: an int16
        a.bsp[n * n32 / 2 + 4 * (b / 8) + 2 * (j / 4) + j % 2] |=
            static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(s))) << (16 * (j % 4 / 2));
        const int lo = code_sum(q + b * 32, 16);
        a.b16[n * n32 * 2 + 2 * b] = 32 * lo;
        a.b16[n * n32 * 2 + 2 * b + 1] = 32 * (s - lo);
        a.b16p[n * n32 + b] = static_cast<uint16_t>(static_cast<int16_t>(lo)) |  // |sum of 16| <= 16 * 128
                              static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(s - lo))) << 16;
      }
    }
  });
}

inline int32_t dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_UNSIGNED_X  // vpdpbusd never saturates: x + 128 (unsigned) may meet signed codes
#endif

// One set of wrappers for both vector widths: MM names an intrinsic of this width, SI its whole-register form.
#ifdef __AVX512BW__
using VI = __m512i;
using VF = __m512;
constexpr int L = 16;  // lanes: outputs per vector
#define MM(op) _mm512_##op
#define SI(op) _mm512_##op##_si512
inline VI v_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI v_sign8(VI x, VI w) {  // x where w > 0, -x where w < 0, 0 where w = 0 (AVX-512 has no psignb)
  const __mmask64 neg = _mm512_movepi8_mask(w), zero = _mm512_testn_epi8_mask(w, w);
  return _mm512_maskz_mov_epi8(~zero, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
}
inline VI v_bytes_i32(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VF v_scales(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#else
using VI = __m256i;
using VF = __m256;
constexpr int L = 8;
#define MM(op) _mm256_##op
#define SI(op) _mm256_##op##_si256
inline VI v_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VI v_sign8(VI x, VI w) { return _mm256_sign_epi8(x, w); }
inline VI v_bytes_i32(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VF v_scales(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
inline VI v_bcast(int32_t v) { return MM(set1_epi32)(v); }
inline VI v_mask4(VI v) { return SI(and)(v, MM(set1_epi8)(0x0F)); }
inline VI v_high4(VI v) { return SI(and)(MM(srli_epi16)(v, 4), MM(set1_epi8)(0x0F)); }
inline VI v_abs8(VI v) { return MM(abs_epi8)(v); }
inline VI v_dot(VI acc, VI u, VI s) {  // acc + per lane the four products u8 x s8 (exact)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return MM(add_epi32)(acc, MM(madd_epi16)(MM(maddubs_epi16)(u, s), MM(set1_epi16)(1)));
#endif
}
inline VI v_madd16(VI acc, VI a, VI b) {  // acc + per lane a.lo16 b.lo16 + a.hi16 b.hi16 (signed, exact)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return MM(add_epi32)(acc, MM(madd_epi16)(a, b));
#endif
}
// Without VNNI a step is vpmaddubsw (u8 x s8 pairs to int16) then vpmaddwd (pairs to int32). Codes of at most
// `top` times |x| <= 127 let `steps` steps add up in int16 before one vpmaddwd: 2 top 127 steps <= 32767 (Q4's
// codes, 15: eight steps; Q5_0's, 31: four; Q6_K's, 63: two). The same integers, fewer multiplies.
inline VI v_dot_steps(const VI* u, const int8_t* xq, int n) {  // sum over steps j < n of v_dot(u[j], x's dword j)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  VI s0 = v_bcast(0), s1 = v_bcast(0);
  for (int j = 0; j < n; j += 2) {
    s0 = v_dot(s0, u[j], v_bcast(dword(xq + 4 * j)));
    s1 = v_dot(s1, u[j + 1], v_bcast(dword(xq + 4 * j + 4)));
  }
  return MM(add_epi32)(s0, s1);
#else
  VI h0 = MM(maddubs_epi16)(u[0], v_bcast(dword(xq))), h1 = MM(maddubs_epi16)(u[1], v_bcast(dword(xq + 4)));
  for (int j = 2; j < n; j += 2) {
    h0 = MM(add_epi16)(h0, MM(maddubs_epi16)(u[j], v_bcast(dword(xq + 4 * j))));
    h1 = MM(add_epi16)(h1, MM(maddubs_epi16)(u[j + 1], v_bcast(dword(xq + 4 * j + 4))));
  }
  return MM(madd_epi16)(MM(add_epi16)(h0, h1), MM(set1_epi16)(1));
#endif
}
inline VI v_add(VI a, VI b) { return MM(add_epi32)(a, b); }
// each lane's int16 value in both halves: vpmaddwd against int16 pair sums multiplies their sum by it
inline VI pair16(VI v) { return SI(or)(SI(and)(v, MM(set1_epi32)(0xFFFF)), MM(slli_epi32)(v, 16)); }
inline VI v_sub(VI a, VI b) { return MM(sub_epi32)(a, b); }
inline VI v_mul(VI a, VI b) { return MM(mullo_epi32)(a, b); }
inline VI v_and(VI a, int32_t m) { return SI(and)(a, MM(set1_epi32)(m)); }
inline VI v_and8(VI a, int8_t m) { return SI(and)(a, MM(set1_epi8)(m)); }
inline VI v_or(VI a, VI b) { return SI(or)(a, b); }
inline VI v_shr(VI a, int n) { return MM(srli_epi32)(a, n); }
inline VI v_shl(VI a, int n) { return MM(slli_epi32)(a, n); }
inline VI v_shr16(VI a, int n) { return MM(srli_epi16)(a, n); }
inline VI v_shl16(VI a, int n) { return MM(slli_epi16)(a, n); }
// bits 0..1 of a, 2..3 of b, 4..5 of c in each byte; 6..7 zero (Q6_K's fourth quarter)
inline VI v_top2(VI a, VI b, VI c) {
#ifdef __AVX512BW__
  const VI ab = _mm512_ternarylogic_epi32(a, b, MM(set1_epi8)(0x03), 0xE4);  // c ? a : b, per bit
  return v_and8(_mm512_ternarylogic_epi32(ab, c, MM(set1_epi8)(0x0F), 0xE4), 0x3F);
#else
  return v_or(v_or(v_and8(a, 0x03), v_and8(b, 0x0C)), v_and8(c, 0x30));
#endif
}
struct LaneOps {  // k4_scales_mins's word operations, on each 32-bit lane
  static VI and_(VI a, uint32_t m) { return v_and(a, static_cast<int32_t>(m)); }
  static VI or_(VI a, VI b) { return v_or(a, b); }
  static VI shr(VI a, int n) { return v_shr(a, n); }
  static VI shl(VI a, int n) { return v_shl(a, n); }
};
inline VF f_zero() { return MM(setzero_ps)(); }
inline VF f_set(float v) { return MM(set1_ps)(v); }
inline VF f_mul(VF a, VF b) { return MM(mul_ps)(a, b); }
inline VF f_fma(VF a, VF b, VF c) { return MM(fmadd_ps)(a, b, c); }
inline VF f_add(VF a, VF b) { return MM(add_ps)(a, b); }
inline VF f_cvt(VI v) { return MM(cvtepi32_ps)(v); }
inline void f_store(float* p, VF v) { MM(storeu_ps)(p, v); }

// A few-row pass streams each line of the record PF records ahead into L2 and of the next into L1. Measured on a
// 2-core Zen 4 (4 records ahead, two lines into L1 only, before): a one-row SmolLM2 step 0.91-0.96x the time,
// the Qwen2.5-Coder-0.5B's 0.95-1.0x; 32 or 64 records ahead no better.
constexpr int64_t PF = 16;
// Outputs [o0, o0 + L) of one group (lanes `half` * L onwards of its 16) for activation rows n0..n0+R-1.
template <int T, int R>
void group_rows(const uint8_t* recs, int64_t nb, int half, const Acts16& a, int64_t K, int64_t n0, float* y,
                int64_t ystride) {
  constexpr int64_t RB = block_bytes(T) * G;
  constexpr int64_t C = codes_at(T);
  VF acc[R], off[R];
  for (int r = 0; r < R; r++) acc[r] = off[r] = f_zero();
  const int64_t lane = half * L;  // first output of this vector within the group
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* rec = recs + b * RB;
    if (R >= 4) {  // compute-bound: every line of the record after next-but-two, or the stream stalls it
      for (int64_t p = 0; p < RB; p += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB + p), _MM_HINT_T0);
    } else {
      for (int64_t p = 0; p < RB; p += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(rec + PF * RB + p), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(rec + RB + p), _MM_HINT_T0);
      }
    }
    VI u[8], w[8];  // per step: the unsigned operand (codes, or |w|); Q8_0: the signed codes
    VI wsum128 = v_bcast(0);  // Q8_0 with VNNI: 128 * each output's code sum (see below)
    if (T == Q8_0) {
      for (int j = 0; j < 8; j++) {
        w[j] = v_load(rec + C + 64 * j + 4 * lane);
#ifdef Q8_UNSIGNED_X
        wsum128 = v_dot(wsum128, v_bcast(0x01010101), w[j]);
#else
        u[j] = v_abs8(w[j]);
#endif
      }
#ifdef Q8_UNSIGNED_X
      wsum128 = v_shl(wsum128, 7);
#endif
    } else {
      for (int h = 0; h < 4; h++) {
        const VI p = v_load(rec + C + 64 * h + 4 * lane);
        u[h] = v_mask4(p);
        u[h + 4] = v_high4(p);
      }
      if (T == Q5_0) {  // step j's fifth bits are bit j of each byte: to bit 4 (shifts stay inside bytes)
        const VI hb = v_load(rec + 32 + 4 * lane);
        for (int j = 0; j < 8; j++)
          u[j] = v_or(u[j], v_and8(j < 4 ? v_shl16(hb, 4 - j) : v_shr16(hb, j - 4), 0x10));
      }
    }
    const VF dw = v_scales(rec + 2 * lane);
    const VF mo = T == Q4_1  ? v_scales(rec + 32 + 2 * lane)
                  : T == Q4_0 ? f_mul(dw, f_set(-8.f))
                  : T == Q5_0 ? f_mul(dw, f_set(-16.f))
                              : f_zero();
    for (int r = 0; r < R; r++) {
      const int8_t* xq = a.q.data() + (n0 + r) * K + 32 * b;
      VI sum;
      if (T == Q5_0) {  // codes to 31: four steps a time in int16
        sum = v_add(v_dot_steps(u, xq, 4), v_dot_steps(u + 4, xq + 16, 4));
      } else if (T != Q8_0) {
        sum = v_dot_steps(u, xq, 8);
      } else {
        VI s0 = v_bcast(0), s1 = v_bcast(0);
        for (int j = 0; j < 8; j += 2) {
#ifdef Q8_UNSIGNED_X  // sum (x + 128) w - 128 sum w: one instruction a step, no sign fix-up per row
          const int8_t* xu = reinterpret_cast<const int8_t*>(a.qu.data()) + (n0 + r) * K + 32 * b;
          s0 = v_dot(s0, v_bcast(dword(xu + 4 * j)), w[j]);
          s1 = v_dot(s1, v_bcast(dword(xu + 4 * j + 4)), w[j + 1]);
#else  // |w| times x with w's sign (|products| fit the 16-bit pair sums of vpmaddubsw)
          s0 = v_dot(s0, u[j], v_sign8(v_bcast(dword(xq + 4 * j)), w[j]));
          s1 = v_dot(s1, u[j + 1], v_sign8(v_bcast(dword(xq + 4 * j + 4)), w[j + 1]));
#endif
        }
        sum = v_add(s0, s1);
      }
#ifdef Q8_UNSIGNED_X
      if (T == Q8_0) sum = v_sub(sum, wsum128);
#endif
      const int64_t i = (n0 + r) * nb + b;
      acc[r] = f_fma(f_cvt(sum), f_mul(dw, f_set(a.d[i])), acc[r]);
      if (T != Q8_0) off[r] = f_fma(mo, f_set(a.s[i]), off[r]);
    }
  }
  for (int r = 0; r < R; r++) f_store(y + (n0 + r) * ystride + lane, f_add(acc[r], off[r]));
}

// A K-quant kernel's stream: each line four records ahead into L2, and one record ahead into L1. Measured on
// a 2-core Zen 4, against L1 prefetches two records ahead: 0.85x the time of the 1.5B's linears at one row,
// 0.7x at four (L1's few miss buffers, held for a whole memory latency, throttled the stream).
inline void prefetch_k(const uint8_t* rec, int64_t RB, int64_t at) {
  _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB + at), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(rec + RB + at), _MM_HINT_T0);
}

// Q4_K, per group of 16 rows and super-block, one record of 16 x 144 bytes:
//   [d fp16 x16][dmin fp16 x16][the 12 scale bytes as three dwords u0, u1, u2: each x16][codes 2048 B]
// codes: byte 64 (8c + s) + 4o + i is the file's qs byte 32c + 4s + i of output o: low nibble sub-block 2c,
// high nibble sub-block 2c + 1, step s of each. Per row, output and super-block: the integers
// isum = sum_j sc_j S_j and msum = sum_j m_j (sum of sub-block j's activation codes), exact; then
// acc = fma(float(isum), d x_d, acc) and off = fma(float(msum), dmin (-x_d), off); y = acc + off.
template <int R>
void group_rows_q4k(const uint8_t* recs, int64_t nsb, int half, const Acts16& a, int64_t K, int64_t n0, float* y,
                    int64_t ystride) {
  constexpr int64_t RB = block_bytes(Q4_K) * G;
  const int64_t lane = half * L;
  VF acc[R], off[R];
  for (int r = 0; r < R; r++) acc[r] = off[r] = f_zero();
  for (int64_t i = 0; i < nsb; i++) {
    const uint8_t* rec = recs + i * RB;
    const VI u0 = v_load(rec + 64 + 4 * lane), u1 = v_load(rec + 128 + 4 * lane), u2 = v_load(rec + 192 + 4 * lane);
    VI sc[2], mn[2];  // one output per lane: four scales (or mins) as the four bytes of a lane
    k4_scales_mins<LaneOps>(u0, u1, u2, sc, mn);
    VI isum[R], msum[R];
    for (int r = 0; r < R; r++) isum[r] = msum[r] = v_bcast(0);
    for (int c = 0; c < 4; c++) {
      VI lo[R], hi[R];  // without VNNI: int16 pair sums over the 8 steps (codes to 15, v_dot_steps), widened after
      for (int r = 0; r < R; r++) lo[r] = hi[r] = v_bcast(0);
      for (int s = 0; s < 8; s++) {
        const int64_t at = 256 + 64 * (8 * c + s);
        prefetch_k(rec, RB, at);
        const VI p = v_load(rec + at + 4 * lane), cl = v_mask4(p), ch = v_high4(p);
        for (int r = 0; r < R; r++) {
          const int8_t* xq = a.q.data() + (n0 + r) * K + 256 * i + 64 * c + 4 * s;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
          lo[r] = v_dot(lo[r], cl, v_bcast(dword(xq)));
          hi[r] = v_dot(hi[r], ch, v_bcast(dword(xq + 32)));
#else
          lo[r] = MM(add_epi16)(lo[r], MM(maddubs_epi16)(cl, v_bcast(dword(xq))));
          hi[r] = MM(add_epi16)(hi[r], MM(maddubs_epi16)(ch, v_bcast(dword(xq + 32))));
#endif
        }
      }
      const VI s0 = v_and(v_shr(sc[c / 2], 16 * (c % 2)), 0xFF), s1 = v_and(v_shr(sc[c / 2], 16 * (c % 2) + 8), 0xFF);
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
      for (int r = 0; r < R; r++) isum[r] = v_add(isum[r], v_add(v_mul(lo[r], s0), v_mul(hi[r], s1)));
#else
      // the pair sums times the scale in both halves: one vpmaddwd, not one to widen and a vpmulld (the same integers)
      const VI s0w = pair16(s0), s1w = pair16(s1);
      for (int r = 0; r < R; r++) isum[r] = v_madd16(v_madd16(isum[r], lo[r], s0w), hi[r], s1w);
#endif
    }
    // the mins as int16 pairs (0, 2), (1, 3) of each lane's four bytes: four multiply-add pairs a row, not eight
    // 32-bit multiplies (one Q4_K linear at 4 and 8 rows: 6% faster, the same integers)
    const VI m02[2] = {v_and(mn[0], 0x00FF00FF), v_and(mn[1], 0x00FF00FF)};
    const VI m13[2] = {v_and(v_shr(mn[0], 8), 0x00FF00FF), v_and(v_shr(mn[1], 8), 0x00FF00FF)};
    for (int r = 0; r < R; r++) {
      const uint32_t* bp = a.bsp.data() + (n0 + r) * (K / 64) + 4 * i;
      for (int h = 0; h < 2; h++)
        msum[r] = v_madd16(v_madd16(msum[r], m02[h], v_bcast(static_cast<int32_t>(bp[2 * h]))), m13[h],
                           v_bcast(static_cast<int32_t>(bp[2 * h + 1])));
    }
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB + 64), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB + 128), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * RB + 192), _MM_HINT_T1);
    const VF d = v_scales(rec + 2 * lane), dmin = v_scales(rec + 32 + 2 * lane);
    for (int r = 0; r < R; r++) {
      const float xd = a.d[(n0 + r) * nsb + i];
      acc[r] = f_fma(f_cvt(isum[r]), f_mul(d, f_set(xd)), acc[r]);
      off[r] = f_fma(f_cvt(msum[r]), f_mul(dmin, f_set(-xd)), off[r]);
    }
  }
  for (int r = 0; r < R; r++) f_store(y + (n0 + r) * ystride + lane, f_add(acc[r], off[r]));
}

#ifdef __AVX512BW__
constexpr int RT = 8;  // activation rows per pass over a group's records
#else
constexpr int RT = 4;
#endif

// Q6_K, per group of 16 rows and super-block, one record of 16 x 210 bytes:
//   [d fp16 x16][scales int8: byte 16g + o is output o's scale of elements 16g..16g+15][codes 3072 B]
// codes, per half h (elements 128h..128h+127) 1536 B: per step t = 0..7 three 64-byte vectors V0, V1, V2, byte
// 4o + i of Vj: bits 0..5 the 6-bit code of element 128h + 32j + 4t + i (quarter j), bits 6..7 bits 2j, 2j + 1
// of quarter 3's code of element 128h + 96 + 4t + i. So a step's four code vectors take one mask each for
// quarters 0..2 and three shifts and a merge for quarter 3 (the file's nibble and top-bit planes took two
// shifts and three masks per vector).
// Per row, output and super-block the integer isum = sum_g sc_g (S_g - 32 sum of group g's activation
// codes), exact; acc = fma(float(isum), d x_d, acc); y = acc.
template <int R>
void group_rows_q6k(const uint8_t* recs, int64_t nsb, int half, const Acts16& a, int64_t K, int64_t n0, float* y,
                    int64_t ystride) {
  constexpr int64_t RB = block_bytes(Q6_K) * G;
  // Without VNNI (SCALED) the vpmaddwd that widens vpmaddubsw's int16 pair sums also applies the group's scale,
  // and the offset is one vpmaddwd per group pair and row: no vpmulld. From 3 rows a pass (PAIRS), codes to 63
  // let two steps add up in int16 first; at 1-2 rows that ran 3-7% slower on a Zen 1 (the stream limits there).
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  constexpr bool SCALED = false, PAIRS = false;
#else
  constexpr bool SCALED = true, PAIRS = R >= 3;
#endif
  const int64_t lane = half * L;
  VF acc[R];
  for (int r = 0; r < R; r++) acc[r] = f_zero();
  for (int64_t i = 0; i < nsb; i++) {
    const uint8_t* rec = recs + i * RB;
    VI isum[R];
    for (int r = 0; r < R; r++) isum[r] = v_bcast(0);
    for (int h = 0; h < 2; h++) {
      const uint8_t* cs = rec + 288 + 1536 * h;
      for (int u = 0; u < 2; u++)  // steps t = 4u..4u+3 of each quarter q: scale group 8h + 2q + u
        for (int qp = 0; qp < 4; qp += 2) {  // quarters qp and qp + 1: two sums per row stay in registers
          VI sg[2][R];
          for (int r = 0; r < R; r++) sg[0][r] = sg[1][r] = v_bcast(0);
          [[maybe_unused]] VI pair[2][R];  // an even step's int16 pair sums, waiting for the odd one
          [[maybe_unused]] VI scw[2];  // SCALED: the two groups' scales in both int16 halves of each lane
          if (SCALED)
            for (int k = 0; k < 2; k++) scw[k] = pair16(v_bytes_i32(rec + 32 + 16 * (8 * h + 2 * (qp + k) + u) + lane));
          for (int t = 4 * u; t < 4 * u + 4; t++) {
            const uint8_t* v = cs + 192 * t + 4 * lane;
            if (qp == 0)
              for (int j = 0; j < 3; j++)
                prefetch_k(cs, RB, 192 * t + 64 * j);
            VI code[2];
            if (qp == 0) {
              code[0] = v_and8(v_load(v), 0x3F);
              code[1] = v_and8(v_load(v + 64), 0x3F);
            } else {
              const VI v2 = v_load(v + 128);
              code[0] = v_and8(v2, 0x3F);
              code[1] = v_top2(v_shr16(v_load(v), 6), v_shr16(v_load(v + 64), 4), v_shr16(v2, 2));
            }
            for (int r = 0; r < R; r++) {
              const int8_t* xq = a.q.data() + (n0 + r) * K + 256 * i + 128 * h + 32 * qp + 4 * t;
              if (!SCALED) {
                sg[0][r] = v_dot(sg[0][r], code[0], v_bcast(dword(xq)));
                sg[1][r] = v_dot(sg[1][r], code[1], v_bcast(dword(xq + 32)));
                continue;
              }
#if !(defined(__AVX512BW__) && defined(__AVX512VNNI__))
              const VI p0 = MM(maddubs_epi16)(code[0], v_bcast(dword(xq)));
              const VI p1 = MM(maddubs_epi16)(code[1], v_bcast(dword(xq + 32)));
              if (!PAIRS) {
                isum[r] = v_madd16(isum[r], p0, scw[0]);
                isum[r] = v_madd16(isum[r], p1, scw[1]);
              } else if (t % 2 == 0) {
                pair[0][r] = p0;
                pair[1][r] = p1;
              } else {
                isum[r] = v_madd16(isum[r], MM(add_epi16)(pair[0][r], p0), scw[0]);
                isum[r] = v_madd16(isum[r], MM(add_epi16)(pair[1][r], p1), scw[1]);
              }
#endif
            }
          }
          for (int k = 0; k < 2 && !SCALED; k++) {
            const int g = 8 * h + 2 * (qp + k) + u;
            const VI sc = v_bytes_i32(rec + 32 + 16 * g + lane);
            for (int r = 0; r < R; r++) {
              const VI off = v_bcast(a.b16[(n0 + r) * (K / 16) + 16 * i + g]);
              isum[r] = v_add(isum[r], v_mul(v_sub(sg[k][r], off), sc));
            }
          }
        }
    }
    if (SCALED) {  // the offset, sum_g sc_g 32 (sum of group g's codes), on vpmaddwd over group pairs
      VI scp[8];
      for (int m = 0; m < 8; m++)
        scp[m] = v_or(v_and(v_bytes_i32(rec + 32 + 32 * m + lane), 0xFFFF), v_shl(v_bytes_i32(rec + 48 + 32 * m + lane), 16));
      for (int r = 0; r < R; r++) {
        const uint32_t* bp = a.b16p.data() + (n0 + r) * (K / 32) + 8 * i;
        VI o = v_bcast(0);
        for (int m = 0; m < 8; m++) o = v_madd16(o, scp[m], v_bcast(static_cast<int32_t>(bp[m])));
        isum[r] = v_sub(isum[r], v_shl(o, 5));
      }
    }
    const VF d = v_scales(rec + 2 * lane);
    for (int r = 0; r < R; r++) acc[r] = f_fma(f_cvt(isum[r]), f_mul(d, f_set(a.d[(n0 + r) * nsb + i])), acc[r]);
  }
  for (int r = 0; r < R; r++) f_store(y + (n0 + r) * ystride + lane, acc[r]);
}

template <int T>
void group_k(const uint8_t* recs, int64_t nsb, const Acts16& a, int64_t K, int64_t N, float* y, int64_t ystride) {
  const auto rows = [&](auto tile, int half, int64_t n) {
    constexpr int R = decltype(tile)::value;
    if (T == Q4_K) group_rows_q4k<R>(recs, nsb, half, a, K, n, y, ystride);
    else group_rows_q6k<R>(recs, nsb, half, a, K, n, y, ystride);
  };
  // Rows per pass (each pass streams the group's records again): Q6_K up to RT; Q4_K, whose tiles past
  // five spill, fours and one tile of five for a remainder of one (a one-row pass is slow even from L2:
  // every sum waits on its last vpdpbusd).
  constexpr int KT = T == Q6_K ? RT : 4;
  for (int half = 0; half < G / L; half++) {
    int64_t n = 0;
    for (; n + KT <= N && (KT > 4 || N - n != 5); n += KT) rows(std::integral_constant<int, KT>{}, half, n);
    switch (N - n) {  // 6 and 7: Q6_K's remainders (RT = 8); 5: Q4_K's
      case 7: rows(std::integral_constant<int, 7>{}, half, n); break;
      case 6: rows(std::integral_constant<int, 6>{}, half, n); break;
      case 5: rows(std::integral_constant<int, 5>{}, half, n); break;
      case 4: rows(std::integral_constant<int, 4>{}, half, n); break;
      case 3: rows(std::integral_constant<int, 3>{}, half, n); break;
      case 2: rows(std::integral_constant<int, 2>{}, half, n); break;
      case 1: rows(std::integral_constant<int, 1>{}, half, n); break;
      default: break;
    }
  }
}

template <int T>
void group(const uint8_t* recs, int64_t nb, const Acts16& a, int64_t K, int64_t N, float* y, int64_t ystride) {
  for (int half = 0; half < G / L; half++) {
    int64_t n = 0;
    for (; n + RT <= N; n += RT) group_rows<T, RT>(recs, nb, half, a, K, n, y, ystride);
    switch (N - n) {
#ifdef __AVX512BW__
      case 7: group_rows<T, 7>(recs, nb, half, a, K, n, y, ystride); break;
      case 6: group_rows<T, 6>(recs, nb, half, a, K, n, y, ystride); break;
      case 5: group_rows<T, 5>(recs, nb, half, a, K, n, y, ystride); break;
      case 4: group_rows<T, 4>(recs, nb, half, a, K, n, y, ystride); break;
#endif
      case 3: group_rows<T, 3>(recs, nb, half, a, K, n, y, ystride); break;
      case 2: group_rows<T, 2>(recs, nb, half, a, K, n, y, ystride); break;
      case 1: group_rows<T, 1>(recs, nb, half, a, K, n, y, ystride); break;
      default: break;
    }
  }
}

}  // namespace

bool x16_type(int64_t t) { return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q8_0 || t == Q4_K || t == Q6_K; }

// The x16 re-layout (inverse: back to the file's rows): a permutation of bytes, and of Q5_0's fifth bits.
torch::Tensor relay16(const torch::Tensor& w, int64_t type, bool inverse) {
  const int t = static_cast<int>(type);
  TORCH_CHECK(x16_type(t), "x16 re-layout reads Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K, not type ", t);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 && w.size(0) % G == 0,
              "x16 re-layout needs uint8 rows, a multiple of 16 of them");
  const int64_t bb = block_bytes(t), nb = w.size(1) / bb, O = w.size(0);
  TORCH_CHECK(w.size(1) == nb * bb, "rows are not whole blocks");
  auto out = torch::empty_like(w);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t C = codes_at(t);
  at::parallel_for(0, O / G, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; g++)
      for (int64_t b = 0; b < nb; b++) {
        const int64_t at = (g * nb + b) * G * bb;
        for (int o = 0; o < G; o++) {
          const int64_t row = (g * G + o) * w.size(1) + b * bb;
          // (record, block) of this output: read one, write the other
          const uint8_t* rec_in = src + at;
          uint8_t* rec_out = dst + at;
          const uint8_t* blk_in = src + row;
          uint8_t* blk_out = dst + row;
          const auto mv = [&](int64_t r, int64_t k, int64_t n) {  // record byte r <-> block byte k
            if (inverse) std::memcpy(blk_out + k, rec_in + r, n);
            else std::memcpy(rec_out + r, blk_in + k, n);
          };
          if (t == Q4_K) {  // d, dmin, the scales' three dwords, then the codes (see group_rows_q4k)
            mv(2 * o, 0, 2);
            mv(32 + 2 * o, 2, 2);
            for (int u = 0; u < 3; u++) mv(64 * (u + 1) + 4 * o, 4 + 4 * u, 4);
            for (int q = 0; q < 32; q++) mv(256 + 64 * q + 4 * o, 16 + 4 * q, 4);
            continue;
          }
          if (t == Q6_K) {  // d, the scales, then the codes regrouped per step (see group_rows_q6k)
            mv(2 * o, 208, 2);
            for (int s = 0; s < 16; s++) mv(32 + 16 * s + o, 192 + s, 1);
            for (int h = 0; h < 2; h++)
              for (int l = 0; l < 32; l++) {  // element 128h + 32q + l of quarter q
                uint8_t* ql = blk_out + 64 * h;
                uint8_t* qh = blk_out + 128 + 32 * h;
                const int64_t at = 288 + 1536 * h + 192 * (l / 4) + 4 * o + l % 4;  // + 64j: Vj
                if (inverse) {
                  int c[4];
                  for (int j = 0; j < 3; j++) c[j] = rec_in[at + 64 * j] & 0x3F;
                  c[3] = 0;
                  for (int j = 0; j < 3; j++) c[3] |= (rec_in[at + 64 * j] >> 6) << (2 * j);
                  ql[l] = static_cast<uint8_t>((c[0] & 0xF) | ((c[2] & 0xF) << 4));
                  ql[l + 32] = static_cast<uint8_t>((c[1] & 0xF) | ((c[3] & 0xF) << 4));
                  qh[l] = static_cast<uint8_t>((c[0] >> 4) | ((c[1] >> 4) << 2) | ((c[2] >> 4) << 4) | ((c[3] >> 4) << 6));
                } else {  // ggml's decoding of quarter q: a nibble of ql, bits 2q, 2q + 1 of qh
                  const uint8_t* iql = blk_in + 64 * h;
                  const uint8_t qhb = blk_in[128 + 32 * h + l];
                  const int c[4] = {(iql[l] & 0xF) | ((qhb & 3) << 4), (iql[l + 32] & 0xF) | (((qhb >> 2) & 3) << 4),
                                    (iql[l] >> 4) | (((qhb >> 4) & 3) << 4), (iql[l + 32] >> 4) | (((qhb >> 6) & 3) << 4)};
                  for (int j = 0; j < 3; j++)
                    rec_out[at + 64 * j] = static_cast<uint8_t>(c[j] | (((c[3] >> (2 * j)) & 3) << 6));
                }
              }
            continue;
          }
          mv(2 * o, 0, 2);  // d
          if (t == Q4_1) mv(32 + 2 * o, 2, 2);  // m
          if (t == Q5_0) {  // qh (bit e: element e's fifth bit) transposed: byte i, bit j <-> bit 4j + i
            uint32_t qh = 0;
            if (inverse) {
              for (int i = 0; i < 4; i++)
                for (int j = 0; j < 8; j++) qh |= static_cast<uint32_t>((rec_in[32 + 4 * o + i] >> j) & 1) << (4 * j + i);
              std::memcpy(blk_out + 2, &qh, 4);
            } else {
              std::memcpy(&qh, blk_in + 2, 4);
              for (int i = 0; i < 4; i++) {
                uint8_t byte = 0;
                for (int j = 0; j < 8; j++) byte |= static_cast<uint8_t>(((qh >> (4 * j + i)) & 1u) << j);
                rec_out[32 + 4 * o + i] = byte;
              }
            }
          }
          const int64_t qs = t == Q4_1 ? 4 : t == Q5_0 ? 6 : 2;
          const int steps = t == Q8_0 ? 8 : 4;
          for (int j = 0; j < steps; j++) mv(C + 64 * j + 4 * o, qs + 4 * j, 4);
        }
      }
  });
  return out;
}

torch::Tensor repack16(const torch::Tensor& w, int64_t type) { return relay16(w, type, false); }
torch::Tensor unpack16(const torch::Tensor& w, int64_t type) { return relay16(w, type, true); }

torch::Tensor qdequant16(const torch::Tensor& w, int64_t type, int64_t K, const torch::Tensor& ids) {
  const int t = static_cast<int>(type);
  const int64_t E = block_elems(t);
  TORCH_CHECK(x16_type(t) && K % E == 0 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
              w.size(1) == K / E * block_bytes(t) && w.size(0) % G == 0, "not an x16 tensor of this type");
  const auto idx = ids.to(torch::kLong).contiguous();
  const int64_t n = idx.numel(), nb = K / E, bb = block_bytes(t), C = codes_at(t);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; r++) TORCH_CHECK(ip[r] >= 0 && ip[r] < w.size(0), "row index out of range");
  auto out = torch::empty({n, K}, torch::kFloat);
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; r++) {
      const int64_t g = ip[r] / G, o = ip[r] % G;
      float* y = out.data_ptr<float>() + r * K;
      for (int64_t b = 0; b < nb; b++) {
        const uint8_t* rec = w.data_ptr<uint8_t>() + (g * nb + b) * G * bb;
        uint16_t h;
        std::memcpy(&h, rec + 2 * o, 2);
        const float d = _cvtsh_ss(h);
        if (t == Q6_K) {
          for (int e = 0; e < 256; e++) {
            const int hf = e / 128, q = (e % 128) / 32, l = e % 32;
            const uint8_t* cs = rec + 288 + 1536 * hf + 192 * (l / 4) + 4 * o + l % 4;
            const int code = q < 3 ? cs[64 * q] & 0x3F : (cs[0] >> 6) | ((cs[64] >> 6) << 2) | ((cs[128] >> 6) << 4);
            const int sc = static_cast<int8_t>(rec[32 + 16 * (e / 16) + o]);
            y[b * 256 + e] = d * static_cast<float>(sc) * static_cast<float>(code) - d * static_cast<float>(32 * sc);
          }
          continue;
        }
        if (t == Q4_K) {
          std::memcpy(&h, rec + 32 + 2 * o, 2);
          const float dmin = _cvtsh_ss(h);
          uint8_t packed[12], sc[8], m[8];
          for (int u = 0; u < 3; u++) std::memcpy(packed + 4 * u, rec + 64 * (u + 1) + 4 * o, 4);
          scales_mins_k4(packed, sc, m);
          for (int e = 0; e < 256; e++) {
            const int j = e / 32, k = e % 32;
            const uint8_t byte = rec[256 + 64 * (8 * (j / 2) + k / 4) + 4 * o + k % 4];
            const float c = static_cast<float>(j % 2 ? byte >> 4 : byte & 0x0F);
            y[b * 256 + e] = d * static_cast<float>(sc[j]) * c - dmin * static_cast<float>(m[j]);
          }
          continue;
        }
        float moff = t == Q4_0 ? -8.f * d : 0.f;
        if (t == Q4_1) {
          std::memcpy(&h, rec + 32 + 2 * o, 2);
          moff = _cvtsh_ss(h);
        }
        for (int k = 0; k < 32; k++) {
          float c;
          if (t == Q8_0) {
            c = static_cast<float>(static_cast<int8_t>(rec[C + 64 * (k / 4) + 4 * o + k % 4]));
          } else if (t == Q5_0) {  // as ggml: (code - 16) * d
            const int j = k % 16;
            const uint8_t byte = rec[C + 64 * (j / 4) + 4 * o + j % 4];
            const int fifth = (rec[32 + 4 * o + k % 4] >> (k / 4)) & 1;
            y[b * 32 + k] = static_cast<float>((k < 16 ? byte & 0x0F : byte >> 4) + 16 * fifth - 16) * d;
            continue;
          } else {
            const int j = k % 16;
            const uint8_t byte = rec[C + 64 * (j / 4) + 4 * o + j % 4];
            c = static_cast<float>(k < 16 ? byte & 0x0F : byte >> 4);
          }
          y[b * 32 + k] = d * c + moff;
        }
      }
    }
  });
  return out;
}

// x [..., K] fp32; ws: x16 tensors [O_i, K / 32 * bytes] (O_i a multiple of 16), types their GGML ids ->
// [..., sum O_i] (+ bias, then + residual).
torch::Tensor qlinear16(const torch::Tensor& x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types,
                        const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.device().is_cpu(), "x must be fp32 on the CPU");
  TORCH_CHECK(ws.size() == types.size() && !ws.empty(), "one type per weight");
  const int64_t K = x.size(-1), E = block_elems(static_cast<int>(types.at(0)));
  TORCH_CHECK(K % E == 0, "K must be a multiple of the block size");
  std::vector<int64_t> gstart(ws.size() + 1, 0);  // first group of each segment
  for (size_t i = 0; i < ws.size(); i++) {
    const int t = static_cast<int>(types[i]);
    TORCH_CHECK(x16_type(t) && block_elems(t) == E, "x16 weights of one call share a block size");
    TORCH_CHECK(ws[i].scalar_type() == torch::kUInt8 && ws[i].is_contiguous() && ws[i].dim() == 2 &&
                    ws[i].size(0) % G == 0 && ws[i].size(1) == K / E * block_bytes(t),
                "weights do not match x");
    gstart[i + 1] = gstart[i] + ws[i].size(0) / G;
  }
  const auto xs = x.reshape({-1, K}).contiguous();
  const int64_t N = xs.size(0), nb = K / E, O = gstart.back() * G;
  Acts16 acts;
#ifdef Q8_UNSIGNED_X
  const bool q8 = std::find(types.begin(), types.end(), int64_t{Q8_0}) != types.end();
#else
  const bool q8 = false;
#endif
  quantize16(xs.data_ptr<float>(), N, K, static_cast<int>(E), q8, acts);
  auto y = torch::empty({N, O}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, gstart.back(), 1, [&](int64_t lo, int64_t hi) {
    size_t seg = 0;
    {  // the head of this thread's stream, which no record before it prefetched (into L2, up to 8 KB): a small
       // model's linears are short streams (0.94x the time of a 0.5B step at one row)
      while (lo >= gstart[seg + 1]) seg++;
      const int64_t rb = block_bytes(static_cast<int>(types[seg])) * G;
      const uint8_t* head = ws[seg].data_ptr<uint8_t>() + (lo - gstart[seg]) * nb * rb;
      const int64_t n = std::min({PF * rb, int64_t{8192}, (gstart[seg + 1] - lo) * nb * rb});
      for (int64_t p = 0; p < n; p += 64) _mm_prefetch(reinterpret_cast<const char*>(head + p), _MM_HINT_T1);
      seg = 0;
    }
    for (int64_t g = lo; g < hi; g++) {
      while (g >= gstart[seg + 1]) seg++;
      const int64_t bb = block_bytes(static_cast<int>(types[seg]));
      const uint8_t* recs = ws[seg].data_ptr<uint8_t>() + (g - gstart[seg]) * nb * G * bb;
      float* yo = yp + g * G;
      switch (static_cast<int>(types[seg])) {
        case Q4_0: group<Q4_0>(recs, nb, acts, K, N, yo, O); break;
        case Q4_1: group<Q4_1>(recs, nb, acts, K, N, yo, O); break;
        case Q5_0: group<Q5_0>(recs, nb, acts, K, N, yo, O); break;
        case Q4_K: group_k<Q4_K>(recs, nb, acts, K, N, yo, O); break;
        case Q6_K: group_k<Q6_K>(recs, nb, acts, K, N, yo, O); break;
        default: group<Q8_0>(recs, nb, acts, K, N, yo, O); break;
      }
    }
  });
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == O, "bias must be fp32 [O]");
    y.add_(*bias);
  }
  if (residual.has_value()) y = residual->reshape({-1, O}) + y;
  auto shape = x.sizes().vec();
  shape.back() = O;
  return y.view(shape);
}
