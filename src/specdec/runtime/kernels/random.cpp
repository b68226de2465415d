// Uniform doubles bit for bit as torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=float64)
// draws them on the CPU: MT19937 seeded with the seed's low 32 bits, two outputs per double (the first the
// high word), the low 53 bits of that 64-bit word times 2^-53.
//
// Why: a seeded sampled request draws noise over the whole vocabulary at every position (sampling.Coupling),
// and torch makes one generator call per double: 0.2 ms of a SmolLM2 step, 0.6 ms over Qwen's 152k tokens.
// Here the twist and the tempering run over whole vectors of the state; integer operations only, so every
// vector width gives the same bits.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops.h"

namespace {

constexpr int N = 624, M = 397;
constexpr uint32_t MATRIX_A = 0x9908b0dfU, UPPER = 0x80000000U, LOWER = 0x7fffffffU;

inline uint32_t mix(uint32_t a, uint32_t b, uint32_t c) {  // c ^ twist of (a's top bit, b's other bits)
  const uint32_t y = (a & UPPER) | (b & LOWER);
  return c ^ (y >> 1) ^ ((y & 1U) ? MATRIX_A : 0U);
}

// The next 624 words of state, in place. Each loop reads only words it has not written yet, or words
// written at least N - M = 227 places earlier: either way a vector of them holds what the scalar loop reads.
void twist(uint32_t* mt) {
  for (int i = 0; i < N - M; i++) mt[i] = mix(mt[i], mt[i + 1], mt[i + M]);
#pragma GCC ivdep
  for (int i = N - M; i < N - 1; i++) mt[i] = mix(mt[i], mt[i + 1], mt[i + M - N]);
  mt[N - 1] = mix(mt[N - 1], mt[0], mt[M - 1]);
}

inline uint32_t temper(uint32_t y) {
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680U;
  y ^= (y << 15) & 0xefc60000U;
  return y ^ (y >> 18);
}

}  // namespace

torch::Tensor uniform64(uint64_t seed, int64_t n) {
  TORCH_CHECK(n >= 0, "uniform64: n must be >= 0");
  uint32_t mt[N];
  mt[0] = static_cast<uint32_t>(seed & 0xffffffffU);
  for (int j = 1; j < N; j++) mt[j] = 1812433253U * (mt[j - 1] ^ (mt[j - 1] >> 30)) + static_cast<uint32_t>(j);
  torch::Tensor out = torch::empty({n}, torch::kFloat64);
  double* o = out.data_ptr<double>();
  constexpr uint64_t MASK = (uint64_t{1} << 53) - 1;
  for (int64_t k = 0; k < n; k += N / 2) {  // 312 doubles per twist: a pair never straddles one
    twist(mt);
    const int64_t m = std::min<int64_t>(N / 2, n - k);
    for (int64_t j = 0; j < m; j++) {
      const uint64_t x = (static_cast<uint64_t>(temper(mt[2 * j])) << 32) | temper(mt[2 * j + 1]);
      o[k + j] = static_cast<double>(x & MASK) * 0x1p-53;
    }
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
