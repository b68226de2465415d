// Seeded uniform doubles: u[i] = 52 bits of a counter's hash, as (bits | 1.0's exponent) - 1, the multiples of
// 2^-52 in [0, 1). The hash is wyrand's (one 64 x 64 -> 128-bit multiply, high word xor low word) at
// z = mum(seed ^ P0, P1) + (i + 1) P0; sampling.uniform64 computes the same in numpy.
//
// Why a counter, not a sequential generator: a seeded sampled request draws noise over the whole vocabulary at
// every position (sampling.Coupling). MT19937 (torch.rand's) twists its state serially: 0.23 ms of a SmolLM2
// step on an AVX2-only Zen 1 (0.03 ms on Zen 4, vectorised). Here each element is one multiply (0.08 ms on that
// Zen 1); integers and one exact subtraction, so the same bits on every machine.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops.h"

namespace {

constexpr uint64_t P0 = 0xa0761d6478bd642fULL, P1 = 0xe7037ed1a0b428dbULL;

inline uint64_t mum(uint64_t a, uint64_t b) {
  const __uint128_t r = static_cast<__uint128_t>(a) * b;
  return static_cast<uint64_t>(r >> 64) ^ static_cast<uint64_t>(r);
}

}  // namespace

torch::Tensor uniform64(uint64_t seed, int64_t n) {
  TORCH_CHECK(n >= 0, "uniform64: n must be >= 0");
  torch::Tensor out = torch::empty({n}, torch::kFloat64);
  double* o = out.data_ptr<double>();
  const uint64_t base = mum(seed ^ P0, P1);
  constexpr uint64_t ONE = 0x3FF0000000000000ULL;  // 1.0: (52 random bits | ONE) is a double in [1, 2)
  for (int64_t i = 0; i < n; i++) {
    const uint64_t z = base + static_cast<uint64_t>(i + 1) * P0;
    const uint64_t bits = (mum(z, z ^ P1) >> 12) | ONE;
    double x;
    std::memcpy(&x, &bits, sizeof x);
    o[i] = x - 1.0;
  }
  return out;
}

// sampling.Coupling's draw: the first x of largest p[x] / E[x], E[x] = -log(max(u[x], 1e-300)) (glibc's log, as
// Python's math.log), p float32, u float64 [n]. Exact without a log per token: -log u >= 1 - u, so p / (1 - u)
// bounds each ratio, and only a token whose bound reaches the best ratio found yet is computed (a handful).
int64_t race(const torch::Tensor& probs, const torch::Tensor& u) {
  TORCH_CHECK(probs.scalar_type() == torch::kFloat32 && u.scalar_type() == torch::kFloat64 && probs.dim() == 1 &&
                  u.dim() == 1 && probs.numel() == u.numel() && probs.numel() > 0 && probs.is_contiguous() &&
                  u.is_contiguous(),
              "race: probs float32 [n] and u float64 [n], contiguous");
  const float* p = probs.data_ptr<float>();
  const double* q = u.data_ptr<double>();
  const int64_t n = probs.numel();
  const auto ratio = [&](int64_t i) { return static_cast<double>(p[i]) / -std::log(std::max(q[i], 1e-300)); };
  // the likeliest token first: non-negative floats order as their bits, whose max vectorizes
  const int32_t* bits = reinterpret_cast<const int32_t*>(p);
  int32_t top = bits[0];
  for (int64_t i = 1; i < n; i++) top = std::max(top, bits[i]);
  int64_t best_i = 0;
  while (best_i < n - 1 && bits[best_i] != top) best_i++;
  double best = ratio(best_i);
  constexpr double SLACK = 1 + 1e-9;  // the bound's own rounding
  constexpr int64_t B = 64;  // tokens tested together: whether any of them is a candidate vectorizes
  for (int64_t b = 0; b < n; b += B) {
    const int64_t e = std::min(n, b + B);
    int64_t hits = 0;
    for (int64_t i = b; i < e; i++) hits += static_cast<double>(p[i]) * SLACK >= best * (1.0 - q[i]);
    if (hits == 0) continue;
    for (int64_t i = b; i < e; i++) {
      if (static_cast<double>(p[i]) * SLACK < best * (1.0 - q[i])) continue;
      const double r = ratio(i);
      if (r > best || (r == best && i < best_i)) {
        best = r;
        best_i = i;
      }
    }
  }
  return best_i;
}
