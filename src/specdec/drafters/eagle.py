"""EAGLE (static tree of choices) and EAGLE-2 (dynamic tree) drafting with an EagleHead.

The head's KV cache holds one committed row per target position t < n (n = tokens in the target's
cache), row t built from (x_{t+1}, f_t) with f_t the *target's* feature ("stable KV": after each
verification the accepted rows are recomputed from the target's features and draft rows dropped).
The output of the last committed row is f̂_n, whose logits give the root's children. A tree node at
depth d sits at head position n + d - 1 and reads (its token, the f̂ its parent's row produced).
Children are deterministic top-k, so the tree carries no q: the verifier treats them as point masses
(lossless at T > 0).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from specdec.drafters.base import DecodeContext, Drafter
from specdec.errors import SpecdecError
from specdec.heads.eagle import EagleHead, HeadRunner
from specdec.tree import DraftTree, NodeSlots, StepFn, build_dynamic_tree
from specdec.verify import Verdict

# EAGLE-1 tree for this CPU (DESIGN.md §7: 4-10 nodes): top-3 at depth 1, the likely path deeper
DEFAULT_CHOICES = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))


def build_static_tree(root_logprobs: torch.Tensor, step: StepFn, choices: Sequence[Sequence[int]]) -> DraftTree:
    """EAGLE-1 tree: each choice is a path of top-k ranks from the root ((0, 1) = 2nd best child of the
    best child). One `step` per depth for every node of the previous depth that has children."""
    ordered = _check_choices(choices)
    index: dict[tuple, int] = {(): -1}
    toks: list[int] = []
    pars: list[int] = []
    scores: list[float] = []
    logp: dict[int, torch.Tensor] = {-1: root_logprobs}
    ranked: dict[int, tuple[list[float], list[int]]] = {}
    by_depth: dict[int, list[tuple]] = {}
    for c in ordered:
        by_depth.setdefault(len(c), []).append(c)
    for d in sorted(by_depth):
        layer = by_depth[d]
        parents_here = sorted({index[c[:-1]] for c in layer})
        new = [p for p in parents_here if p not in logp]
        if new:
            out = step(torch.tensor(new), torch.tensor(toks), torch.tensor(pars))
            for r, p in enumerate(new):
                logp[p] = out[r]
        for p in parents_here:
            k = 1 + max(c[-1] for c in layer if index[c[:-1]] == p)
            if k > logp[p].shape[-1]:
                raise SpecdecError(f"tree choice rank {k - 1} exceeds the draft vocabulary")
            v, i = torch.topk(logp[p].float(), k)
            ranked[p] = (v.tolist(), i.tolist())
        for c in layer:
            p = index[c[:-1]]
            v, i = ranked[p]
            index[c] = len(toks)
            toks.append(i[c[-1]])
            pars.append(p)
            scores.append((scores[p] if p >= 0 else 0.0) + v[c[-1]])
    return DraftTree(torch.tensor(toks), torch.tensor(pars), torch.tensor(scores))


def _check_choices(choices: Sequence[Sequence[int]]) -> list[tuple]:
    ordered = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    if not ordered or any(len(c) == 0 or min(c) < 0 for c in ordered):
        raise SpecdecError("tree choices must be non-empty lists of ranks >= 0, e.g. [[0], [1], [0, 0]]")
    have = set(ordered)
    for c in ordered:
        if len(c) > 1 and c[:-1] not in have:
            raise SpecdecError(f"tree choice {list(c)} needs its parent {list(c[:-1])} in the tree too")
    return ordered


class EagleDrafter(Drafter):
    def __init__(self, runner: HeadRunner, dynamic: bool = True, choices: Sequence[Sequence[int]] | None = None,
                 depth: int = 5, topk: int = 4, total_tokens: int = 10, rank_by: str = "value",
                 rerank: bool = True) -> None:
        if depth < 1 or topk < 1 or total_tokens < 1:
            raise SpecdecError("EAGLE-2 depth, topk and total_tokens must be >= 1")
        if rank_by not in ("value", "confidence"):
            raise SpecdecError("rank_by must be 'value' or 'confidence'")
        self.runner, self.dynamic = runner, dynamic
        self.choices = _check_choices(choices if choices is not None else DEFAULT_CHOICES)
        self.depth, self.topk, self.total_tokens = depth, topk, total_tokens
        self.rank_by, self.rerank = rank_by, rerank
        self.name = "eagle2" if dynamic else "eagle"
        self.last_hidden: torch.Tensor | None = None  # f̂_n, output of the last committed row
        self.root_logits: torch.Tensor | None = None

    def _extend(self, tokens: list[int], features: torch.Tensor) -> None:
        h = self.runner.forward(torch.tensor(tokens, device=self.runner.device), features)
        self.runner.commit(range(len(tokens)))
        self.last_hidden = h[-1]
        self.root_logits = self.runner.logits(h[-1:])[0]

    def begin(self, ctx: DecodeContext) -> None:
        self.runner.reset()
        p = ctx.prompt_len
        if ctx.features is None or ctx.features.shape[0] != p:
            raise SpecdecError("EAGLE needs the target's features of the whole prompt")
        self._extend(ctx.tokens[1:p + 1], ctx.features)

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        n = self.runner.length
        self.runner.rollback()  # drop the draft rows
        new = ctx.tokens[n + 1:]
        if len(new) != len(verdict.path) + 1 or ctx.features is None or ctx.features.shape[0] != len(new):
            raise RuntimeError("EAGLE drafter out of step with the engine")
        self._extend(new, ctx.features)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        n = self.runner.length
        if n != len(ctx.tokens) - 1:
            raise RuntimeError("EAGLE drafter out of step with the engine")
        budget = ctx.max_nodes
        temp = ctx.params.temperature or 1.0  # rank children by the distribution the target samples
        slots = NodeSlots()
        hid: dict[int, torch.Tensor] = {}
        depth_of: dict[int, int] = {}
        run = self.runner

        def step(sel: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            sel_l, par = sel.tolist(), parents.tolist()
            for i in range(len(depth_of), len(par)):  # nodes are topological: parents come first
                depth_of[i] = 1 if par[i] < 0 else depth_of[par[i]] + 1
            mask = slots.mask(sel_l, par, n)
            feats = torch.stack([hid[par[i]] if par[i] >= 0 else self.last_hidden for i in sel_l])
            pos = torch.tensor([n - 1 + depth_of[i] for i in sel_l], device=run.device)
            h = run.forward(run.to_target(tokens[sel].to(run.device)), feats, pos, mask)
            for r, i in enumerate(sel_l):
                hid[i] = h[r]
            return torch.log_softmax(run.logits(h).float() / temp, dim=-1)

        root_lp = torch.log_softmax(self.root_logits.float() / temp, dim=-1)
        if self.dynamic:
            tree = build_dynamic_tree(root_lp, step, min(self.depth, budget), self.topk,
                                      min(self.total_tokens, budget), self.rank_by, self.rerank)
        else:
            tree = build_static_tree(root_lp, step, self.choices[:budget])
        run.rollback()
        return DraftTree(run.to_target(tree.tokens.to(run.device)), tree.parents, tree.scores)


def from_target(model, runner, method: str, opts: dict) -> EagleDrafter:
    """The drafter for api.from_models: pops the EAGLE options out of `opts`."""
    head = opts.pop("head", None)
    embed = model.get_input_embeddings().weight
    p = next(model.parameters())
    if head is None:
        from specdec.heads.eagle import find_shipped_head

        head = find_shipped_head(model)
        if head is None:
            raise SpecdecError(f"method {method!r} needs an EAGLE head for this model: pass head=<dir> "
                               "(train one with `specdec datagen` + `specdec train eagle`)")
    head_dir = None if isinstance(head, EagleHead) else head
    if not isinstance(head, EagleHead):
        if not os.path.isdir(head):
            raise SpecdecError(f"EAGLE head {head!r} is not a directory")
        head = EagleHead.load(head, hidden_size=runner.hidden_size, vocab_size=embed.shape[0],
                              device=p.device, dtype=p.dtype, target_lm_head=model.get_output_embeddings().weight)
    elif head.hidden_size != runner.hidden_size or head.vocab_size != embed.shape[0]:
        raise SpecdecError(f"EAGLE head (hidden {head.hidden_size}, vocab {head.vocab_size}) does not match "
                           f"the target (hidden {runner.hidden_size}, vocab {embed.shape[0]})")
    if opts.pop("full_vocab", False) and head.d2t is not None:
        # ablation: the same head over the whole target vocabulary. Only meaningful when its rows are
        # the target's own (trained frozen), so that the reduced head is a pure restriction of this one.
        if head.meta.get("lm_head", "target") != "target":
            raise SpecdecError("full_vocab needs a head whose reduced LM head rows are the target's (lm_head: target)")
        head.lm_head, head.d2t, head.draft_vocab_size = None, None, None
    lm = None
    if head.lm_head is None:
        # reuse the target runner's (pre-packed) LM head rather than holding a second copy
        lm = getattr(runner, "lm_head", None)
        if not callable(lm) or isinstance(lm, torch.nn.Module):
            lm = model.get_output_embeddings().weight
    runner_h = HeadRunner(head, embed, lm)
    kw = {}
    if method == "eagle":
        if "choices" in opts:
            kw["choices"] = opts.pop("choices")
            if isinstance(kw["choices"], str):  # from the CLI: --opt 'choices=[[0],[1],[0,0]]'
                try:
                    kw["choices"] = json.loads(kw["choices"])
                except ValueError:
                    raise SpecdecError(f"choices must be a JSON list of rank paths, got {kw['choices']!r}") from None
        dynamic = False
    else:
        dynamic = True
        for name in ("depth", "topk", "total_tokens", "rank_by", "rerank"):
            if name in opts:
                kw[name] = opts.pop(name)
        if head_dir is not None:  # the budget `specdec tune` chose for this head; explicit options win
            from specdec.tune import load_tuning

            kw = {**(load_tuning(head_dir) or {}), **kw}
    return EagleDrafter(runner_h, dynamic, **kw)
