"""The EAGLE training objective (see train.py): the head's feature and distribution losses, optionally
over several unrolled draft steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unrolled_mask(t: int, step: int, device=None) -> torch.Tensor:
    """[t, (step + 1) t] bool: what row i of draft step `step` sees when the keys of steps 0..step are
    concatenated. At inference, depth step+1 drafted from an accepted row a sits at row i = a + step and
    sees the target-feature rows <= a plus one row of each earlier draft depth (its own path): so step-0
    keys j <= i - step, and the step-m key at row i - step + m (m = 1..step; m = step is itself)."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    blocks = [j <= i - step] + [j == i - step + m for m in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


class Objective(nn.Module):
    """Everything with gradients runs inside forward, so DDP sees every use of the parameters.

    unroll > 1 also trains on the head's own outputs (EAGLE-3's training-time test, HASS): step k
    feeds row t the step-(k-1) prediction of row t-1 in place of f_t, attending as at draft depth k+1
    (`unrolled_mask`), so the head learns from the inputs it will see beyond the first draft depth."""

    def __init__(self, head, embed: torch.Tensor, target_lm: torch.Tensor, unroll: int = 1) -> None:
        super().__init__()
        self.head = head
        # frozen target tensors as plain attributes: not parameters, and not buffers DDP would broadcast
        self.embed, self.target_lm = embed, target_lm
        self.unroll = unroll

    def forward(self, ids, feats, mask, noise: torch.Tensor | None, n_global: float, ce_weight: float,
                tv_weight: float = 0.0, aux: torch.Tensor | None = None):
        """Returns the loss and stats [unroll, 5] (feature loss, CE, top-1 hits, rows, total variation)
        summed per step. aux [B, T, kH]: the aux layers' states an EAGLE-3 head reads (head.target_input);
        noise is added to what the head reads from the target. A head without a feature loss (EAGLE-3)
        logs 0 for it.

        Why total variation: a draft token drawn from q is accepted at T = 1 with probability
        1 - TV(p, q) (Leviathan et al.), so tv_weight > 0 trains for sampled acceptance directly (DistillSpec);
        CE (forward KL) only bounds it. It is logged either way."""
        tok_in, f_in, f_out = ids[:, 1:], feats[:, :-1], feats[:, 1:]
        a_in = None if aux is None else aux[:, :-1]
        w = mask[:, 1:]  # the head's input token x_{t+1} is an answer token
        if noise is not None and a_in is not None:
            a_in = a_in + noise
        elif noise is not None:
            f_in = f_in + noise
        f_in = self.head.target_input(f_in, a_in)
        emb = F.embedding(tok_in, self.embed)
        lm_t = self.target_lm if self.head.d2t is None else self.target_lm[self.head.d2t]
        # distributions only at the rows a loss weighs (answer tokens, no padding): the LM heads over
        # [B, T, V] were most of a step, and ~half their rows weigh nothing
        rows = w > 0
        with torch.no_grad():
            p_t = torch.softmax(F.linear(f_out[rows], lm_t), dim=-1)
            top_t = p_t.argmax(-1)
        t = tok_in.shape[1]
        loss, stats = 0.0, []
        for k, (pred, pred_lm) in enumerate(unrolled(self.head, emb, f_in, self.unroll)):
            # with PAD the feature loss sees f and the logit loss f̃ (the same tensor otherwise)
            logp = torch.log_softmax(self.head.logits(pred_lm[rows], self.target_lm), dim=-1)
            ce = -(p_t * logp).sum(-1)
            # logged always, in the graph only when trained on: a [N, V] tensor autograd would keep
            with torch.set_grad_enabled(tv_weight > 0 and torch.is_grad_enabled()):
                tv = 0.5 * (p_t - logp.exp()).abs().sum(-1)
            vl = (F.smooth_l1_loss(pred[rows], f_out[rows], reduction="none").mean(-1) if self.head.feature_loss
                  else torch.zeros_like(ce))
            wk = (w if k == 0 else w * (torch.arange(t, device=w.device) >= k))[rows]
            per_row = vl + ce_weight * ce + (tv_weight * tv if tv_weight > 0 else 0.0)
            loss = loss + (per_row * wk).sum() / (n_global * self.unroll)
            with torch.no_grad():
                acc = ((logp.argmax(-1) == top_t).float() * wk).sum()
                stats.append(torch.stack([(vl * wk).sum(), (ce * wk).sum(), acc, wk.sum(), (tv * wk).sum()]))
        return loss, torch.stack(stats)


def unrolled(head, embeds: torch.Tensor, features: torch.Tensor, steps: int):
    """Yields the head's outputs (f̂, the LM head's input), [B, T, H] each, for draft steps 0..steps-1
    (see `unrolled_mask`)."""
    from transformers import DynamicCache

    if steps == 1:
        yield head(embeds, features)
        return
    b, t, _ = embeds.shape
    cache = DynamicCache()
    for k in range(steps):
        mask = unrolled_mask(t, k, embeds.device)[None, None].expand(b, 1, -1, -1)
        pred = head(embeds, features, attention_mask=mask, past_key_values=cache)
        yield pred
        # the next step's row t reads this step's prediction f̂ of row t-1; no gradient through it
        features = F.pad(pred[0].detach()[:, :-1], (0, 0, 1, 0))
