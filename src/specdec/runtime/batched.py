"""Batched generation on the lean Llama-family weights, for making training data (not for serving).

Why: datagen is throughput-bound. One sequence at a time runs at ~40 tok/s here, and HF `generate`
on a padded batch pays its per-op overhead and MKL's small-batch GEMMs (docs/design.md, "CPU costs"). A batch of
B rows turns every linear into one [B, H] GEMM on pre-packed weights, and the features of every token
fall out of the same forwards (the token fed at a step yields its own feature), so no second,
teacher-forced pass is needed.

Layout: prompts are left-padded to a common width W, so all rows write the same cache column at each
step; row r's position at column j is j - pad[r], and its mask hides columns < pad[r].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.runtime.gguf import QuantTensor
from specdec.runtime.kv import KVCache
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams, probs_from_logits


@torch.inference_mode()
def batch_generate(
    runner: LeanRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams,
    eos_ids: set[int],
    generator: torch.Generator | None = None,
    with_features: bool = True,
    aux_layers: tuple[int, ...] = (),
) -> tuple[list[list[int]], list[torch.Tensor | None]]:
    """Returns each prompt's answer (cut after its first EOS, which is kept) and, if asked, the features
    [len(prompt) + len(answer), H * (1 + len(aux_layers))] (fp32, on the CPU) of prompt + answer: the
    final-norm feature, then the hidden state entering each layer of `aux_layers` (EAGLE-3's inputs)."""
    if not runner.batchable:
        raise ValueError("batch_generate implements the Llama layer without sliding-window attention only")
    dev = runner.device
    b = len(prompts)
    width = max(len(p) for p in prompts)
    cols = width + max_new_tokens
    runner.rope.grow(cols)
    pad = torch.tensor([width - len(p) for p in prompts], device=dev)
    ids = torch.zeros(b, width, dtype=torch.long, device=dev)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, device=dev)
    kv = KVCache(len(runner.layers), runner.n_kv, runner.head_dim, cols, dev, runner.dtype, cols, b)
    col = torch.arange(cols, device=dev)

    def forward(x_ids: torch.Tensor, start: int) -> torch.Tensor:
        """x_ids [R, n] at columns start..start+n of every cache row -> features [R, n, H]."""
        n = x_ids.shape[1]
        end = start + n
        pos = (col[start:end][None] - pad[:, None]).clamp(min=0)  # [R, n]
        cos, sin = runner.rope(pos)  # [R, n, hd]
        q_col = col[start:end][None, :, None]
        vis = (col[:end][None, None] >= pad[:, None, None]) & (col[:end][None, None] <= q_col)
        vis = vis | (col[:end][None, None] == q_col)  # pad queries see themselves (no all-masked rows)
        mask = vis[:, None]  # [R, 1, n, end]
        h = runner.embed.rows(x_ids.reshape(-1)).view(*x_ids.shape, -1) if isinstance(runner.embed, QuantTensor) \
            else F.embedding(x_ids, runner.embed)
        aux = []
        for i, layer in enumerate(runner.layers):
            if i in aux_layers:
                aux.append(h)
            h = layer(h, cos, sin, kv, start, mask)
        f = F.rms_norm(h, (runner.hidden_size,), runner.norm, runner.eps)
        return torch.cat([f, *aux], -1) if aux else f

    def pick(feats: torch.Tensor) -> torch.Tensor:
        probs = probs_from_logits(runner.lm_head(feats[..., :runner.hidden_size]), params)
        if params.greedy:
            return probs.argmax(-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    f = forward(ids, 0)
    feats: list[list[torch.Tensor]] = [[f[r, width - len(p):].cpu()] if with_features else []
                                       for r, p in enumerate(prompts)]
    cur = pick(f[:, -1])
    answers: list[list[int]] = [[] for _ in range(b)]
    orig = torch.arange(b, device=dev)  # cache row -> prompt index
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    eos = torch.tensor(sorted(eos_ids), device=dev, dtype=torch.long)
    for s in range(max_new_tokens):
        # finished rows still ride along (their output is ignored) until compaction drops them
        live = (~done).nonzero()[:, 0].tolist()
        o, c = orig.tolist(), cur.tolist()
        for i in live:
            answers[o[i]].append(c[i])
        f = forward(cur[:, None], width + s)[:, 0]  # each fed token's own feature
        if with_features:
            fc = f.cpu()
            for i in live:
                feats[o[i]].append(fc[i:i + 1])
        done |= torch.isin(cur, eos)
        if bool(done.all()) or s == max_new_tokens - 1:
            break
        cur = pick(f)
        n_live = int((~done).sum())
        if n_live <= done.numel() // 2:  # fewer rows: less attention over the cache, smaller GEMMs
            keep = (~done).nonzero()[:, 0]
            kv.select(keep)
            pad, orig, cur, done = pad[keep], orig[keep], cur[keep], done[keep]
    return answers, [torch.cat(x) if with_features else None for x in feats]
