"""KV caches and the row accounting every runner shares (target runners, EAGLE head).

A cache holds `length` committed rows followed by `n_pending` rows written by forwards since the last
`commit`; the next forward appends after them. A commit keeps some pending rows (e.g. the accepted path
of a flattened tree: not contiguous in general) and drops the rest."""

from __future__ import annotations

import torch


class Rows:
    """The accounting, written once; subclasses move and drop the stored rows."""

    device: torch.device

    def __init__(self) -> None:
        self.length = 0
        self.n_pending = 0

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        raise NotImplementedError

    def _drop(self, length: int) -> None:
        """Forget stored rows from `length` on (a preallocated cache just overwrites them later)."""

    def commit(self, keep: torch.Tensor | list[int] | range) -> None:
        """Keep the given pending rows (indices relative to the first pending row), drop the rest."""
        rows = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        k = len(rows)
        if rows != list(range(k)):  # one index copy, none when the rows are already in place (a chain)
            with torch.inference_mode():
                self._move(torch.tensor(rows, device=self.device) + self.length,
                           torch.arange(self.length, self.length + k, device=self.device))
        self.length += k
        self.n_pending = 0
        self._drop(self.length)

    def rollback(self) -> None:
        """Drop every pending row."""
        self.n_pending = 0
        self._drop(self.length)

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        """Drop committed rows past `length` (e.g. a drafter whose guess was rejected)."""
        if length > self.length:
            raise ValueError("cannot truncate to a longer length")
        self.length, self.n_pending = length, 0
        self._drop(length)

    def reset(self) -> None:
        """Forget the sequence (start a new generation)."""
        self.length = self.n_pending = 0
        self._drop(0)


class KVCache(Rows):
    """Preallocated K and V [layers, batch, n_kv, capacity, head_dim], so compaction is one index copy
    and dropping rows costs nothing. `pos` [capacity] holds each row's position when asked for (sliding
    windows compare positions, not row indices: tree rows share positions)."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, max_length: int, device: torch.device | str,
                 dtype: torch.dtype, capacity: int = 1024, batch: int = 1, positions: bool = False) -> None:
        super().__init__()
        self.dims = (n_layers, batch, n_kv, head_dim)
        self.max_length, self.device, self.dtype = max_length, torch.device(device), dtype
        self.capacity = 0
        self.k = self.v = torch.empty(0)
        self.pos = torch.empty(0, dtype=torch.long) if positions else None
        self._resize(capacity)

    def fresh(self, capacity: int) -> KVCache:
        """An empty cache of the same shape (another sequence over the same layers)."""
        n_layers, batch, n_kv, head_dim = self.dims
        return KVCache(n_layers, n_kv, head_dim, self.max_length, self.device, self.dtype, capacity, batch,
                       self.pos is not None)

    def reserve(self, n: int) -> None:
        """Room for `n` rows after the used ones; capacity at least doubles (amortised O(1) growth),
        capped at max_length."""
        end = self.length + self.n_pending + n
        if end > self.capacity:
            self._resize(max(end, 2 * self.capacity))

    def _resize(self, capacity: int) -> None:
        capacity = min(max(capacity, 1), self.max_length)
        n_layers, batch, n_kv, head_dim = self.dims
        shape = (n_layers, batch, n_kv, capacity, head_dim)
        k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        used = self.length + self.n_pending
        if self.capacity:
            k[:, :, :, :used], v[:, :, :, :used] = self.k[:, :, :, :used], self.v[:, :, :, :used]
        self.k, self.v = k, v
        if self.pos is not None:
            pos = torch.zeros(capacity, dtype=torch.long, device=self.device)
            pos[:used] = self.pos[:used]
            self.pos = pos
        self.capacity = capacity

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.k[:, :, :, dst] = self.k[:, :, :, src]
        self.v[:, :, :, dst] = self.v[:, :, :, src]
        if self.pos is not None:
            self.pos[dst] = self.pos[src]

