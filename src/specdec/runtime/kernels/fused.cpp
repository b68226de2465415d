// The small per-layer operations of a decode step or verify tree, one call each: RMSNorm,
// RoPE + the K/V cache write, attention, SiLU(gate) * up. Built into the same module as stream.cpp.
//
// Why: on a 2-core CPU these ~20 torch ops per layer cost ~4 ms of a ~20 ms SmolLM2 step in dispatch and
// small allocations, not arithmetic. Here they are 4 calls per layer.
//
// Row invariant by construction, like the linears: every output row is computed from its own input row
// (and, for attention, exactly its visible cache columns, in column order) by a fixed sequence of
// operations, whatever else is in the call. The vector width is 8 lanes in every build, so the AVX2 and
// AVX-512 builds give the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ggml_blocks.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

using ggml::hsum_paired;

constexpr int L = 8;  // lanes

// exp, Cephes' single-precision polynomial (~1 ulp on [-88, 88]): what torch's vectorised exp does too,
// in its own variant; both are within a few ulp of the true value.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                            _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1,
              name, " must be 2-D fp32 on the CPU with contiguous rows");
}

}  // namespace

// x [N, H] -> x * rsqrt(mean(x^2) + eps) * w, per row
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t N = x.size(0), H = x.size(1);
  TORCH_CHECK(H % L == 0 && w.is_contiguous() && w.numel() == H && w.scalar_type() == torch::kFloat);
  auto y = torch::empty({N, H}, x.options());
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / H), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; n++) {
      const float* xr = x.data_ptr<float>() + n * x.stride(0);
      float* yr = y.data_ptr<float>() + n * H;
      __m256 s = _mm256_setzero_ps();
      for (int64_t k = 0; k < H; k += L) {
        const __m256 v = _mm256_loadu_ps(xr + k);
        s = _mm256_fmadd_ps(v, v, s);
      }
      const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(hsum_paired(s) / float(H) + float(eps)));
      for (int64_t k = 0; k < H; k += L)
        _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), r), _mm256_loadu_ps(wp + k)));
    }
  });
  return y;
}

// gu [N, 2I] (gate, up) -> silu(gate) * up [N, I]
torch::Tensor silu_mul(const torch::Tensor& gu) {
  check_rows(gu, "gate_up");
  const int64_t N = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(I % L == 0, "intermediate size must be a multiple of 8");
  auto y = torch::empty({N, I}, gu.options());
  const __m256 one = _mm256_set1_ps(1.0f);
  at::parallel_for(0, N, std::max<int64_t>(1, 32768 / I), [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; n++) {
      const float* g = gu.data_ptr<float>() + n * gu.stride(0);
      const float* u = g + I;
      float* yr = y.data_ptr<float>() + n * I;
      for (int64_t k = 0; k < I; k += L) {
        const __m256 gv = _mm256_loadu_ps(g + k);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(yr + k, _mm256_mul_ps(s, _mm256_loadu_ps(u + k)));
      }
    }
  });
  return y;
}

namespace {

// A cache element from fp32: as it is, or fp16 rounded to nearest even (F16C's and c10::Half's rounding).
inline void to_cache(float x, float* p) { *p = x; }
inline void to_cache(float x, at::Half* p) { *p = at::Half(x); }

// Rotates q and k of rows qkv[0 .. n) (x * cos + swap_halves(x) * sin, HF's order of operations), writes
// k and v to cache rows start.. of kc/vc (kv head h at + h * hs, row at + row * rs; C: the cache's element),
// q to qp [n, nh * hd].
template <typename C>
void rope_rows(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t r0, int64_t n,
               C* kp, C* vp, int64_t hs, int64_t rs, int64_t start, int64_t nh, int64_t nkv, float* qp) {
  const int64_t hd = cos.size(1), half = hd / 2;
  for (int64_t i = 0; i < n; i++) {
    const float* row = qkv.data_ptr<float>() + (r0 + i) * qkv.stride(0);
    const float *c = cos.data_ptr<float>() + (r0 + i) * cos.stride(0), *s = sin.data_ptr<float>() + (r0 + i) * sin.stride(0);
    // x * cos + rotate_half(x) * sin, element d of head x
    auto rot = [&](const float* x, int64_t d) { return x[d] * c[d] + x[d < half ? d + half : d - half] * s[d]; };
    for (int64_t h = 0; h < nh; h++)
      for (int64_t d = 0; d < hd; d++) qp[i * nh * hd + h * hd + d] = rot(row + h * hd, d);
    for (int64_t h = 0; h < nkv; h++)
      for (int64_t d = 0; d < hd; d++) to_cache(rot(row + (nh + h) * hd, d), kp + h * hs + (start + i) * rs + d);
    for (int64_t h = 0; h < nkv; h++) {
      const float* x = row + (nh + nkv + h) * hd;
      C* out = vp + h * hs + (start + i) * rs;
      for (int64_t d = 0; d < hd; d++) to_cache(x[d], out + d);
    }
  }
}

// rope_rows into the cache kc, vc of either element type.
void rope_into(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t r0, int64_t n,
               const torch::Tensor& kc, const torch::Tensor& vc, int64_t start, int64_t nh, int64_t nkv, float* qp) {
  if (kc.scalar_type() == torch::kHalf)
    rope_rows(qkv, cos, sin, r0, n, kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>(), kc.stride(0), kc.stride(1), start,
              nh, nkv, qp);
  else
    rope_rows(qkv, cos, sin, r0, n, kc.data_ptr<float>(), vc.data_ptr<float>(), kc.stride(0), kc.stride(1), start, nh,
              nkv, qp);
}

void check_rope(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t nh, int64_t nkv) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t n = qkv.size(0), hd = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (nh + 2 * nkv) * hd && cos.size(0) == n && sin.size(0) == n && hd % 2 == 0,
              "rope_store: qkv, cos and sin do not match");
}

void check_cache(const torch::Tensor& kc, const torch::Tensor& vc, int64_t nkv, int64_t hd, int64_t end) {
  TORCH_CHECK(kc.dim() == 3 && kc.size(0) == nkv && kc.size(2) == hd && kc.stride(2) == 1 &&
              kc.size(1) >= end && (kc.scalar_type() == torch::kFloat || kc.scalar_type() == torch::kHalf) &&
              vc.sizes() == kc.sizes() && vc.strides() == kc.strides() && vc.scalar_type() == kc.scalar_type(),
              "the K/V cache must be fp32 or fp16 [kv heads, capacity, head_dim], K and V alike, with room for the rows");
}

}  // namespace

// qkv [n, (nh + 2 nkv) * hd]; cos, sin [n, hd] (sin with rotate_half's sign folded in, as llama.Rope).
// Rotates q and k, writes k and v to cache rows start..start+n of kc, vc [nkv, capacity, hd]; returns
// q [n, nh * hd].
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         torch::Tensor kc, torch::Tensor vc, int64_t start, int64_t nh, int64_t nkv) {
  check_rope(qkv, cos, sin, nh, nkv);
  const int64_t n = qkv.size(0), hd = cos.size(1);
  check_cache(kc, vc, nkv, hd, start + n);
  auto q = torch::empty({n, nh * hd}, qkv.options());
  rope_into(qkv, cos, sin, 0, n, kc, vc, start, nh, nkv, q.data_ptr<float>());
  return q;
}

// rope_store for several sequences' rows packed in qkv, cos, sin (sequence s's sizes[s] rows after those of
// the sequences before it), each into layer `layer` of its own cache ks[s], vs[s] [layers, 1, nkv,
// capacity, hd] at starts[s]: the q rows, packed the same way.
torch::Tensor rope_store_many(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                              const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs, int64_t layer,
                              const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes, int64_t nh,
                              int64_t nkv) {
  check_rope(qkv, cos, sin, nh, nkv);
  const size_t S = sizes.size();
  TORCH_CHECK(ks.size() == S && vs.size() == S && starts.size() == S &&
              std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) == qkv.size(0),
              "rope_store_many: one cache, start and size per sequence, and every sequence's rows");
  const int64_t hd = cos.size(1);
  auto q = torch::empty({qkv.size(0), nh * hd}, qkv.options());
  int64_t r0 = 0;
  for (size_t s = 0; s < S; s++) {
    const auto kc = ks[s].select(0, layer).select(0, 0), vc = vs[s].select(0, layer).select(0, 0);
    check_cache(kc, vc, nkv, hd, starts[s] + sizes[s]);
    rope_into(qkv, cos, sin, r0, sizes[s], kc, vc, starts[s], nh, nkv, q.data_ptr<float>() + r0 * nh * hd);
    r0 += sizes[s];
  }
  return q;
}

namespace {

// Eight columns' 8-lane partial dot products -> their eight sums, each lane order the same as hsum_paired's:
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)). A column's sum depends only on its own partials.
inline __m256 hsum8(const float* part) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_loadu_ps(part), _mm256_loadu_ps(part + L));
  const __m256 t1 = _mm256_hadd_ps(_mm256_loadu_ps(part + 2 * L), _mm256_loadu_ps(part + 3 * L));
  const __m256 t2 = _mm256_hadd_ps(_mm256_loadu_ps(part + 4 * L), _mm256_loadu_ps(part + 5 * L));
  const __m256 t3 = _mm256_hadd_ps(_mm256_loadu_ps(part + 6 * L), _mm256_loadu_ps(part + 7 * L));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The query rows of one kv head's attention (pairs of a row and a query head of its group), each over its
// m visible columns: col(c) = c for c < lead, else tail[c - lead]. NB = head_dim / 8 vectors per row.
struct Pair {
  const float* q;
  float* out;
  int64_t lead, m;
  const int32_t* tail;
  float* p;  // m8 scores, then weights
  float sum;
};

// Eight cache elements as fp32 (fp16 widens exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 8-lane partial dot products of q (in registers) with K rows k0 .. k0 + cnt (row stride rs), two chains.
template <int NB, typename C>
inline void dots(const __m256* qr, const C* kh, int64_t rs, int64_t cnt, const int32_t* cols, int64_t c0,
                 float* part) {
  for (int64_t c = 0; c < cnt; c++) {
    const C* kr = kh + (cols ? cols[c] : c0 + c) * rs;
    __m256 a0 = _mm256_mul_ps(qr[0], load8(kr)), a1 = _mm256_mul_ps(qr[1], load8(kr + L));
    for (int d = 2; d + 1 < NB; d += 2) {
      a0 = _mm256_fmadd_ps(qr[d], load8(kr + d * L), a0);
      a1 = _mm256_fmadd_ps(qr[d + 1], load8(kr + (d + 1) * L), a1);
    }
    _mm256_storeu_ps(part + c * L, _mm256_add_ps(a0, a1));
  }
}

// Every pair's softmax(q k^T * scale) v over its own columns, in column order. The first `shared` columns
// (0 .. shared - 1, seen by every pair) are read in blocks of BC rows that stay in L1 while each pair uses
// them, so a tree's rows and a group's heads read K and V once, not once each. Why it stays exact: each
// pair's own operations are the same, in the same order, whatever else is in the call (scores in groups
// of 8 columns from column 0, their max, exp and sum, then v accumulated column by column).
template <int NB, typename C>
void attend_group(Pair* pairs, int64_t P, int64_t shared, const C* kh, const C* vh, int64_t rs, float scale,
                  float* part, int32_t* cols, float* obuf) {
  constexpr int64_t BC = 32;
  const int64_t s8 = shared / L * L;
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 qr[NB];
  for (int64_t b = 0; b < s8; b += BC) {  // scores over the shared columns
    const int64_t cnt = std::min(BC, s8 - b);
    for (int64_t j = 0; j < P; j++) {
      for (int d = 0; d < NB; d++) qr[d] = _mm256_loadu_ps(pairs[j].q + d * L);
      dots<NB>(qr, kh, rs, cnt, nullptr, b, part);
      for (int64_t c = 0; c < cnt; c += L) _mm256_storeu_ps(pairs[j].p + b + c, _mm256_mul_ps(hsum8(part + c * L), sc));
    }
  }
  for (int64_t j = 0; j < P; j++) {  // each pair's own columns from s8 on, then its softmax
    Pair& x = pairs[j];
    const int64_t m = x.m, m8 = (m + L - 1) / L * L, cnt = m - s8;
    for (int64_t c = 0; c < cnt; c++) cols[c] = int32_t(s8 + c < x.lead ? s8 + c : x.tail[s8 + c - x.lead]);
    for (int d = 0; d < NB; d++) qr[d] = _mm256_loadu_ps(x.q + d * L);
    dots<NB>(qr, kh, rs, cnt, cols, 0, part);
    std::memset(part + cnt * L, 0, sizeof(float) * L * (m8 - m));
    for (int64_t c = 0; c < m8 - s8; c += L) _mm256_storeu_ps(x.p + s8 + c, _mm256_mul_ps(hsum8(part + c * L), sc));
    float* p = x.p;
    __m256 mv = _mm256_set1_ps(-INFINITY);  // a max is exact in any order
    for (int64_t c = 0; c + L <= m; c += L) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + c));
    alignas(32) float mt[L];
    _mm256_store_ps(mt, mv);
    float tmax = -INFINITY;
    for (int k = 0; k < L; k++) tmax = std::max(tmax, mt[k]);
    for (int64_t c = m / L * L; c < m; c++) tmax = std::max(tmax, p[c]);
    for (int64_t c = m; c < m8; c++) p[c] = -INFINITY;  // padding columns: exp gives 0
    const __m256 tv = _mm256_set1_ps(tmax);
    __m256 sv = _mm256_setzero_ps();
    for (int64_t c = 0; c < m8; c += L) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + c), tv));
      _mm256_storeu_ps(p + c, e);
      sv = _mm256_add_ps(sv, e);
    }
    x.sum = hsum_paired(sv);
  }
  std::memset(obuf, 0, sizeof(float) * P * NB * L);
  __m256 o[NB];
  for (int64_t b = 0; b < shared; b += BC) {  // v over the shared columns
    const int64_t e = std::min(b + BC, shared);
    for (int64_t j = 0; j < P; j++) {
      float* oj = obuf + j * NB * L;
      for (int d = 0; d < NB; d++) o[d] = _mm256_loadu_ps(oj + d * L);
      for (int64_t c = b; c < e; c++) {
        const __m256 pc = _mm256_set1_ps(pairs[j].p[c]);
        const C* vr = vh + c * rs;
        for (int d = 0; d < NB; d++) o[d] = _mm256_fmadd_ps(pc, load8(vr + d * L), o[d]);
      }
      for (int d = 0; d < NB; d++) _mm256_storeu_ps(oj + d * L, o[d]);
    }
  }
  for (int64_t j = 0; j < P; j++) {  // each pair's own columns, then the normalisation
    const Pair& x = pairs[j];
    const float* oj = obuf + j * NB * L;
    for (int d = 0; d < NB; d++) o[d] = _mm256_loadu_ps(oj + d * L);
    for (int64_t c = shared; c < x.m; c++) {
      const __m256 pc = _mm256_set1_ps(x.p[c]);
      const C* vr = vh + (c < x.lead ? c : x.tail[c - x.lead]) * rs;
      for (int d = 0; d < NB; d++) o[d] = _mm256_fmadd_ps(pc, load8(vr + d * L), o[d]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / x.sum);
    for (int d = 0; d < NB; d++) _mm256_storeu_ps(x.out + d * L, _mm256_mul_ps(o[d], inv));
  }
}

}  // namespace

namespace {

// One sequence's rows of an attention call: where its queries, outputs and cache are, and the columns each
// row sees (a leading run 0 .. lead - 1, then the rest: a tree row's cache, then its ancestors).
struct Rows {
  const float* q;  // row i, head h at q + i * qs + h * hd
  int64_t qs;
  float* out;  // row i at out + i * nh * hd
  const void *kp, *vp;  // fp32 or fp16 (half) elements
  bool half;
  int64_t hs, rs, n, end;
  std::vector<int64_t> lead, count;
  std::vector<std::vector<int32_t>> tail;
};

// q [n, nh * hd]; kc, vc [nkv, capacity, hd]; row i sees the cache columns where mask[i] is true (mask
// [n, end] bool), or with no mask columns 0..start+i (a chain).
Rows plan_rows(const float* q, int64_t qs, float* out, int64_t n, int64_t nh, const torch::Tensor& kc,
               const torch::Tensor& vc, int64_t start, const c10::optional<torch::Tensor>& mask) {
  const int64_t hd = kc.size(2);
  const bool half = kc.scalar_type() == torch::kHalf;
  TORCH_CHECK(kc.dim() == 3 && (hd == 16 || hd == 32 || hd == 64 || hd == 128 || hd == 256) && nh % kc.size(0) == 0 &&
              kc.stride(2) == 1 && (half || kc.scalar_type() == torch::kFloat) && vc.sizes() == kc.sizes() &&
              vc.strides() == kc.strides() && vc.scalar_type() == kc.scalar_type(),
              "attend: head_dim must be 16, 32, 64, 128 or 256, and K and V caches alike (fp32 or fp16)");
  Rows r{q, qs, out, kc.data_ptr(), vc.data_ptr(), half, kc.stride(0), kc.stride(1), n, start + n,
         std::vector<int64_t>(n), std::vector<int64_t>(n), std::vector<std::vector<int32_t>>(n)};
  const bool* mp = nullptr;
  int64_t ms = 0;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->dim() == 2 && mask->size(0) == n &&
                mask->stride(1) == 1, "mask must be bool [n, end] with contiguous rows");
    r.end = mask->size(1);
    mp = mask->data_ptr<bool>();
    ms = mask->stride(0);
  }
  TORCH_CHECK(kc.size(1) >= r.end, "the cache is shorter than the mask");
  for (int64_t i = 0; i < n; i++) {
    if (!mp) {
      r.lead[i] = r.count[i] = start + i + 1;
      continue;
    }
    const bool* row = mp + i * ms;
    int64_t j = 0;
    while (j < r.end && row[j]) j++;
    r.lead[i] = j;
    for (; j < r.end; j++)
      if (row[j]) r.tail[i].push_back(int32_t(j));
    r.count[i] = r.lead[i] + int64_t(r.tail[i].size());
  }
  return r;
}

constexpr int64_t PMAX = 64;  // pairs attended together

template <typename C>
void attend_head(Pair* pairs, int64_t P, int64_t shared, const C* kh, const C* vh, int64_t rs, int64_t hd, float scale,
                 float* part, int32_t* cols, float* obuf) {
  switch (hd) {
    case 16: attend_group<2>(pairs, P, shared, kh, vh, rs, scale, part, cols, obuf); break;
    case 32: attend_group<4>(pairs, P, shared, kh, vh, rs, scale, part, cols, obuf); break;
    case 64: attend_group<8>(pairs, P, shared, kh, vh, rs, scale, part, cols, obuf); break;
    case 128: attend_group<16>(pairs, P, shared, kh, vh, rs, scale, part, cols, obuf); break;
    default: attend_group<32>(pairs, P, shared, kh, vh, rs, scale, part, cols, obuf); break;  // 256 (Gemma 3)
  }
}

// Tasks lo .. hi of a sequence's n * nh, ordered (kv head, row, head of its group): consecutive tasks share
// K and V, and up to PMAX of one kv head are attended together. Buffers sized for m8max columns.
void attend_tasks(const Rows& r, int64_t nh, int64_t group, int64_t hd, int64_t lo, int64_t hi, int64_t m8max,
                  float* part, float* p, float* obuf, int32_t* cols) {
  const float scale = 1.0f / std::sqrt(float(hd));
  const int64_t n = r.n;
  Pair pairs[PMAX];
  for (int64_t t = lo; t < hi;) {
    const int64_t g = t / (n * group);
    const int64_t stop = std::min({hi, (g + 1) * n * group, t + PMAX});
    int64_t P = 0, shared = r.end;
    for (; t < stop; t++, P++) {
      const int64_t x = t % (n * group), i = x / group, h = g * group + x % group;
      pairs[P] = Pair{r.q + i * r.qs + h * hd, r.out + i * nh * hd + h * hd, r.lead[i], r.count[i], r.tail[i].data(),
                      p + P * m8max, 0.0f};
      shared = std::min(shared, r.lead[i]);
    }
    if (r.half)
      attend_head(pairs, P, shared, static_cast<const at::Half*>(r.kp) + g * r.hs,
                  static_cast<const at::Half*>(r.vp) + g * r.hs, r.rs, hd, scale, part, cols, obuf);
    else
      attend_head(pairs, P, shared, static_cast<const float*>(r.kp) + g * r.hs, static_cast<const float*>(r.vp) + g * r.hs,
                  r.rs, hd, scale, part, cols, obuf);
  }
}

template <typename X>
void grow(std::vector<X>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(n);
}

// Every sequence's tasks in one parallel loop: task u belongs to the sequence s with first[s] <= u < first[s + 1].
void attend_all(const std::vector<Rows>& seqs, int64_t nh, int64_t group, int64_t hd) {
  std::vector<int64_t> first(seqs.size() + 1, 0);
  int64_t m8max = L, work = 0;
  for (size_t s = 0; s < seqs.size(); s++) {
    first[s + 1] = first[s] + seqs[s].n * nh;
    m8max = std::max(m8max, (seqs[s].end + L - 1) / L * L);
    work += seqs[s].n * nh * seqs[s].end;
  }
  const int64_t tasks = first.back();
  const int64_t grain = std::max<int64_t>(1, tasks * 32768 / std::max<int64_t>(1, work * hd));
  at::parallel_for(0, tasks, grain, [&](int64_t lo, int64_t hi) {
    // scratch kept per thread, grown only: allocated and zeroed per call (64 pairs' scores at a 2k-token
    // context: 0.5 MB), it took 30% of a 64-row prefill chunk's attention
    thread_local std::vector<float> part, p, obuf;
    thread_local std::vector<int32_t> cols;
    const int64_t pairs = std::min(PMAX, hi - lo);
    grow(part, (m8max + L) * L);
    grow(p, pairs * m8max);
    grow(obuf, pairs * hd);
    grow(cols, m8max);
    size_t s = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
    for (; lo < hi; s++) {
      const int64_t e = std::min(hi, first[s + 1]);
      attend_tasks(seqs[s], nh, group, hd, lo - first[s], e - first[s], m8max, part.data(), p.data(), obuf.data(),
                   cols.data());
      lo = e;
    }
  });
}

}  // namespace

// q [n, nh * hd]; kc, vc [nkv, capacity, hd]; row i sees the cache columns where mask[i] is true (mask
// [n, end] bool), or with no mask columns 0..start+i (a chain). softmax(q k^T / sqrt(hd)) v per head,
// over those columns in order -> [n, nh * hd].
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, int64_t start,
                     const c10::optional<torch::Tensor>& mask) {
  check_rows(q, "q");
  const int64_t n = q.size(0), hd = kc.size(2), nh = q.size(1) / hd;
  TORCH_CHECK(nh * hd == q.size(1), "attend: q's width is not a whole number of heads");
  auto out = torch::empty({n, nh * hd}, q.options());
  std::vector<Rows> seqs;
  seqs.push_back(plan_rows(q.data_ptr<float>(), q.stride(0), out.data_ptr<float>(), n, nh, kc, vc, start, mask));
  attend_all(seqs, nh, nh / kc.size(0), hd);
  return out;
}

// Several sequences' attention in one call: q [sum(sizes), nh * hd] holds sequence s's rows after those of
// the sequences before it; each attends over layer `layer` of its own cache ks[s], vs[s] [layers, 1, nkv,
// capacity, hd] as attend(its rows, that layer's kc, vc, starts[s], masks[s]) would, to the bit (a row's operations do not depend on what shares the call),
// in one parallel loop instead of one per sequence.
torch::Tensor attend_many(const torch::Tensor& q, const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                          int64_t layer, const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes,
                          const std::vector<c10::optional<torch::Tensor>>& masks) {
  check_rows(q, "q");
  const size_t S = sizes.size();
  TORCH_CHECK(S > 0 && ks.size() == S && vs.size() == S && starts.size() == S && masks.size() == S,
              "attend_many: one cache, start, size and mask per sequence");
  std::vector<torch::Tensor> kcs, vcs;
  for (size_t s = 0; s < S; s++) {
    kcs.push_back(ks[s].select(0, layer).select(0, 0));
    vcs.push_back(vs[s].select(0, layer).select(0, 0));
  }
  const int64_t hd = kcs[0].size(2), nh = q.size(1) / hd, nkv = kcs[0].size(0);
  TORCH_CHECK(nh * hd == q.size(1) && std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) == q.size(0),
              "attend_many: q must hold every sequence's rows, whole heads");
  auto out = torch::empty({q.size(0), nh * hd}, q.options());
  std::vector<Rows> seqs;
  int64_t row = 0;
  for (size_t s = 0; s < S; s++) {
    TORCH_CHECK(kcs[s].size(2) == hd && kcs[s].size(0) == nkv, "attend_many: the caches' shapes differ");
    seqs.push_back(plan_rows(q.data_ptr<float>() + row * q.stride(0), q.stride(0),
                             out.data_ptr<float>() + row * nh * hd, sizes[s], nh, kcs[s], vcs[s], starts[s], masks[s]));
    row += sizes[s];
  }
  attend_all(seqs, nh, nh / nkv, hd);
  return out;
}
