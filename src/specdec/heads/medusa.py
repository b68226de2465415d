"""Medusa heads (Cai et al., 2024): K parallel heads on the target's last feature f_t (after the final norm).

Head k (0-based) predicts the token at offset k + 2 from t (the target's own LM head predicts t + 1):
    h = f;  h = h + SiLU(W_l h + b_l)  for each of its L residual blocks;  logits = LM_k(h).
LM heads: the frozen target head shared by all heads (`lm_head="target"`, no tensors of its own) or one
per head initialised from the target's rows (`"own"`); either over the full vocabulary or over a
reduced draft vocabulary of V_d frequent tokens (d2t maps draft ids to target ids).

The module serves training; MedusaRunner is the lean inference path: every head's first block in one
stacked linear (they all read the same f), deeper blocks as one batched matmul, one LM head call.
Tensor names follow vLLM's Medusa layout: blocks.{k}.layers.{l}.{weight,bias}, lm_heads.{k}.weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.runtime.packed import Linear

LM_HEADS = ("target", "own")


class _Block(nn.Module):
    def __init__(self, hidden_size: int, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(n_layers))


class MedusaHeads(nn.Module):
    model_type = "medusa"  # config.json's model_type (HydraHeads: "hydra")
    label = "Medusa"  # in messages

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 lm_head: str = "target") -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise SpecdecError(f"Medusa needs num_heads >= 1 and num_layers >= 1, got {num_heads}, {num_layers}")
        if lm_head not in LM_HEADS:
            raise SpecdecError(f"lm_head must be one of {', '.join(LM_HEADS)}, got {lm_head!r}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.lm_head_kind = num_heads, num_layers, lm_head
        self.blocks = nn.ModuleList(_Block(hidden_size, num_layers) for _ in range(num_heads))
        with torch.no_grad():  # Medusa's init: every block starts as the identity, so head k begins as the target
            for blk in self.blocks:
                for lin in blk.layers:
                    lin.weight.zero_()
                    lin.bias.zero_()
        self.lm_heads: nn.ModuleList | None = None
        self.register_buffer("d2t", None)
        self.meta: dict = {}  # the "specdec" block of config.json (training recipe, target, accuracies)

    def config_extra(self) -> dict:
        """Fields of config.json beyond Medusa's (HydraHeads: its prefix layer's sizes)."""
        return {}

    @classmethod
    def config_kwargs(cls, raw: dict, path) -> dict:
        """Constructor arguments read from config.json beyond Medusa's (checked: SpecdecError naming path)."""
        return {}

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size if self.d2t is None else self.d2t.numel()

    @torch.no_grad()
    def init_lm_heads(self, target_lm_head: torch.Tensor, draft_ids: torch.Tensor | None = None) -> None:
        """Fix the vocabulary (all of it, or the target ids `draft_ids`) and, for lm_head="own", copy the
        target's rows into each head's LM head."""
        if tuple(target_lm_head.shape) != (self.vocab_size, self.hidden_size):
            raise SpecdecError(f"the target's LM head is {tuple(target_lm_head.shape)}, Medusa expects "
                               f"{(self.vocab_size, self.hidden_size)}")
        if draft_ids is not None:
            ids = torch.as_tensor(draft_ids, dtype=torch.long).unique(sorted=True)
            if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                raise SpecdecError(f"draft vocabulary ids must lie in [0, {self.vocab_size})")
            self.d2t = ids.to(target_lm_head.device)
        rows = target_lm_head if self.d2t is None else target_lm_head[self.d2t]
        if self.lm_head_kind == "own":
            self.lm_heads = nn.ModuleList(nn.Linear(self.hidden_size, rows.shape[0], bias=False)
                                          for _ in range(self.num_heads)).to(rows.device, rows.dtype)
            for lm in self.lm_heads:
                lm.weight.copy_(rows)

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [K, ..., H]: each head's input to its LM head."""
        out = []
        for blk in self.blocks:
            h = features
            for lin in blk.layers:
                h = h + F.silu(lin(h))
            out.append(h)
        return torch.stack(out)

    def hidden_of(self, ids: torch.Tensor, features: torch.Tensor, embed: torch.Tensor | None) -> torch.Tensor:
        """Training rows: ids [B, T], features [B, T, H] -> [K, B, T - 2, H], row j from f_j (the row whose
        labels are x_{j+2}.. for heads 0..). Medusa's heads read only f; `ids` and the target's input
        embedding table `embed` are for heads that read the path's tokens too (HydraHeads)."""
        return self.hidden(features[:, :max(features.shape[1] - 2, 0)])

    def logits(self, features: torch.Tensor, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """[..., H] -> [K, ..., V'] over the draft vocabulary (the full one unless reduced)."""
        h = self.hidden(features)
        if self.lm_heads is not None:
            return torch.stack([lm(h[k]) for k, lm in enumerate(self.lm_heads)])
        if target_lm_head is None:
            raise ValueError("Medusa heads sharing the target's LM head need its weight")
        rows = target_lm_head if self.d2t is None else target_lm_head[self.d2t]
        return F.linear(h, rows)

    forward = logits


class MedusaRunner:
    """Inference for MedusaHeads: logits of all K heads for one feature in a few packed calls."""

    def __init__(self, heads: MedusaHeads, target_lm_head: torch.Tensor | Callable | None = None,
                 pack: bool = True, weights: str | None = None) -> None:
        k, h = heads.num_heads, heads.hidden_size
        first = [blk.layers[0] for blk in heads.blocks]
        self.first = Linear(torch.cat([lin.weight for lin in first]).detach(),
                            torch.cat([lin.bias for lin in first]).detach(), pack, weights)
        # deeper blocks, [K, H_in, H_out] for one baddbmm each (tiny: K x H x H)
        self.deeper = [(torch.stack([blk.layers[i].weight.detach().t() for blk in heads.blocks]),
                        torch.stack([blk.layers[i].bias.detach() for blk in heads.blocks])[:, None])
                       for i in range(1, heads.num_layers)]
        if heads.lm_heads is not None:
            self.lm = [Linear(lm.weight.detach(), None, pack, weights) for lm in heads.lm_heads]
        elif callable(target_lm_head) and not isinstance(target_lm_head, torch.Tensor):
            if heads.d2t is not None:
                raise SpecdecError("a reduced-vocabulary Medusa head needs the target's LM head weight")
            self.lm = target_lm_head
        elif target_lm_head is not None:
            rows = target_lm_head.detach() if heads.d2t is None else target_lm_head.detach()[heads.d2t]
            self.lm = Linear(rows, None, pack, weights)
        else:
            raise SpecdecError("Medusa heads sharing the target's LM head need its weight")
        self.num_heads, self.hidden_size, self.vocab_size = k, h, heads.vocab_size  # vocab: the target's
        self.d2t = None if heads.d2t is None else heads.d2t.detach().clone()
        self.dtype = heads.blocks[0].layers[0].weight.dtype

    @torch.inference_mode()
    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """feature [H] (f_t) -> [K, V'] logits over the draft vocabulary; map ids with to_target."""
        f = feature.reshape(1, -1).to(self.dtype)
        x = f + F.silu(self.first(f).reshape(self.num_heads, -1))
        for w, b in self.deeper:
            x = x + F.silu(torch.baddbmm(b, x[:, None], w)[:, 0])
        if isinstance(self.lm, list):
            return torch.cat([lm(x[i:i + 1]) for i, lm in enumerate(self.lm)])
        return self.lm(x)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t.to(draft_ids.device)[draft_ids]
