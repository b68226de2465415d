"""Medusa's head loss and accuracies, shared by Medusa-1 (medusa.py: the target frozen) and Medusa-2
(medusa_joint.py: the backbone trained too).

Head k (0-based) on row t reads the feature f_t and learns the target's own distribution for the token at
offset k + 2: p = softmax(LM(f_{t+k+1})) over the draft vocabulary (self-distillation with soft labels,
computed on the fly from the features with the target LM head, no gradient through p; for Hydra heads,
which also read the path's tokens, this is Hydra++'s teacher distillation, KL to the target up to a constant):
    loss = Σ_k λ_k · CE(p, p̂_k),  λ_k = decay^(k+1)  (Medusa's 0.8^k, k counted from 1),
each head's CE averaged over the rows whose label x_{t+k+2} lies in the sequence and is an answer token.
Medusa-1 feeds the stored features; Medusa-2 the features of the backbone being trained (gradients then
reach it through the heads' inputs).

Accuracies, on held-in data (a fixed, seeded slice of the training sequences): acc[k][i] = the share of
answer rows where head k's rank-i token is the target's argmax token there (over the full vocabulary: a
token outside the draft vocabulary matches no rank). They go into the heads' config.json
(specdec.accuracies), from which the `medusa` method builds Medusa's sparse tree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specdec.heads.medusa import MedusaHeads
from specdec.training.shards import ShardData

__all__ = ["MedusaObjective", "head_accuracies", "heads_record", "held_in", "lm_rows"]

RANKS = 10  # top-i accuracies measured per head (the drafter's MAX_RANK)
HELD_IN = 64  # sequences the accuracies are measured on
# one head's logits above this many elements are recomputed in the backward pass instead of kept
# (K heads x batch x length x vocabulary would not fit otherwise; the result is the same)
RECOMPUTE_ABOVE = 1 << 26


# ---- the objective ----

def lm_rows(heads: MedusaHeads, target_lm: torch.Tensor, k: int) -> torch.Tensor:
    """Head k's LM head weight over the draft vocabulary."""
    if heads.lm_heads is not None:
        return heads.lm_heads[k].weight
    return target_lm if heads.d2t is None else target_lm[heads.d2t]


def _head_ce(h, lm, p, top, w):
    """(Σ w · CE(p, softmax(h lm^T)), Σ w · [argmax == top]) over the rows."""
    logp = torch.log_softmax(F.linear(h, lm), dim=-1)
    ce = (-(p * logp).sum(-1) * w).sum()
    hits = ((logp.detach().argmax(-1) == top).float() * w).sum()
    return ce, hits


class MedusaObjective(nn.Module):
    """The heads' loss: everything with gradients runs inside forward, so DDP sees every use of the
    parameters. `head` is the trained module (what a checkpoint holds). `target_lm` is a plain attribute
    (Medusa-2 sets it each step: the new target's LM head, with its gradient under a full fine-tune)."""

    def __init__(self, heads: MedusaHeads, target_lm: torch.Tensor, weights: list[float],
                 embed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.head = heads
        self.target_lm = target_lm  # frozen: a plain attribute, not a parameter or a buffer DDP would broadcast
        self.embed = embed  # the target's input embeddings, for heads that read the path's tokens (Hydra)
        self.weights = weights

    def forward(self, ids, feats, mask, n_global: torch.Tensor):
        """feats [B, T, H], mask [B, T]; n_global [K]: each head's label rows over all processes, divided by
        the process count. Returns the loss and stats [K, 3] (Σ CE, Σ top-1 agreement, rows)."""
        heads, t = self.head, feats.shape[1]
        lm_t = self.target_lm if heads.d2t is None else self.target_lm[heads.d2t]
        # only label rows cost LM-head work (prompts are often half the tokens): row j of the [B, T-2]
        # grid is f_{j+1}, the target's distribution for x_{j+2}, a label iff x_{j+2} is an answer token
        lab = mask[:, 2:].bool()
        where = torch.full(lab.shape, -1, dtype=torch.long, device=feats.device)
        where[lab] = torch.arange(int(lab.sum()), device=feats.device)
        with torch.no_grad():
            p_t = torch.softmax(F.linear(feats[:, 1:t - 1][lab], lm_t), dim=-1)
            top_t = p_t.argmax(-1)
        hid = heads.hidden_of(ids, feats, self.embed)
        loss, stats = 0.0, []
        for k in range(heads.num_heads):
            n = max(t - 2 - k, 0)  # rows t' whose label x_{t'+k+2} is inside the batch
            sel = lab[:, k:k + n]
            rows = where[:, k:k + n][sel]
            ones = torch.ones(rows.shape[0], device=feats.device)
            args = (hid[k][:, :n][sel], lm_rows(heads, self.target_lm, k), p_t[rows], top_t[rows], ones)
            if args[0].shape[0] * args[1].shape[0] > RECOMPUTE_ABOVE:
                ce, hits = checkpoint(_head_ce, *args, use_reentrant=False)
            else:
                ce, hits = _head_ce(*args)
            loss = loss + self.weights[k] * ce / n_global[k]
            stats.append(torch.stack([ce.detach(), hits, ones.sum()]))
        return loss, torch.stack(stats)


def heads_record(weights: list[float], s: torch.Tensor) -> dict:
    """A log line's fields from the heads' summed stats [K, 3] (Σ CE, Σ top-1 agreement, rows)."""
    n = s[:, 2].clamp(min=1.0)
    ce, top1 = (s[:, 0] / n).tolist(), (s[:, 1] / n).tolist()
    return {"loss": sum(w * c for w, c in zip(weights, ce)), "ce_by_head": ce, "top1_acc_by_head": top1}


# ---- accuracies ----

def held_in(n: int, seed: int, size: int = HELD_IN) -> list[int]:
    """The training sequences the accuracies are measured on: `size` of them, chosen by the seed."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 12345)
    return sorted(torch.randperm(n, generator=g)[:size].tolist())


@torch.no_grad()
def head_accuracies(heads: MedusaHeads, data: ShardData, seqs: list[int], target_lm: torch.Tensor,
                    ranks: int = RANKS, batch: int = 4, embed: torch.Tensor | None = None
                    ) -> tuple[list[list[float]], list[int]]:
    """(acc [K][ranks], answer rows per head): acc[k][i] = the share of rows where head k's rank-i token
    is the argmax of the target's full-vocabulary distribution for the same position."""
    k_heads, dev = heads.num_heads, target_lm.device
    hits = torch.zeros(k_heads, ranks, dtype=torch.float64)
    rows = torch.zeros(k_heads, dtype=torch.float64)
    for a in range(0, len(seqs), batch):
        ids, feats, mask = (x.to(dev) for x in data.batch(seqs[a:a + batch]))
        t = feats.shape[1]
        if t < 3:
            continue
        top_t = F.linear(feats[:, 1:t - 1], target_lm).argmax(-1)  # [B, T-2]: x_{s+1} from f_s
        hid = heads.hidden_of(ids, feats, embed)
        for k in range(min(k_heads, t - 2)):
            n = t - 2 - k
            logits = F.linear(hid[k][:, :n], lm_rows(heads, target_lm, k))
            r = min(ranks, logits.shape[-1])
            top = logits.topk(r, dim=-1).indices
            if heads.d2t is not None:
                top = heads.d2t[top]
            w = mask[:, k + 2:].double()
            hits[k, :r] += ((top == top_t[:, k:k + n, None]).double() * w[..., None]).sum((0, 1)).cpu()
            rows[k] += w.sum().cpu()
    acc = hits / rows.clamp(min=1)[:, None]
    return [[round(float(x), 6) for x in row] for row in acc], [int(x) for x in rows]
