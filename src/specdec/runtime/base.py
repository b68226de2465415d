"""What the engine needs from a model: a forward over new tokens (a chain or a flattened tree) with an
explicit mask and positions against a KV cache, and compaction of that cache to the accepted rows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.errors import SpecdecError
from specdec.runtime import stream
from specdec.runtime.kv import Rows
from specdec.runtime.packed import INT4, Q8


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [rows, V] for the requested rows
    features: torch.Tensor  # [n, H] last hidden state after the final norm (feeds the LM head)
    aux: torch.Tensor | None = None  # [n, k * H] hidden states entering the asked-for layers (None: none asked)


# one sequence's rows of a packed forward: (its runner, tokens [n], positions [n] or None, mask or None)
Part = tuple["Runner", torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


class Cached:
    """Batch size 1 over a cache whose accounting (kv.Rows) is the runner's: `length` committed rows
    followed by `n_pending` rows written by forwards since the last `commit`."""

    cache: Rows
    device: torch.device
    max_length: int  # context window of the model
    overflow = "sequence would exceed the model's context of {} tokens"

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def n_pending(self) -> int:
        return self.cache.n_pending

    def commit(self, keep: torch.Tensor | list[int] | range) -> None:
        """Keep the given pending rows (indices relative to the first pending row), drop the rest."""
        self.cache.commit(keep)

    def rollback(self) -> None:
        self.cache.rollback()

    def truncate(self, length: int) -> None:
        """Drop committed rows past `length` (e.g. a drafter whose guess was rejected)."""
        self.cache.truncate(length)

    def reset(self) -> None:
        """Forget the sequence (start a new generation)."""
        self.cache.reset()

    def _new_rows(self, n: int, positions: torch.Tensor | None, mask: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        """(first row, positions) of n new rows; positions default to a chain after every cached row."""
        start = self.cache.length + self.cache.n_pending
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        if start + n > self.max_length or int(positions.max()) >= self.max_length:
            raise ValueError(self.overflow.format(self.max_length))
        if mask is not None and mask.shape != (n, start + n):
            raise ValueError(f"mask must be [{n}, {start + n}], got {tuple(mask.shape)}")
        return start, positions


class Runner(Cached, ABC):
    config: object
    dtype: torch.dtype  # of its activations and KV cache
    vocab_size: int
    hidden_size: int
    n_layers: int
    # the precision of its linear weights (fp32, bf16, fp16, int8, int4, gguf): decoding is lossless
    # relative to this target, whatever the model file holds
    weights: str
    lm_head: Callable[[torch.Tensor], torch.Tensor]  # features [n, H] -> logits [n, V]
    decode_kernel = ""  # what runs a one-row decode step ("stream", "gemv", "packed"; "": the framework's)
    kernel_build = ""  # which build of the streaming kernels ran ("": none): costs timed on another are stale
    exact_rows = 0  # forwards of up to this many rows give each row the bits it would get alone (0: none)
    # the kernels a forward runs on (the stats line says it: the same model is 2x slower on a fallback)
    kernel_path = "torch"

    @torch.inference_mode()
    def pretend_cached(self, n: int) -> None:
        """Commit rows up to `n` for timing the forwards after them, whose cost does not depend on what they
        attend to: here a forward over random tokens; a runner whose cache is preallocated skips it."""
        more = n - self.length
        if more <= 0:
            return
        self.forward(torch.randint(0, min(self.vocab_size, 1000), (more,)), logits_rows=slice(-1, None))
        self.commit(range(more))

    def shared_lm_head(self, weights: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Its LM head for a draft head at `weights` to share rather than hold a second copy of the rows;
        None when it has none to share (not pre-packed, or another precision)."""
        return None

    def head_weights(self, head: torch.nn.Module) -> str:
        """The precision a draft head over this target runs at: the target's, except on the streaming kernel:
        Q4_1 blocks over a GGUF file's target, Q8_0 blocks over fp32. Why: the rounding moves draft scores,
        never what is accepted, and after a target forward has evicted the head from the caches a draft
        step is a read of its weights from memory (SmolLM2's head: 5.0 instead of 8.5 MB a step on Q4_1 blocks,
        tune's tau 1.71 -> 1.70; docs/architecture.md)."""
        if self.weights not in ("fp32", "gguf") or stream.kernel() is None:
            return self.weights
        return INT4 if self.weights == "gguf" else Q8

    head_ids: torch.Tensor | None = None  # the token ids its logits' columns are (None: every id, in order)

    def restrict_head(self, ids: torch.Tensor) -> bool:
        """Score only these token ids from now on: logits [n, len(ids)], column j for token ids[j] (a draft's
        reduced vocabulary, vocab.py). False where this runner cannot: it then scores every id."""
        return False

    def requantize(self, qtype: int) -> bool:
        """Re-quantize every matrix (layers and LM head) to this GGML block format, in place: a draft model's
        steps read fewer bytes, and the target still verifies every token. False where this runner cannot
        (its weights are not GGUF blocks): it keeps them."""
        return False

    requantized_to: str | None = None  # the block format requantize() gave every matrix (None: the file's own)

    def score_also(self, ids: list[int]) -> None:
        """After restrict_head: also score these ids, outside the restricted set, until the next call (the
        request's own tokens); [] drops them. Nothing to do for a head over every id."""

    def fork(self) -> Runner | None:
        """A runner over the same weights with an empty cache of its own: one sequence of a batch
        (forward_many). None: this runner cannot (its sequences then decode one at a time)."""
        return None

    @property
    def family(self) -> int:
        """Runners whose forwards forward_many may pack (forks of one runner) share this."""
        return id(self)

    def forward_many(self, parts: Sequence[Part], aux_layers: tuple[int, ...] = (),
                     logits_rows: Sequence[slice | None] | None = None) -> list[ForwardOut]:
        """Runner.forward for each part (a fork of this runner, tokens, positions, mask), each into its
        own cache, in as few forwards as the runner can while giving each row the bits it gets alone.
        logits_rows: each part's (Runner.forward's; default all rows)."""
        lrs = logits_rows or [None] * len(parts)
        return [r.forward(t, p, m, lr, aux_layers) for (r, t, p, m), lr in zip(parts, lrs)]

    @abstractmethod
    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, logits_rows: slice | None,
        aux_layers: tuple[int, ...],
    ) -> ForwardOut: ...

    def check_aux_layers(self, layers: tuple[int, ...], what: str) -> None:
        """A SpecdecError (before any generation) when `what` asks for hidden states of layers it lacks."""
        bad = [i for i in layers if not 0 <= i < self.n_layers]
        if bad:
            raise SpecdecError(f"{what} reads the hidden states entering layers {list(layers)}, but the target "
                               f"has {self.n_layers} layers")

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        logits_rows: slice | None = None,
        aux_layers: tuple[int, ...] = (),
    ) -> ForwardOut:
        """tokens [n]; positions [n] (default: a chain after every cached row); mask [n, cached + n]
        bool, True = visible (default: all cached rows + causal among the new ones). aux_layers: also
        return the hidden state entering each of these layers, concatenated (ForwardOut.aux); computed
        only when asked."""
        n = tokens.numel()
        _, positions = self._new_rows(n, positions, mask)
        if mask is not None:
            mask = mask.to(self.device)
        out = self._forward(tokens.to(self.device), positions.to(self.device), mask, logits_rows, tuple(aux_layers))
        self.cache.n_pending += n
        return out


def chain_mask(n_cached: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    m = torch.ones(n, n_cached + n, dtype=torch.bool, device=device)
    m[:, n_cached:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return m


def tree_mask(n_cached: int, ancestors: torch.Tensor) -> torch.Tensor:
    """Cached rows fully visible, then the tree's own ancestor mask."""
    n = ancestors.shape[0]
    m = torch.ones(n, n_cached + n, dtype=torch.bool, device=ancestors.device)
    m[:, n_cached:] = ancestors
    return m


def layer_windows(cfg, n_layers: int) -> list[int | None]:
    """Each layer's sliding window (None: it sees every earlier row) from an HF config: `layer_types` names
    the sliding layers where the config has them (Gemma 3), else one window for all (Mistral, Qwen2)."""
    w = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not w or (cfg.model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False)):
        return [None] * n_layers
    if types:
        return [w if t == "sliding_attention" else None for t in types]
    return [w] * n_layers


def in_window(mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """mask [n, cols] also hiding every column `window` or more positions behind its row (HF's sliding window:
    positions, not column indices, since tree rows share positions)."""
    if window is None:
        return mask
    return mask & ((q_pos[:, None] - k_pos[None, :]) < window)


def logit_cap(cfg) -> float | None:
    """The config's final logit soft-capping (Gemma 2 and 3), read once: a transformers config's attribute
    lookup costs tens of microseconds, a missing one more."""
    return getattr(cfg, "final_logit_softcapping", None)


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), as HF applies it."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def side_mask(n_cached: int, ancestors: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
    """tree_mask's rows, then side rows (drafters.base.SideRows) that see the cached rows, the root and the
    side rows `sees` names; no tree row sees a side row."""
    n, m = ancestors.shape[0], sees.shape[0]
    out = torch.zeros(n + m, n_cached + n + m, dtype=torch.bool, device=ancestors.device)
    out[:n, :n_cached + n] = tree_mask(n_cached, ancestors)
    out[n:, :n_cached + 1] = True
    out[n:, n_cached + n:] = sees
    return out
