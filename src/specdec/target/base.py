"""What the engine needs from a model: a forward over new tokens (a chain or a flattened tree) with an
explicit mask and positions against a KV cache, and compaction of that cache to the accepted rows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [rows, V] for the requested rows
    features: torch.Tensor  # [n, H] last hidden state after the final norm (feeds the LM head)


class Runner(ABC):
    """Batch size 1. The cache holds `length` committed rows followed by `n_pending` rows written by
    forwards since the last `commit`; the next forward appends after them."""

    config: object
    device: torch.device
    vocab_size: int
    hidden_size: int
    max_length: int  # context window of the model

    def __init__(self) -> None:
        self.length = 0
        self.n_pending = 0

    @abstractmethod
    def reset(self) -> None:
        """Forget the sequence (start a new generation)."""

    @abstractmethod
    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, logits_rows: slice | None
    ) -> ForwardOut: ...

    @abstractmethod
    def _compact(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...

    @abstractmethod
    def _truncate(self, length: int) -> None: ...

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        logits_rows: slice | None = None,
    ) -> ForwardOut:
        """tokens [n]; positions [n] (default: a chain after every cached row); mask [n, cached + n]
        bool, True = visible (default: all cached rows + causal among the new ones)."""
        n = tokens.numel()
        start = self.length + self.n_pending
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        if start + n > self.max_length or int(positions.max()) >= self.max_length:
            raise ValueError(f"sequence would exceed the model's context of {self.max_length} tokens")
        if mask is not None and mask.shape != (n, start + n):
            raise ValueError(f"mask must be [{n}, {start + n}], got {tuple(mask.shape)}")
        if mask is not None:
            mask = mask.to(self.device)
        out = self._forward(tokens.to(self.device), positions.to(self.device), mask, logits_rows)
        self.n_pending += n
        return out

    @torch.inference_mode()
    def commit(self, keep: torch.Tensor | list[int]) -> None:
        """Keep the given pending rows (indices relative to the first pending row), drop the rest."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device)
        k = keep.numel()
        dst = torch.arange(self.length, self.length + k, device=self.device)
        src = keep + self.length
        if k and not torch.equal(src, dst):
            self._compact(src, dst)
        self.length += k
        self.n_pending = 0
        self._truncate(self.length)

    def rollback(self) -> None:
        self.commit([])

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        """Drop committed rows past `length` (e.g. a drafter whose guess was rejected)."""
        if length > self.length:
            raise ValueError("cannot truncate to a longer length")
        self.length, self.n_pending = length, 0
        self._truncate(length)


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
