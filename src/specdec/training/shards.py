"""Training data in memory: datagen's shards as one token/feature table, the batches of a step, and the
reduced draft vocabulary they imply."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdec.errors import SpecdecError
from specdec.training.datagen import list_shards


class ShardData:
    """All shards in memory (fp16 features: ~1.2 KB per token at H = 576)."""

    def __init__(self, data: str | os.PathLike, names: list[str] | None = None, max_len: int = 1024) -> None:
        """data: one datagen dir or several, comma-separated; names: the exact shard files of a run
        being resumed (datagen may have added shards since)."""
        dirs = [Path(d.strip()).expanduser() for d in str(data).split(",") if d.strip()]
        missing = [str(d) for d in dirs if not d.is_dir()]
        if names is None and missing:  # e.g. a "~" the shell left unexpanded after a comma
            raise SpecdecError(f"data directory not found: {', '.join(missing)}")
        if names is not None:
            files = [Path(n) for n in names]
        else:
            files = [f.resolve() for d in dirs for f in list_shards(d)]
        if not files:
            raise SpecdecError(f"no data shards (shard-*.safetensors) in {data}: run `specdec datagen` first")
        self.names = [str(f) for f in files]
        self.metas = [json.loads((d / "meta.json").read_text()) for d in dirs if (d / "meta.json").is_file()]
        ids, feats, masks, spans = [], [], [], []
        base = 0
        for f in files:
            if not f.is_file():
                raise SpecdecError(f"data shard {f} is missing (it was there when this run started)")
            try:
                t = load_file(str(f))
            except Exception as e:
                raise SpecdecError(f"cannot read data shard {f}: {e}") from None
            off = t["offsets"].tolist()
            for a, b in zip(off[:-1], off[1:]):
                if b - a >= 2:
                    spans.append((base + a, base + min(b, a + max_len)))
            ids.append(t["input_ids"].long())
            feats.append(t["features"])
            masks.append(t["loss_mask"])
            base += off[-1]
        self.ids, self.feats, self.mask = torch.cat(ids), torch.cat(feats), torch.cat(masks)
        self.spans = spans
        self.hidden_size = self.feats.shape[1]

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def n_tokens(self) -> int:
        return sum(b - a for a, b in self.spans)

    def token_counts(self, vocab: int) -> torch.Tensor:
        """How often each token is an answer token (what the head must predict)."""
        m = self.mask.bool()
        return torch.bincount(self.ids[m], minlength=vocab)[:vocab]

    def batch(self, seq_idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded (ids [b, T], features fp32 [b, T, H], loss mask [b, T] fp32; pads have mask 0)."""
        lens = [self.spans[i][1] - self.spans[i][0] for i in seq_idx]
        t = max(lens)
        ids = torch.zeros(len(seq_idx), t, dtype=torch.long)
        feats = torch.zeros(len(seq_idx), t, self.hidden_size)
        mask = torch.zeros(len(seq_idx), t)
        for r, i in enumerate(seq_idx):
            a, b = self.spans[i]
            ids[r, : b - a] = self.ids[a:b]
            feats[r, : b - a] = self.feats[a:b].float()
            mask[r, : b - a] = self.mask[a:b].float()
        return ids, feats, mask


def global_batch(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Sequence indices of global step `step`: epoch-wise permutations, a pure function of the step."""
    per_epoch = max(1, n // batch_size)
    epoch, pos = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[pos * batch_size:(pos + 1) * batch_size].tolist()


def build_draft_vocab(counts: torch.Tensor, size: int, always: set[int] = frozenset()) -> torch.Tensor:
    """The `size` most frequent tokens (ties -> lower id) plus `always`; sorted target ids."""
    size = min(size, counts.numel())
    order = sorted(range(counts.numel()), key=lambda i: (-int(counts[i]), i))
    keep = list(dict.fromkeys([t for t in always if t < counts.numel()] + order))[:size]
    return torch.tensor(sorted(keep), dtype=torch.long)
