"""Medusa-1/2 drafting (Cai et al., 2024): K parallel heads on the target's last feature, one tiny forward
per step, their top-k combined into a tree.

The root is the token the verifier just emitted from the target's feature f of the last committed row;
head k (0-based) on that same f predicts the token at depth k + 1 below the root. A tree is a list of
rank paths (Medusa's `medusa_choices`): (0, 2) = head 0's best token, then head 1's third best. Siblings
at one depth are distinct top-k ranks of one head, so their tokens differ; children are deterministic
(point masses), so the verifier stays lossless at T > 0.

The sparse tree (the paper's): from each head's measured top-i accuracy a[k][i] (held-in data, written
by `specdec train medusa`), a node's expected acceptance is the product of a[k][i_k] along its path;
nodes are added greedily, best first, until the node budget. The budget maximises expected tokens per
second under t(N) measured on this machine (cached like `auto`'s costs). Typical acceptance (lossy,
opt-in) lives in verify.py with the other acceptance rules.
"""

from __future__ import annotations

import copy
import heapq
import os
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import torch
from pydantic import Field, field_validator, model_validator

from specdec.drafters.base import DecodeContext, Drafter
from specdec.drafters.costs import Costs
from specdec.drafters.registry import Method, Options, Target, option, register
from specdec.errors import SpecdecError
from specdec.heads.medusa import MedusaRunner
from specdec.heads.medusa_formats import import_medusa
from specdec.heads.shipped import find_shipped_head
from specdec.machine import cached, forward_costs, machine_key
from specdec.runtime.gguf import float_weight
from specdec.sampling import tempered_log_probs
from specdec.tree import DraftTree, check_choices, draw_children
from specdec.verify import Typical

MAX_RANK = 10  # top-i accuracies measured per head (Medusa's trees use ranks < 10)
SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # tree sizes the budget is chosen from
ROWS = (1, 2, 3, 5, 9, 17, 33, 65)  # forward sizes timed for them (1 + nodes); the others interpolated


def sparse_choices(accuracies: Sequence[Sequence[float]], n_nodes: int) -> list[tuple[int, ...]]:
    """Medusa's sparse tree: the n_nodes rank paths of highest expected acceptance, prod_k a[k][i_k]
    along the path. A child's value never exceeds its parent's, so best-first order is a valid tree."""
    acc = [[max(0.0, float(a)) for a in row] for row in accuracies]
    heap = [(-a, (i,)) for i, a in enumerate(acc[0])]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < n_nodes:
        v, path = heapq.heappop(heap)
        out.append(path)
        d = len(path)
        if d < len(acc):
            for i, a in enumerate(acc[d]):
                heapq.heappush(heap, (v * a, path + (i,)))
    return out


def expected_accepted(accuracies: Sequence[Sequence[float]], choices: Sequence[Sequence[int]]) -> float:
    """Expected accepted draft tokens of a tree under Medusa's independence model: the sum over nodes of
    the probability that its whole path is accepted."""
    total = 0.0
    for c in choices:
        p = 1.0
        for d, i in enumerate(c):
            p *= accuracies[d][i] if i < len(accuracies[d]) else 0.0
        total += p
    return total


def dense_choices(num_heads: int, topk: int, n_nodes: int) -> list[tuple[int, ...]]:
    """The dense tree the paper compares against: every path of ranks < topk, level by level, cut at n_nodes."""
    out, level = [], [()]
    for _ in range(num_heads):
        level = [p + (i,) for p in level for i in range(topk)]
        out += level
        if len(out) >= n_nodes:
            break
    return out[:n_nodes]


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, runner: MedusaRunner, choices: Sequence[Sequence[int]], typical: Typical | None = None,
                 children: str = "topk") -> None:
        if children not in ("topk", "sample") or (children == "sample" and typical is not None):
            raise SpecdecError("children must be 'topk', or 'sample' without typical acceptance")
        self.runner, self.children = runner, children
        self.choices = _ordered(choices, runner.num_heads)
        self.top = [1 + max((c[d] for c in self.choices if len(c) > d), default=-1) for d in range(runner.num_heads)]
        self.draft_depth = max(map(len, self.choices))
        self.acceptance = typical
        self.feature: torch.Tensor | None = None

    def fork(self) -> MedusaDrafter:
        d = copy.copy(self)  # the heads hold no per-sequence state: only the feature is the fork's own
        d.feature = None
        return d

    def begin(self, ctx: DecodeContext) -> None:
        if ctx.features is None or ctx.features.shape[0] < 1:
            raise SpecdecError("Medusa needs the target's features of the prompt")
        self.feature = ctx.features[-1]

    def accept(self, ctx: DecodeContext, verdict) -> None:
        self.feature = ctx.features[-1]  # the row whose distribution gave the new root

    def propose(self, ctx: DecodeContext) -> DraftTree:
        if self.feature is None:
            raise RuntimeError("Medusa drafter used before begin()")
        choices = self.choices[:ctx.max_nodes]
        lp = tempered_log_probs(self.runner.logits(self.feature), ctx.params)  # [K, V']
        if self.children == "sample" and not ctx.params.greedy:
            return self._sampled(choices, lp, ctx.generator)
        depth = max(map(len, choices))
        ranked = [torch.topk(lp[d], self.top[d]) for d in range(depth)]
        vals = [r.values.tolist() for r in ranked]
        ids = [self.runner.to_target(r.indices).tolist() for r in ranked]
        index: dict[tuple, int] = {(): -1}
        toks, pars, scores = [], [], []
        for c in choices:
            d, i = len(c) - 1, c[-1]
            p = index[c[:-1]]
            index[c] = len(toks)
            toks.append(ids[d][i])
            pars.append(p)
            scores.append((scores[p] if p >= 0 else 0.0) + vals[d][i])
        return DraftTree(torch.tensor(toks), torch.tensor(pars), torch.tensor(scores))

    def _sampled(self, choices: list[tuple[int, ...]], lp: torch.Tensor, generator) -> DraftTree:
        """The same tree shape, each node's children drawn without replacement from its depth's head, with
        the q each was drawn from (the verifier's recursive rejection, as EAGLE-2's sampled children). A
        Medusa head ignores the path, so every parent at one depth draws afresh from the same distribution.
        Siblings are the first draws in rank order (ranks {0, 2} take draws 0 and 1: recursive rejection
        needs consecutive draws), and a node past its head's support is dropped with its subtree. Whether
        a node exists is settled before anything is drawn: lossless."""
        kids: dict[tuple, list[int]] = {}
        for c in choices:
            kids.setdefault(c[:-1], []).append(c[-1])
        index: dict[tuple, int] = {(): -1}
        draws: dict[tuple, tuple] = {}
        toks, pars, scores, qs = [], [], [], []
        for c in choices:
            parent = c[:-1]
            if parent not in index:
                continue  # its parent was past the support
            if parent not in draws:
                draws[parent] = draw_children(lp[len(parent)][None], len(kids[parent]), generator)
            v, tok, q, ok = draws[parent]
            j = sorted(kids[parent]).index(c[-1])
            if not ok[0, j]:
                continue
            p = index[parent]
            index[c] = len(toks)
            toks.append(int(tok[0, j]))
            pars.append(p)
            scores.append((scores[p] if p >= 0 else 0.0) + float(v[0, j]))
            qs.append(q[0, j])
        if not toks:
            return DraftTree.empty()
        q = torch.stack(qs)
        d2t = self.runner.d2t
        if d2t is not None:  # q over the draft vocabulary -> over the target's (zero elsewhere)
            q = torch.zeros(q.shape[0], self.runner.vocab_size, dtype=q.dtype).index_copy_(1, d2t.to(q.device), q)
        return DraftTree(self.runner.to_target(torch.tensor(toks)), torch.tensor(pars), torch.tensor(scores), q)


def _ordered(choices: Sequence[Sequence[int]], num_heads: int) -> list[tuple[int, ...]]:
    try:
        ordered = check_choices(choices)
    except ValueError as e:
        raise SpecdecError(f"choices {e}") from None
    if (deep := max(map(len, ordered))) > num_heads:
        raise SpecdecError(f"choices: a path of depth {deep} needs {deep} Medusa heads, these heads have {num_heads}")
    return ordered


# ---- the node budget, from this machine's costs ----

def tree_rate(accuracies, choices, target: Callable[[int], float], draft_s: float) -> float:
    """Expected tokens per second of a tree: (1 + expected accepted) / (t(1 + nodes) + draft)."""
    return (1 + expected_accepted(accuracies, choices)) / (target(1 + len(choices)) + draft_s)


def best_size(accuracies, target: Callable[[int], float], draft_s: float, dense_topk: int = 0) -> int:
    """The tree size (of SIZES) with the most expected tokens per second; `target`: seconds of a forward by rows."""
    k = len(accuracies)
    pick = (lambda n: dense_choices(k, dense_topk, n)) if dense_topk else (lambda n: sparse_choices(accuracies, n))
    return max(SIZES, key=lambda n: tree_rate(accuracies, pick(n), target, draft_s))


def measured_costs(target_runner, drafter_runner: MedusaRunner, head_dir: str, recalibrate: bool = False) -> dict:
    """{"target_s": {N: s}, "draft_s": s}: t(N) at anchor sizes (Costs.target interpolates the rest) and one
    heads forward, cached per machine, threads, torch, target, precision and heads (a few seconds the first
    time: every tree size timed took 19 s on a 2-GHz Zen at one thread)."""
    # the full path: trained heads all sit in dirs named "heads", and their draft costs differ
    key = machine_key(target_runner) | {"medusa_rows": list(ROWS), "heads_path": os.path.realpath(head_dir)}

    def measure() -> dict:
        target_s = forward_costs(target_runner, ROWS, reps=3, ctx=384, stat=min, warmup=1)
        f = torch.randn(drafter_runner.hidden_size)
        ts = []
        for _ in range(8):
            t = time.perf_counter()
            drafter_runner.logits(f)
            ts.append(time.perf_counter() - t)
        return {"target_s": {str(n): t for n, t in target_s.items()}, "draft_s": min(ts[2:])}

    return cached(key, measure, lambda d: {"target_s": {int(n): t for n, t in d["target_s"].items()},
                                           "draft_s": float(d["draft_s"])}, recalibrate)[0]


# ---- registration ----

class MedusaOptions(Options):
    heads: str | None = option(None, "Medusa heads dir: ours (`specdec train medusa`), FasterDecoding's or vLLM's "
                               "layout (default: the Medusa-1 heads shipped for this target)",
                               aliases=("head",), shown="shipped", metavar="PATH")
    tree: Literal["sparse", "dense"] = option(
        "sparse", "sparse (from the heads' measured accuracies) or dense (every rank < topk, level by level)")
    tree_size: int | None = option(None, "nodes in the tree (default: the most tokens per second under "
                                   "this machine's measured forward costs)", ge=1, le=64, shown="measured")
    topk: int = option(3, "dense tree: ranks per head", ge=1, le=MAX_RANK)
    choices: list[list[Annotated[int, Field(ge=0)]]] | None = option(
        None, "an explicit tree: Medusa's medusa_choices, rank paths e.g. [[0],[1],[0,0]]", shown="none")
    typical: bool = option(False, "LOSSY: Medusa's typical acceptance, accept x if p(x) > min(epsilon, "
                           "delta * exp(-H(p))); greedy at T = 0")
    epsilon: float = option(0.09, "typical acceptance: the probability threshold", gt=0, le=1)
    delta: float = option(0.3, "typical acceptance: the entropy-scaled threshold", gt=0, le=1)
    recalibrate: bool = option(False, "re-measure this machine's forward costs for the tree size")
    children: Literal["topk", "sample"] | None = option(
        None, "topk: each head's ranked tokens (point masses); sample: at T > 0 each node's children drawn from "
        "its head without replacement, with their q (the same tree shape; lossless; T = 1: tau 1.18 -> 1.29, "
        "docs/benchmarks.md)", shown="sample; topk with typical")

    @field_validator("choices")
    @classmethod
    def _a_tree(cls, v: list | None) -> list | None:
        return v if v is None else [list(c) for c in check_choices(v)]

    @model_validator(mode="after")
    def _sampled_children_are_lossless_only(self):
        if self.typical and self.children == "sample":
            raise ValueError("children=sample cannot be combined with typical=true (typical acceptance reads no q)")
        return self


def medusa_runner(target: Target, heads_dir: str) -> tuple[MedusaRunner, dict]:
    if not os.path.isdir(heads_dir):
        raise SpecdecError(f"Medusa heads {heads_dir!r} is not a directory")
    model, runner = target.model, target.runner
    p = next(model.parameters())
    lm = float_weight(model.get_output_embeddings().weight)  # a GGUF file's: its rows in fp32
    heads = import_medusa(heads_dir, hidden_size=runner.hidden_size, vocab_size=lm.shape[0], target_lm_head=lm,
                          device=p.device, dtype=p.dtype)  # ours, vLLM's or FasterDecoding's layout
    weights = runner.head_weights(heads)  # fp16 on the streaming kernel for an fp32 target (as EAGLE's head)
    shared = runner.shared_lm_head(weights) if heads.lm_heads is None and heads.d2t is None else None
    return MedusaRunner(heads, lm if shared is None else shared, weights=weights), heads.meta


def tree_choices(target: Target, runner, meta: dict, opts: MedusaOptions, what: str) -> list[list[int]]:
    """The sparse tree from the heads' measured accuracies, sized by measured costs (or the options' own
    choices; a small dense tree for heads without accuracies)."""
    if opts.choices is not None:
        return opts.choices
    acc, k = meta.get("accuracies"), runner.num_heads
    if acc is not None and (len(acc) != k or not all(isinstance(r, list) and r for r in acc)):
        raise SpecdecError(f"{what} heads {opts.heads}: config.json specdec.accuracies must hold one list "
                           f"per head ({k})")
    dense = opts.tree == "dense" or not acc
    size = opts.tree_size
    if size is None:
        if not acc:  # imported heads without measured accuracies: a small dense tree
            size = min(opts.topk * 2, 8)
        else:
            costs = measured_costs(target.runner, runner, opts.heads, opts.recalibrate)
            size = best_size(acc, Costs(costs["target_s"]).target, costs["draft_s"], opts.topk if dense else 0)
    return dense_choices(k, opts.topk, size) if dense else sparse_choices(acc, size)


def heads_drafter(target: Target, opts: MedusaOptions, kind: str, runner_of: Callable, drafter: type[MedusaDrafter],
                  train: str) -> Drafter:
    """Medusa's or Hydra's drafter (kind): the given heads or the ones shipped for the target (`train`: how to
    make some), the sparse tree from their measured accuracies, typical acceptance when asked."""
    heads_dir = opts.heads or find_shipped_head(target.model, kind)
    if heads_dir is None:
        raise SpecdecError(f"method {kind!r} needs {kind.capitalize()} heads for this model: pass heads=<dir> "
                           f"({train})")
    opts = opts.model_copy(update={"heads": str(heads_dir)})
    runner, meta = runner_of(target, opts.heads)
    choices = tree_choices(target, runner, meta, opts, kind.capitalize())
    typical = Typical(opts.epsilon, opts.delta) if opts.typical else None
    d = drafter(runner, choices, typical, opts.children or ("topk" if typical else "sample"))
    d.name = kind + (":typical" if typical else "")
    return d


def build_medusa(target: Target, opts: MedusaOptions) -> Drafter:
    return heads_drafter(target, opts, "medusa", medusa_runner, MedusaDrafter,
                         "train them with `specdec train medusa`; heads ship for SmolLM2-135M-Instruct only")


register(Method("medusa", "Medusa: K parallel heads on the target's last feature, one tiny forward per step; a sparse "
                "tree from their measured accuracies (`typical=true`: Medusa's lossy typical acceptance)",
                MedusaOptions, build_medusa))
