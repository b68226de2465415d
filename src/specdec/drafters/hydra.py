"""Hydra drafting (Ankner et al., 2024): Medusa's sparse tree, with heads that read the path.

The tree is Medusa's (rank paths from the heads' measured accuracies, sized by this machine's costs,
drafters/medusa.py), but a node's children depend on its path: head d runs on [f, E[root], E[d_1..d_d]]
of each parent at depth d, every parent of one depth in one call. Children are a parent's top-k ranks
(point masses) or, at T > 0 with children=sample, drawn without replacement from that parent's own
distribution with the q they were drawn from. Which nodes exist is fixed by the rank paths before
anything is drawn, so the verifier's rejection stays lossless.
"""

from __future__ import annotations

import os

import torch

from specdec.drafters.base import DecodeContext, Drafter
from specdec.drafters.medusa import MedusaDrafter, MedusaOptions, heads_drafter
from specdec.drafters.registry import Method, Target, option, register
from specdec.errors import SpecdecError
from specdec.heads.hydra import HydraHeads, HydraRunner
from specdec.heads.medusa_io import load_medusa
from specdec.runtime.gguf import float_weight
from specdec.sampling import tempered_log_probs
from specdec.tree import DraftTree, draw_children
from specdec.verify import Typical


class HydraDrafter(MedusaDrafter):
    name = "hydra"

    def __init__(self, runner: HydraRunner, choices, typical: Typical | None = None, children: str = "topk") -> None:
        super().__init__(runner, choices, typical, children)

    def fork(self) -> HydraDrafter:
        d = super().fork()
        d.runner = self.runner.fork()  # a prefix layer's cache is per sequence
        return d

    def begin(self, ctx: DecodeContext) -> None:
        if ctx.features is None or ctx.features.shape[0] < 1:
            raise SpecdecError("Hydra needs the target's features of the prompt")
        self.feature = self.runner.begin(ctx.features)

    def accept(self, ctx: DecodeContext, verdict) -> None:
        self.feature = self.runner.extend(ctx.features)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        if self.feature is None:
            raise RuntimeError("Hydra drafter used before begin()")
        choices = self.choices[:ctx.max_nodes]
        sample = self.children == "sample" and not ctx.params.greedy
        kids: dict[tuple, list[int]] = {}
        for c in choices:
            kids.setdefault(c[:-1], []).append(c[-1])
        index: dict[tuple, int] = {(): -1}
        path: dict[tuple, list[int]] = {(): [ctx.tokens[-1]]}  # target ids from the root down
        toks, pars, scores, qs = [], [], [], []
        for d in range(max(map(len, choices))):
            parents = [p for p in kids if len(p) == d and p in index]  # tree order: the nodes' order
            if not parents:
                break
            lp = tempered_log_probs(self.runner.step(d, self.feature, torch.tensor([path[p] for p in parents])),
                                    ctx.params)  # [R, V'] over the draft vocabulary
            if sample:
                v, tok, q, ok = draw_children(lp, max(len(kids[p]) for p in parents), ctx.generator)
            else:
                ranked = torch.topk(lp, min(self.top[d], lp.shape[-1]))
                v, tok = ranked.values, ranked.indices
            tok_t = self.runner.to_target(tok).tolist()
            v, tok = v.tolist(), tok.tolist()
            row = {p: r for r, p in enumerate(parents)}
            for c in choices:
                if len(c) != d + 1 or c[:-1] not in row:
                    continue
                r = row[c[:-1]]
                # sampled: siblings take the first draws in rank order (recursive rejection needs them in order)
                j = sorted(kids[c[:-1]]).index(c[-1]) if sample else c[-1]
                if j >= len(tok[r]) or sample and not ok[r, j]:
                    continue  # past the head's support: the node and its subtree are dropped
                p = index[c[:-1]]
                index[c] = len(toks)
                path[c] = path[c[:-1]] + [tok_t[r][j]]
                toks.append(tok_t[r][j])
                pars.append(p)
                scores.append((scores[p] if p >= 0 else 0.0) + v[r][j])
                if sample:
                    qs.append(q[r, j])
        if not toks:
            return DraftTree.empty()
        if not sample:
            return DraftTree(torch.tensor(toks), torch.tensor(pars), torch.tensor(scores))
        q = torch.stack(qs)
        d2t = self.runner.d2t
        if d2t is not None:  # q over the draft vocabulary -> over the target's (zero elsewhere)
            q = torch.zeros(q.shape[0], self.runner.vocab_size, dtype=q.dtype).index_copy_(1, d2t.to(q.device), q)
        return DraftTree(torch.tensor(toks), torch.tensor(pars), torch.tensor(scores), q)


# ---- registration ----

class HydraOptions(MedusaOptions):
    heads: str | None = option(None, "Hydra heads dir (`specdec train medusa --arch hydra`; default: Hydra heads "
                               "shipped for this target, if any)", aliases=("head",), shown="shipped", metavar="PATH")


def hydra_runner(target: Target, heads_dir: str) -> tuple[HydraRunner, dict]:
    if not os.path.isdir(heads_dir):
        raise SpecdecError(f"Hydra heads {heads_dir!r} is not a directory")
    model, runner = target.model, target.runner
    p = next(model.parameters())
    lm = float_weight(model.get_output_embeddings().weight)
    heads = load_medusa(heads_dir, runner.hidden_size, lm.shape[0], lm, p.device, p.dtype, cls=HydraHeads)
    embed = float_weight(model.get_input_embeddings().weight)
    weights = runner.head_weights(heads)
    shared = runner.shared_lm_head(weights) if heads.lm_heads is None and heads.d2t is None else None
    return HydraRunner(heads, embed, lm if shared is None else shared, weights=weights), heads.meta


def build_hydra(target: Target, opts: HydraOptions) -> Drafter:
    return heads_drafter(target, opts, "hydra", hydra_runner, HydraDrafter,
                         "train them with `specdec train medusa --arch hydra`")


register(Method("hydra", "Hydra: Medusa's sparse tree from sequentially-dependent heads (each reads the "
                "target's feature and the embeddings of its path's tokens; `typical=true`: lossy)",
                HydraOptions, build_hydra))
