"""Sampling parameters and the one logits->probabilities transform shared by target and drafters."""

from __future__ import annotations

import hashlib
import math
from types import SimpleNamespace

import numpy as np
import torch

from specdec.options import Options, option


class SamplingParams(Options):
    """temperature 0 means greedy; top_k 0 and top_p 1 mean "off"."""

    temperature: float = option(0.0, "0 = greedy; any tiny positive value behaves like its limit", ge=0)
    top_k: int = option(0, "keep the k most likely tokens (0 = off)", ge=0)
    top_p: float = option(1.0, "keep the smallest set of tokens with this much mass (1 = off)", gt=0, le=1)
    seed: int | None = option(None, "for reproducible sampling (default: torch's global generator)", ge=0,
                              le=2**64 - 1)

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 **kw) -> None:
        super().__init__(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **kw)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def coupling(self, vocab: int, kernels=None) -> Coupling | None:
        """A seeded sampled request samples through a Coupling over the target's `vocab`: its text is a
        function of the seed and the target alone, the same for every method (kernels: Coupling's)."""
        return Coupling(self.seed, vocab, kernels) if self.seed is not None and not self.greedy else None

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


def argmax_rows(x: torch.Tensor) -> list[int] | int:
    """x.argmax(-1).tolist(): the first of equal maxima, NaN above all. Why numpy on the CPU: torch's argmax
    over vocabulary-wide rows runs a scalar loop, 43 us a SmolLM2 row against numpy's 4 (2 threads), and
    splits several rows across threads, which another busy process stalls 10x more (a server's clients)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return x.detach().numpy().argmax(-1).tolist()
    return x.argmax(-1).tolist()


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order HF uses); rows are distributions over the vocab.

    Always computed in fp32 so target and drafter see the same arithmetic.
    """
    logits = logits.float()
    if params.greedy:  # a point mass on the argmax: verification then reduces to exact matching
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = _tempered(logits, params.temperature)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # drop a token if the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def tempered_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log softmax(logits / T) in fp32 (T = 1 for greedy): how drafters rank children by the
    distribution the target samples. Shifted first, so a tiny T tends to the argmax instead of NaN."""
    logits = logits.float()
    return torch.log_softmax(logits if params.greedy else _tempered(logits, params.temperature), dim=-1)


SERIAL_ROWS = 8  # up to this many rows, _tempered runs in numpy: the same IEEE bits, no thread wake-ups


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T, shifted by the max first so that a tiny T tends to its limit (the argmax; exact ties
    share) instead of inf - inf = NaN. Below fp32's smallest normal T is taken as that limit. Why numpy
    for a few CPU rows: a max, a subtraction and a division round the same in any library, and torch
    splits each of them over threads (a vocabulary-wide row is past its grain), which cost a sampled
    SmolLM2 step ~0.1 ms of waking threads that had just finished the forward."""
    tiny = temperature < torch.finfo(torch.float32).tiny
    if not tiny and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() <= 2 \
            and logits.numel() <= SERIAL_ROWS * logits.shape[-1]:
        x = logits.detach().numpy()
        with np.errstate(all="ignore"):  # IEEE results without warnings, as torch gives them (a tiny T: -inf)
            return torch.from_numpy((x - x.max(-1, keepdims=True)) / np.float32(temperature))
    shifted = logits - logits.amax(-1, keepdim=True)
    if tiny:
        return torch.zeros_like(shifted).masked_fill(shifted < 0, float("-inf"))
    return shifted / temperature


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a distribution (any non-negative weights) by inverse CDF: one uniform against a
    float64 cumulative sum. Why not torch.multinomial: on CPU it takes 1.1 ms over a 49k vocabulary,
    this 0.06 ms, and a sampled decode step pays it once. A zero-weight token is never drawn."""
    cdf = torch.cumsum(probs.double(), 0)
    u = torch.rand(1, generator=generator, device=probs.device, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))  # the first token whose cumulative mass exceeds u
    return i if i < probs.numel() else int(torch.nonzero(probs).max())  # u rounded up to the total


class Coupling:
    """Sampling keyed by (seed, position): the token at position i is argmax_x(log p_i(x) + G_i(x)), where
    G_i is iid Gumbel noise over the target's vocabulary from a generator seeded by (seed, i) alone. By
    the Gumbel-max trick that is an exact draw from p_i (after temperature, top-k, top-p), and it depends
    on nothing but the seed, i and the target's distribution there. A draft token is accepted iff it
    equals the target's draw, so every method gives vanilla's text for a seed, however it drafts; a
    drafter that ranks by its own log-probabilities plus the same noise proposes the likeliest match.
    The draw is taken as argmax_x p_i(x) / E_i(x) with E_i = -log U_i iid Exp(1) and G_i = -log E_i (the
    exponential race: the same token, without a log of p or of E), U_i = uniform64's counter-based doubles
    for a key hashed from (seed, i). kernels: the native module (runtime.stream.kernel()), whose uniform64
    and race compute U and the draw faster with the same result; None: numpy here."""

    KEEP = 64  # positions whose noise stays cached (a step reads a few consecutive ones)

    def __init__(self, seed: int, vocab: int, kernels=None) -> None:
        self.seed, self.vocab, self.kernels = seed, vocab, kernels
        self._u: dict[int, torch.Tensor] = {}
        self._gumbel: dict[int, torch.Tensor] = {}

    def uniforms(self, position: int) -> torch.Tensor:
        """U_position [vocab], fp64, drawn on the CPU (the same on every device)."""
        u = self._u.get(position)
        if u is None:
            h = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
            seed = int.from_bytes(h, "little") >> 1
            u = (self.kernels or _numpy).uniform64(seed, self.vocab)
            u = self._keep(self._u, position, u)
        return u

    def exponential(self, position: int) -> torch.Tensor:
        """E_position [vocab] = -log U, fp64."""
        return self.uniforms(position).clamp_min(1e-300).log_().neg_()

    def gumbel(self, position: int) -> torch.Tensor:
        """G_position [vocab] = -log E_position, fp64 (what a drafter ranks by; the draw itself needs only U)."""
        g = self._gumbel.get(position)
        return g if g is not None else self._keep(self._gumbel, position, -torch.log(self.exponential(position)))

    def _keep(self, cache: dict[int, torch.Tensor], position: int, x: torch.Tensor) -> torch.Tensor:
        if len(cache) >= self.KEEP:
            cache.pop(next(iter(cache)))
        cache[position] = x
        return x

    def pick(self, probs: torch.Tensor, position: int) -> int:
        """The target's draw at `position` from `probs` [vocab]."""
        p, u = probs.float().cpu().contiguous(), self.uniforms(position)
        return (self.kernels or _numpy).race(p, u)

    def perturb(self, logprobs: torch.Tensor, positions: list[int], ids: torch.Tensor | None = None) -> torch.Tensor:
        """log_softmax(log q + G) for rows of a drafter's `logprobs` [n, V_d], row r at positions[r]: its
        argmax is the draft's best guess of the target's draw there, and, being log-probabilities, the
        scores never grow along a path (what EAGLE-2's tree ranking assumes). ids [V_d] maps the columns
        to target ids (a reduced draft vocabulary; default: the first V_d target ids)."""
        g = torch.stack([self.gumbel(p) for p in positions])
        g = g[:, ids.cpu()] if ids is not None else g[:, : logprobs.shape[-1]]
        return torch.log_softmax(logprobs + g.to(logprobs.device, logprobs.dtype), -1)


def uniform64(seed: int, n: int) -> torch.Tensor:
    """n uniform doubles in [0, 1) for a 64-bit seed, as kernels/random.cpp draws them: element i is 52 bits of
    wyrand's hash mum(z, z ^ P1) at z = mum(seed ^ P0, P1) + (i + 1) P0 (uint64 arithmetic wraps, as in C++)."""
    z = _mum(np.array([seed], dtype=np.uint64) ^ _P0, _P1) + np.arange(1, n + 1, dtype=np.uint64) * _P0
    bits = (_mum(z, z ^ _P1) >> np.uint64(12)) | np.uint64(0x3FF0000000000000)
    return torch.from_numpy(bits.view(np.float64) - 1.0)


_P0, _P1, _LOW = np.uint64(0xA0761D6478BD642F), np.uint64(0xE7037ED1A0B428DB), np.uint64(0xFFFFFFFF)


def _mum(a: np.ndarray, b: np.ndarray | np.uint64) -> np.ndarray:
    """The high and low words of the 128-bit products a * b, xor-ed (from 32-bit halves: numpy has no 128 bits)."""
    s = np.uint64(32)
    a0, a1, b0, b1 = a & _LOW, a >> s, b & _LOW, b >> s
    p00, p01, p10 = a0 * b0, a0 * b1, a1 * b0
    mid = (p00 >> s) + (p01 & _LOW) + (p10 & _LOW)
    high = a1 * b1 + (p01 >> s) + (p10 >> s) + (mid >> s)
    return high ^ ((mid << s) | (p00 & _LOW))


def race(probs: torch.Tensor, u: torch.Tensor) -> int:
    """The first x of largest p[x] / E[x], E = -log max(u, 1e-300) (math.log): Coupling's draw (kernels/random.cpp
    computes the same). Exact without a log per token: -log u >= 1 - u, so p / (1 - u) bounds each ratio; the
    tokens are tried by that bound, largest first, until it falls below the best ratio found (a handful, even
    over a flat distribution)."""
    p, q = probs.double().numpy(), u.numpy()
    bound = p * (1 + 1e-9) / (1.0 - q)  # 1e-9: the bound's own rounding; u < 1 always

    def ratio(i: int) -> float:
        return float(p[i]) / -math.log(max(float(q[i]), 1e-300))

    best_i = int(np.argmax(p))
    best = ratio(best_i)
    cand = np.nonzero(bound >= best)[0]
    for i in cand[np.argsort(-bound[cand], kind="stable")].tolist():
        if bound[i] < best:
            break
        r = ratio(i)
        if r > best or (r == best and i < best_i):
            best, best_i = r, i
    return best_i


_numpy = SimpleNamespace(uniform64=uniform64, race=race)  # Coupling's kernels where there are none
