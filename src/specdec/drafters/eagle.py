"""EAGLE (static tree of choices) and EAGLE-2 (dynamic tree) drafting with an EAGLE head.

The head's KV cache holds one committed row per target position t < n (n = tokens in the target's
cache), row t built from (x_{t+1}, f_t) with f_t the *target's* feature ("stable KV": after each
verification the accepted rows are recomputed from the target's features and draft rows dropped).
The output of the last committed row is f̂_n, whose logits give the root's children. A tree node at
depth d sits at head position n + d - 1 and reads (its token, the f̂ its parent's row produced).
Children are deterministic top-k, so the tree carries no q: the verifier treats them as point masses
(lossless at T > 0). With `children=sample` (T > 0 only) EAGLE-2's children are drawn without
replacement from the draft distribution instead, and each carries the q it was drawn from
(tree.sampled_tree).

An EAGLE-3 head (drafters.eagle3) drafts the same way: a committed row reads runner.target_input (for
EAGLE-3 the target's aux-layer states, fused), a draft row the head's own output.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Generator, Sequence
from dataclasses import astuple
from typing import Annotated, Literal

import torch
from pydantic import Field, field_validator, model_validator

from specdec.drafters.base import DecodeContext, Drafter, Drafting, TreeDrafter, alone
from specdec.drafters.forwards import HeadForward
from specdec.drafters.registry import Method, Options, Target, option, register
from specdec.drafters.union import with_lookup
from specdec.errors import SpecdecError
from specdec.heads.runner import HeadRunner, runner_for
from specdec.heads.shipped import find_shipped_head, shipped_targets
from specdec.runtime.gguf import float_weight
from specdec.sampling import tempered_log_probs
from specdec.tree import (
    DraftTree,
    Growing,
    NodeSlots,
    StepFn,
    TreeBudget,
    check_choices,
    dynamic_tree,
    grow,
    grown,
    sampled_tree,
)
from specdec.tuning import load_tuning
from specdec.verify import Verdict

# EAGLE-1 tree for this CPU (docs/design.md, "CPU costs": 4-10 nodes): top-3 at depth 1, the likely path deeper
DEFAULT_CHOICES = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))


def build_static_tree(root_logprobs: torch.Tensor, step: StepFn, choices: Sequence[Sequence[int]]) -> DraftTree:
    """static_tree with each depth's nodes expanded by `step`."""
    return grown(static_tree(root_logprobs, choices), step)


def static_tree(root_logprobs: torch.Tensor, choices: Sequence[Sequence[int]]) -> Growing:
    """EAGLE-1 tree: each choice is a path of top-k ranks from the root ((0, 1) = 2nd best child of the
    best child). One step per depth for every node of the previous depth that has children."""
    ordered = _choices_or_error(choices)
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
            out = yield new, list(toks), list(pars)
            for r, p in enumerate(new):
                logp[p] = out[r]
        for p in parents_here:
            k = 1 + max(c[-1] for c in layer if index[c[:-1]] == p)
            if k > logp[p].shape[-1]:
                raise SpecdecError(f"choices: rank {k - 1} exceeds the draft vocabulary ({logp[p].shape[-1]} tokens)")
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


def _choices_or_error(choices: Sequence[Sequence[int]]) -> list[tuple]:
    try:
        return check_choices(choices)
    except ValueError as e:
        raise SpecdecError(f"choices {e}") from None


class EagleDrafter(TreeDrafter):
    reads_features = True

    def __init__(self, runner: HeadRunner, budget: TreeBudget | None = None,
                 choices: Sequence[Sequence[int]] | None = None, rank_by: str = "value", rerank: bool = True,
                 children: str = "topk", sampled_budget: TreeBudget | None = None) -> None:
        """budget: EAGLE-2's dynamic tree of that size; None: EAGLE-1's static tree of `choices`.
        children: "topk" (point masses) or "sample" (drawn from the draft at T > 0; EAGLE-2 only).
        sampled_budget: the tree for sampled requests with sampled children (default: budget); why a second
        one: a sampled node's later children are rarely accepted, so T > 0 wants smaller trees than T = 0."""
        if children not in ("topk", "sample") or (children == "sample" and budget is None):
            raise SpecdecError("children must be 'topk', or 'sample' with a dynamic (EAGLE-2) tree")
        self.children = children
        if rank_by not in ("value", "confidence"):
            raise SpecdecError("rank_by must be 'value' or 'confidence'")
        if sampled_budget is not None and children != "sample":
            raise SpecdecError("sampled_budget needs children='sample'")
        self.runner, self.budget, self.sampled_budget = runner, budget, sampled_budget or budget
        self.choices = _choices_or_error(choices if choices is not None else DEFAULT_CHOICES)
        vocab = runner.d2t.numel() if runner.d2t is not None else runner.embed.shape[0]
        if budget is None and (top := max(max(c) for c in self.choices)) >= vocab:
            raise SpecdecError(f"choices: rank {top} exceeds the draft vocabulary ({vocab} tokens)")
        self.rank_by, self.rerank = rank_by, rerank
        self.aux_layers = runner.aux_layers
        self.name = "eagle" if budget is None else "eagle2"
        self.draft_depth = max(map(len, self.choices)) if budget is None else \
            max(budget.depth, self.sampled_budget.depth)
        self.last_hidden: torch.Tensor | None = None  # f̂_n, output of the last committed row (PAD: its f)
        self.root_logits: torch.Tensor | None = None
        self.pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def fork(self) -> EagleDrafter:
        d = copy.copy(self)  # options, tree shapes and the head's weights shared; the head's cache its own
        d.runner = self.runner.fork()
        d.last_hidden = d.root_logits = None
        d.pending = []
        return d

    def _check_rows(self, ctx: DecodeContext, n: int, what: str) -> None:
        if ctx.features is None or ctx.features.shape[0] != n:
            raise SpecdecError(f"EAGLE needs the target's features of {what}")
        if self.aux_layers and (ctx.aux_features is None or ctx.aux_features.shape[0] != n):
            raise SpecdecError(f"EAGLE-3 needs the target's hidden states entering layers {list(self.aux_layers)} "
                               f"of {what}")

    def _extend(self, tokens: list[int], features: torch.Tensor) -> Generator[HeadForward, tuple, None]:
        h, _, logits = yield HeadForward(self.runner, torch.tensor(tokens, device=self.runner.device), features,
                                         logits=slice(-1, None))
        self.runner.commit(range(len(tokens)))
        self.last_hidden = h[-1]
        self.root_logits = logits[0]

    def _fits(self, ctx: DecodeContext) -> bool:
        """A head trained with a shorter window than the target's stops drafting where it ends; the
        engine then takes plain target steps (still exact) instead of failing mid-answer."""
        rows = len(self.choices) if self.budget is None else max(self.budget.tree_size, self.sampled_budget.tree_size)
        return len(ctx.tokens) + rows <= self.runner.max_length

    def begin(self, ctx: DecodeContext) -> None:
        """The prompt's rows are queued like a step's: the head reads them at the first propose(). Why: a
        request `auto` never drafts for (most sampled ones on a small target) skips the head's prefill,
        ~10% of a short request's prefill."""
        self.runner.reset()
        self._check_rows(ctx, ctx.prompt_len, "the whole prompt")
        # target features of emitted rows the head has not read yet (begin, accept -> sync)
        self.pending = [(ctx.features, ctx.aux_features)]

    @property
    def unread_steps(self) -> int:
        """Steps whose rows the head has not read yet, the prompt counted as one more (it is no step's)."""
        return len(self.pending) + (self.runner.length == 0)

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        """Queue the new rows; the head reads them at the next propose(). Why lazy: a caller that skips
        drafting for a while (adaptive `auto`) then pays one head forward for the whole stretch, not one
        per step."""
        self.runner.rollback()  # drop the draft rows
        self._check_rows(ctx, len(verdict.path) + 1, "the root and the accepted nodes")
        self.pending.append((ctx.features, ctx.aux_features))

    def sync(self, ctx: DecodeContext) -> None:
        """Read the queued rows: afterwards the head's cache covers every emitted token but the root."""
        alone(self.syncing(ctx))

    def syncing(self, ctx: DecodeContext) -> Generator[HeadForward, tuple, None]:
        """sync() as a drafting generator (Drafter.drafting)."""
        if not self.pending:
            return
        feats, self.pending = self.pending, []
        if not self._fits(ctx):
            return
        new = ctx.tokens[self.runner.length + 1:]
        f, aux = zip(*feats)
        join = lambda ts: ts[0] if len(ts) == 1 else torch.cat(ts)  # noqa: E731
        feats = self.runner.target_input(join(f), join(aux) if self.aux_layers else None)
        if len(new) != feats.shape[0]:
            raise RuntimeError("EAGLE drafter out of step with the engine")
        yield from self._extend(new, feats)

    def drafting(self, ctx: DecodeContext, budget: TreeBudget | None = None) -> Drafting:
        """budget: this call's tree size instead of the drafter's own (`specdec tune` prices many)."""
        if not self._fits(ctx):
            return DraftTree.empty()
        yield from self.syncing(ctx)
        n = self.runner.length
        if n != len(ctx.tokens) - 1:
            raise RuntimeError("EAGLE drafter out of step with the engine")
        sample = self.children == "sample" and not ctx.params.greedy
        budget = budget or (self.sampled_budget if sample else self.budget)
        # a seeded request: children ranked by log q + the noise of the target's draw at their position
        coupling = None if ctx.params.greedy else ctx.coupling
        at = len(ctx.tokens)  # index of the token the root's children stand for
        slots = NodeSlots()
        hid: dict[int, torch.Tensor] = {}
        depth_of: dict[int, int] = {}
        run = self.runner
        final = budget.depth if budget is not None else max(map(len, self.choices))  # no node deeper is drawn

        def step(sel_l: list[int], tokens: list[int], par: list[int]) -> Generator:
            for i in range(len(depth_of), len(par)):  # nodes are topological: parents come first
                depth_of[i] = 1 if par[i] < 0 else depth_of[par[i]] + 1
            mask = slots.mask(sel_l, par, n)
            feats = torch.stack([hid[par[i]] if par[i] >= 0 else self.last_hidden for i in sel_l])
            pos = torch.tensor([n - 1 + depth_of[i] for i in sel_l], device=run.device)
            # children at the tree's last depth are never expanded: their f̂ is not needed (PAD skips it)
            last = all(depth_of[i] + 1 >= final for i in sel_l)
            h, _, logits = yield HeadForward(run, torch.tensor([tokens[i] for i in sel_l], device=run.device), feats,
                                             pos, mask, draft=True, feature=not last)
            for r, i in enumerate(sel_l):
                hid[i] = None if last else h[r]  # drafting continues with f̂ (with PAD: f, not the logits' f̃)
            lp = tempered_log_probs(logits, ctx.params)
            return lp if coupling is None else coupling.perturb(lp, [at + depth_of[i] for i in sel_l], run.d2t)

        root_lp = tempered_log_probs(self.root_logits, ctx.params)
        if coupling is not None:
            root_lp = coupling.perturb(root_lp[None], [at], run.d2t)[0]
        if budget is not None and sample and coupling is None:
            tree = yield from grow(sampled_tree(root_lp, *astuple(budget.capped(ctx.max_nodes)), ctx.generator), step)
            run.rollback()
            return DraftTree(run.to_target(tree.tokens.to(run.device)), tree.parents, tree.scores,
                             self._target_probs(tree.draft_probs))
        if budget is not None:
            growing = dynamic_tree(root_lp, *astuple(budget.capped(ctx.max_nodes)), self.rank_by, self.rerank,
                                   run.over_draft_ids(ctx.allowed))
        else:
            growing = static_tree(root_lp, self.choices[:ctx.max_nodes])
        tree = yield from grow(growing, step)
        run.rollback()
        return DraftTree(run.to_target(tree.tokens.to(run.device)), tree.parents, tree.scores)


    def _target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """q over the draft vocabulary -> over the target's (zero outside the draft vocabulary)."""
        d2t = self.runner.d2t
        if d2t is None:
            return q
        full = torch.zeros(q.shape[0], self.runner.embed.shape[0], dtype=q.dtype, device=q.device)
        return full.index_copy_(1, d2t.to(q.device), q)


# ---- registration ----

class HeadOptions(Options):
    head: str | None = option(None, "EAGLE head dir (default: the one shipped for this target)", shown="shipped",
                              metavar="PATH")
    full_vocab: bool = option(False, "ablation: a reduced-vocabulary head over the whole target vocabulary")
    lookup: int | None = option(None, "also verify a prompt-lookup chain of this many tokens in every tree "
                                "(default: none; auto: tuned)", ge=0, shown="0; auto: tuned")


class EagleOptions(HeadOptions):
    choices: list[list[Annotated[int, Field(ge=0)]]] | None = option(
        None, "the static tree: top-k rank paths, e.g. [[0],[1],[0,0]]", shown="9 nodes, depth 4")

    @field_validator("choices")
    @classmethod
    def _a_tree(cls, v: list | None) -> list | None:
        return v if v is None else [list(c) for c in check_choices(v)]


class Eagle2Options(HeadOptions):
    depth: int | None = option(None, "draft steps (default: `specdec tune`'s choice, else 5)", ge=1,
                               aliases=("gamma",), shown="tuned, else 5")
    topk: int | None = option(None, "children per expanded node (default: tuned, else 4)", ge=1,
                              shown="tuned, else 4")
    tree_size: int | None = option(None, "nodes kept after reranking (default: tuned, else 10)", ge=1,
                                   aliases=("tree_tokens", "total_tokens"), shown="tuned, else 10")
    rank_by: Literal["value", "confidence"] = option("value", "expand by path value or by own confidence (ablation)")
    rerank: bool = option(True, "keep the top tree_size nodes by value (false: ablation)")
    children: Literal["topk", "sample"] | None = option(
        None, "at T > 0: top-k children (point masses), or children drawn without replacement from the draft "
              "distribution (SpecInfer-style; the first tree_size nodes of the expansion, no value reranking); "
              "default: sample, the faster at T = 1 (docs/benchmarks.md), topk when a lookup chain shares the tree",
        shown="sample; topk with lookup")

    @model_validator(mode="after")
    def _sampled_alone(self):
        if self.children == "sample" and self.lookup:
            raise ValueError("children=sample cannot share its tree with a lookup chain (lookup must be 0): "
                             "a merged tree holds point masses only")
        return self


DEFAULT_BUDGET = TreeBudget(5, 4, 10)


def with_shipped_head(target: Target, opts, kind: str, method: str, what: str):
    """opts with head= the head of this kind shipped for the loaded target when none was given; else one
    line naming the shipped ones."""
    if opts.head is not None:
        return opts
    head = find_shipped_head(target.model, kind)
    if head is None:
        raise SpecdecError(f"method {method!r} needs {what} for this model: none ships for it (shipped: "
                           f"{', '.join(shipped_targets(kind))}); pass head=<dir>")
    return opts.model_copy(update={"head": str(head)})


def head_runner(target: Target, opts: HeadOptions, method: str) -> tuple[HeadRunner, str | None]:
    """The head for this target (the given dir, or the shipped one) on a runner; and its dir."""
    model, runner = target.model, target.runner
    head_dir = opts.head or (find_shipped_head(model, "eagle3") if method == "auto" else None) \
        or find_shipped_head(model)
    if head_dir is None:
        raise SpecdecError(f"method {method!r} needs an EAGLE head for this model: pass head=<dir> "
                           "(train one with `specdec datagen` + `specdec train eagle`)")
    if not os.path.isdir(head_dir):
        raise SpecdecError(f"EAGLE head {str(head_dir)!r} is not a directory")
    from specdec.heads.io import load_head  # transformers' Llama modules take seconds to import: only when used

    embed = model.get_input_embeddings().weight
    p = next(model.parameters())
    target_lm = float_weight(model.get_output_embeddings().weight)  # a GGUF file's: its rows in fp32
    head = load_head(head_dir, hidden_size=runner.hidden_size, vocab_size=embed.shape[0], device=p.device,
                     dtype=p.dtype, target_lm_head=target_lm, target_layers=runner.n_layers)
    if method != "auto" and (head.kind == "eagle3") != (method == "eagle3"):
        use = "eagle3 or auto" if head.kind == "eagle3" else "eagle, eagle2 or auto"
        raise SpecdecError(f"method {method!r}: {head_dir} is an {'EAGLE-3' if head.kind == 'eagle3' else 'EAGLE-1/2'} "
                           f"head: run it with {use}")
    runner.check_aux_layers(head.aux_layers, f"EAGLE-3 head {head_dir}")
    if opts.full_vocab and head.d2t is not None:
        # ablation: the same head over the whole target vocabulary. Only meaningful when its rows are
        # the target's own (trained frozen), so that the reduced head is a pure restriction of this one.
        if head.meta.get("lm_head", "target") != "target":
            raise SpecdecError("full_vocab needs a head whose reduced LM head rows are the target's (lm_head: target)")
        head.lm_head, head.d2t, head.draft_vocab_size = None, None, None
    lm, weights = None, runner.head_weights(head)
    if head.lm_head is None:
        # the target runner's LM head when it can share it; else its rows, at the head's precision (a
        # GGUF file's: its quantized blocks, on their kernel)
        lm = runner.shared_lm_head(weights)
        if lm is None:
            lm = model.get_output_embeddings().weight
    return runner_for(head, embed, lm, weights=weights), str(head_dir)


def tuned_budget(opts: Eagle2Options, head_dir: str | None, tuned: dict | None = None,
                 sampled: bool = False) -> TreeBudget:
    """Explicit options win, then the head's tuning.json (`specdec tune`), then DEFAULT_BUDGET.
    sampled: the tree for sampled requests with sampled children (tune's `sampled` choice, else the above)."""
    if tuned is None:
        tuned = (sampled and load_tuning(head_dir, sampled=True)) or load_tuning(head_dir) or {}
    pick = lambda k: next(v for v in (getattr(opts, k), tuned.get(k), getattr(DEFAULT_BUDGET, k)) if v is not None)
    return TreeBudget(pick("depth"), pick("topk"), pick("tree_size"))


def children(opts: Eagle2Options) -> str:
    """Sampled children unless asked otherwise or a lookup chain shares the tree (a merged tree holds point
    masses only). At T = 0 both are the same top-k tree."""
    return opts.children or ("topk" if opts.lookup else "sample")


def eagle2_drafter(runner: HeadRunner, opts: Eagle2Options, head_dir: str | None) -> EagleDrafter:
    kids = children(opts)
    sampled = tuned_budget(opts, head_dir, sampled=True) if kids == "sample" else None
    return EagleDrafter(runner, tuned_budget(opts, head_dir), rank_by=opts.rank_by, rerank=opts.rerank,
                        children=kids, sampled_budget=sampled)


def build_eagle(target: Target, opts: EagleOptions) -> Drafter:
    runner, _ = head_runner(target, opts, "eagle")
    return with_lookup(EagleDrafter(runner, choices=opts.choices), opts.lookup or 0)


def build_eagle2(target: Target, opts: Eagle2Options) -> Drafter:
    runner, head_dir = head_runner(target, opts, "eagle2")
    drafter = eagle2_drafter(runner, opts, head_dir)
    return with_lookup(drafter, opts.lookup or 0)


register(Method("eagle", "EAGLE-1 head (feature-level draft), static tree of top-k rank paths", EagleOptions,
                build_eagle))
register(Method("eagle2", "EAGLE-2: the same head, dynamic tree (expand by value, rerank to the top tree_size)",
                Eagle2Options, build_eagle2))

