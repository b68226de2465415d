"""Hydra heads (Ankner et al., 2024): Medusa heads made sequentially dependent.

Head k (0-based) predicts the token at depth k + 1 below the root, as Medusa's head k, but reads the
embeddings of the tokens on its path too: the root (the token the target emitted from f_t) and the
drafts at depths 1..k, from the target's input embedding table E:
    x = [f, E[root], E[d_1], ..., E[d_k]];  h = f + SiLU(W_0 x + b_0);  h = h + SiLU(W_l h + b_l) (l >= 1);
    logits = LM_k(h).
W_0 starts at zero, so every head begins as the target's own LM head on f (Medusa's identity init).
Everything else (LM heads shared or own, a reduced draft vocabulary, the file layout) is MedusaHeads';
on disk config.json says model_type "hydra" and W_0 of head k is [H, (k + 2) H].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.heads.medusa import MedusaHeads
from specdec.target.packed import Linear


class HydraHeads(MedusaHeads):
    model_type = "hydra"
    label = "Hydra"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 lm_head: str = "target") -> None:
        super().__init__(hidden_size, vocab_size, num_heads, num_layers, lm_head)
        for k, blk in enumerate(self.blocks):
            blk.layers[0] = nn.Linear((k + 2) * hidden_size, hidden_size)
            with torch.no_grad():
                blk.layers[0].weight.zero_()
                blk.layers[0].bias.zero_()

    def head_hidden(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Head k on its inputs x [..., (k + 2) H] (f first) -> [..., H]."""
        layers = self.blocks[k].layers
        h = x[..., :self.hidden_size] + F.silu(layers[0](x))
        for lin in layers[1:]:
            h = h + F.silu(lin(h))
        return h

    def hidden_of(self, ids: torch.Tensor, features: torch.Tensor, embed: torch.Tensor | None) -> torch.Tensor:
        """ids [B, T], features [B, T, H] -> [K, B, T - 2, H]: row j of head k reads f_j and the embeddings
        of x_{j+1}..x_{j+k+1} (teacher forcing on the data's tokens); rows whose path leaves the sequence
        read zeros and are never labels."""
        if embed is None:
            raise SpecdecError("Hydra heads need the target's input embedding table")
        b, t, h = features.shape
        n = max(t - 2, 0)
        e = F.pad(F.embedding(ids, embed.to(features.dtype)), (0, 0, 0, self.num_heads + 1))
        out = []
        for k in range(self.num_heads):
            x = torch.cat([features[:, :n]] + [e[:, s:s + n] for s in range(1, k + 2)], dim=-1)
            out.append(self.head_hidden(k, x))
        return torch.stack(out)

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        raise SpecdecError("Hydra heads read the path's tokens too: use hidden_of(ids, features, embed)")


class HydraRunner:
    """Inference for HydraHeads: one head on a batch of paths (every node of one tree depth) per call."""

    def __init__(self, heads: HydraHeads, embed: torch.Tensor, target_lm_head: torch.Tensor | Callable | None = None,
                 pack: bool = True, weights: str | None = None) -> None:
        self.num_heads, self.hidden_size, self.vocab_size = heads.num_heads, heads.hidden_size, heads.vocab_size
        self.dtype = heads.blocks[0].layers[0].weight.dtype
        self.layers = [[(lin.weight.detach(), lin.bias.detach()) for lin in blk.layers] for blk in heads.blocks]
        self.embed = embed.detach()
        if heads.lm_heads is not None:
            self.lm = [Linear(lm.weight.detach(), None, pack, weights) for lm in heads.lm_heads]
        elif callable(target_lm_head) and not isinstance(target_lm_head, torch.Tensor):
            if heads.d2t is not None:
                raise SpecdecError("a reduced-vocabulary Hydra head needs the target's LM head weight")
            self.lm = target_lm_head
        elif target_lm_head is not None:
            rows = target_lm_head.detach() if heads.d2t is None else target_lm_head.detach()[heads.d2t]
            self.lm = Linear(rows, None, pack, weights)
        else:
            raise SpecdecError("Hydra heads sharing the target's LM head need its weight")
        self.d2t = None if heads.d2t is None else heads.d2t.detach().clone()

    @torch.inference_mode()
    def step(self, k: int, feature: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        """Head k's logits [R, V'] over the draft vocabulary for R paths: paths [R, k + 1] holds target ids,
        the root first, then the drafts at depths 1..k."""
        r = paths.shape[0]
        f = feature.reshape(1, -1).to(self.dtype).expand(r, -1)
        e = self.embed[paths.reshape(-1)].to(self.dtype).reshape(r, -1)
        x = torch.cat([f, e], dim=-1)
        (w0, b0), *deeper = self.layers[k]
        h = f + F.silu(F.linear(x, w0, b0))
        for w, b in deeper:
            h = h + F.silu(F.linear(h, w, b))
        return self.lm[k](h) if isinstance(self.lm, list) else self.lm(h)

    @torch.inference_mode()
    def logits(self, feature: torch.Tensor, root: int = 0) -> torch.Tensor:
        """[K, V']: every head along the greedy chain from `root` (the draft of a one-path tree)."""
        path, out = [root], []
        for k in range(self.num_heads):
            row = self.step(k, feature, torch.tensor([path]))[0]
            out.append(row)
            path.append(int(self.to_target(row.argmax().reshape(1))[0]))
        return torch.stack(out)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t.to(draft_ids.device)[draft_ids]
