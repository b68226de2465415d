"""The search behind `specdec tune`: the EAGLE-2 tree budget (depth, topk, tree_size) that maximises
tokens/s on this machine, and the same with a prompt-lookup chain in the tree (`lookup`, for `auto`).

Acceptance is measured offline, exactly for greedy decoding. The target's greedy continuation of a
few calibration prompts is known, so at every root position the draft tree is matched against it:
the root path spelling the next tokens is what greedy verification accepts, no target forward
needed per configuration. One expansion per top-k at the largest depth serves every (depth, m): the
EAGLE-2 tree of a smaller depth is that expansion cut at the depth, and its m nodes are the top m by
V (stable, shallow first) of that prefix, exactly as build_dynamic_tree reranks. Replaying the
engine's steps (accepted + 1 tokens at a time) over the per-position lengths gives the τ the engine
reports. Costs are timed here: t(N) of the target, propose() per configuration, and the drafter's
per-step update. A lookup chain of L tokens joins the tree as in UnionDrafter: greedy accepts the longer
of the two matched paths (a path through both shares the chain's prefix), and the tree grows by the
chain's nodes that the EAGLE tree does not already hold.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass, field, replace

import torch

from specdec.drafters.base import NoDrafter, begin_on, follow
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.errors import SpecdecError
from specdec.machine import forward_costs, machine_summary
from specdec.sampling import SamplingParams
from specdec.stats import Stats
from specdec.tree import DraftTree, TreeBudget
from specdec.tune.replay import matched_path, replay, union_step, visited
from specdec.verify import Verdict

DEPTHS = range(2, 8)
TOPKS = range(1, 7)
SIZES = (2, 3, 4, 6, 8, 10, 12, 16, 20)
LOOKUPS = (4, 8, 12, 16, 24)


def candidates(depths=DEPTHS, topks=TOPKS, sizes=SIZES) -> list[TreeBudget]:
    # m beyond what the expansion makes is impossible; m < depth gives the same tree as depth m
    # (the top-m set is connected, so no deeper than m) at the price of more head steps
    return [TreeBudget(d, k, m) for d in depths for k in topks for m in sizes if d <= m <= k + (d - 1) * k * k]


# ---- acceptance ----

def accepted_lengths(full: DraftTree, truth: Sequence[int], configs: Sequence[TreeBudget],
                     budget: int = 1 << 30) -> dict[TreeBudget, int]:
    """Greedy accepted length of each config's EAGLE-2 tree, read off `full`: the expansion of the same
    top-k at a depth >= every config's, every node kept, in build order (so depth-sorted).
    budget = the engine's ctx.max_nodes (the drafter caps depth and m by it)."""
    path = matched_path(full, truth)
    path_ranks: dict[int, list[int]] = {}  # depth -> rank by V of each path node within that depth
    out = {}
    for c in configs:
        d, m = min(c.depth, budget), min(c.tree_size, budget)
        if d not in path_ranks:
            nd = int((full.depth <= d).sum())
            order = torch.argsort(-full.scores[:nd], stable=True)
            pos = torch.empty(nd, dtype=torch.long)
            pos[order] = torch.arange(nd)
            path_ranks[d] = [int(pos[i]) for i in path if i < nd]
        out[c] = sum(r < m for r in path_ranks[d])  # the kept set is closed under parents
    return out


@dataclass
class Walk:
    accepted: dict[TreeBudget, list[int]]  # per root position
    draft_s: dict[TreeBudget, list[float]]  # propose() wall times at the timed positions
    follow_s: list[float]  # the drafter's update after each step (engine: drafter.accept)
    # (config, lookup L) -> per root position (accepted, nodes) of the EAGLE tree + an L-token lookup chain
    union: dict[tuple[TreeBudget, int], list[tuple[int, int]]] = field(default_factory=dict)
    lookup_s: list[float] = field(default_factory=list)  # prompt-lookup propose() wall times


def walk(drafter, target, prompt: list[int], continuation: list[int], configs: Sequence[TreeBudget],
         time_every: int = 0, lookups: Sequence[int] = ()) -> Walk:
    """Drive an EagleDrafter along prompt + continuation (the target's greedy output) one token at a
    time, recording every config's accepted length at each root position. time_every > 0: also time
    propose() for every config at every time_every-th position that leaves room for the largest tree.
    lookups: also record each config joined with a prompt-lookup chain of each of these lengths."""
    seq = list(prompt) + list(continuation)
    p, n_seq = len(prompt), len(seq)
    if not configs or not continuation:
        raise SpecdecError("nothing to measure: no configurations or an empty continuation")
    ctx, out = begin_on(target, drafter, seq, p)
    feats, aux = out.features, out.aux
    by_k: dict[int, list[TreeBudget]] = {}
    for c in configs:
        by_k.setdefault(c.topk, []).append(c)
    depth_max = max(c.depth for c in configs)
    m_max = max(c.tree_size for c in configs)
    w = Walk({c: [] for c in configs}, {c: [] for c in configs}, [], {(c, n): [] for c in configs for n in lookups})
    pld = PromptLookupDrafter(chain_len=max(lookups)) if lookups else None
    warm = True
    for r in range(p, n_seq - 1):
        budget = n_seq - 2 - r  # what the engine allows with max_new_tokens = len(continuation)
        truth = seq[r + 1:]
        chain: list[int] = []
        if pld is not None and budget > 0:
            t = time.perf_counter()
            chain = pld.propose(replace(ctx, max_nodes=budget)).tokens.tolist()
            w.lookup_s.append(time.perf_counter() - t)
        for k, cs in by_k.items():
            if budget == 0:
                found = merged = dict.fromkeys(cs, 0)
            else:
                full = drafter.propose(ctx, TreeBudget(depth_max, k, 1 << 30))
                found = accepted_lengths(full, truth, cs, budget)
                if lookups:  # the chain's prefix that the tree already holds
                    merged = accepted_lengths(full, chain, cs, budget)
            for c, a in found.items():
                w.accepted[c].append(a)
                for n in lookups:
                    w.union[(c, n)].append(union_step(a, merged[c], min(c.tree_size, budget), chain, truth, n, budget))
        if time_every and (r - p) % time_every == 0 and budget >= m_max:
            passes = 2 if warm else 1  # the very first pass only warms up allocations and caches
            for rep in range(passes):
                for c in configs:
                    t = time.perf_counter()
                    drafter.propose(ctx, c)
                    if rep == passes - 1:
                        w.draft_s[c].append(time.perf_counter() - t)
            warm = False
        if r == n_seq - 2:
            break
        # follow the text, as the engine does after each verification
        t = time.perf_counter()
        follow(drafter, ctx, [seq[r + 1]], feats[r:r + 1], None if aux is None else aux[r:r + 1],
               Verdict([], [seq[r + 1]], seq[r + 1]))
        drafter.sync(ctx)  # the head follows lazily: its catch-up is this step's cost, not the next draft's
        w.follow_s.append(time.perf_counter() - t)
    return w


# ---- the choice ----

@dataclass
class Row:
    config: TreeBudget
    tau: float
    draft_s: float
    target_s: float  # t(m + 1): the root and m nodes (with a lookup chain: the mean over the steps)
    follow_s: float
    lookup: int = 0  # tokens of the prompt-lookup chain joined to the tree

    @property
    def tokens_per_second(self) -> float:
        return self.tau / (self.draft_s + self.target_s + self.follow_s)

    def as_dict(self) -> dict:
        return {**asdict(self.config), **({"lookup": self.lookup} if self.lookup else {}),
                "tau": round(self.tau, 4), "draft_ms": round(self.draft_s * 1e3, 3),
                "target_ms": round(self.target_s * 1e3, 3), "tokens_per_second": round(self.tokens_per_second, 2)}


def rank(rows: Sequence[Row]) -> list[Row]:
    """Best first; ties go to the smaller tree."""
    return sorted(rows, key=lambda r: (-r.tokens_per_second, r.config.tree_size, r.config.depth, r.config.topk))


def tune(decoder, prompts: Sequence[list[int]], tokens: int = 256, configs: Sequence[TreeBudget] | None = None,
         reps: int = 7, time_every: int = 24, log: Callable[[str], None] = lambda s: None,
         lookups: Sequence[int] = LOOKUPS) -> dict:
    """Measure and choose for an eagle2 Decoder (api.from_models) on token-id prompts. Returns the record
    that save_tuning writes; its depth / topk / tree_size are the choice for `eagle2`, its "auto" the
    best of those and of every tree joined with a lookup chain of each length in `lookups`."""
    drafter, target = decoder.drafter, decoder.runner
    if drafter.budget is None:
        raise SpecdecError("tune needs an eagle2 decoder (an EAGLE head)")
    if not prompts or tokens < 2:
        raise SpecdecError("tune needs at least one prompt and --tokens >= 2")
    configs = list(configs or candidates())
    steps: dict[TreeBudget, list[int]] = {c: [] for c in configs}  # accept lengths the engine would record
    draft_s: dict[TreeBudget, list[float]] = {c: [] for c in configs}
    follow_s: list[float] = []
    lookup_s: list[float] = []
    union_steps: dict[tuple[TreeBudget, int], list[tuple[int, int]]] = {(c, n): [] for c in configs for n in lookups}
    positions = 0
    for i, prompt in enumerate(prompts):
        if len(prompt) + tokens + 1 > target.max_length:
            raise SpecdecError(f"calibration prompt {i} + {tokens} tokens exceed the context of {target.max_length}")
        cont = [t for step in decoder.steps(prompt, SamplingParams(), tokens, Stats(), drafter=NoDrafter())
                for t in step]
        w = walk(drafter, target, prompt, cont, configs, time_every, lookups)
        for c in configs:  # each prompt is its own generation: replay it separately, pool the steps
            steps[c] += replay(w.accepted[c])
            draft_s[c] += w.draft_s[c]
        for key, per_pos in w.union.items():
            union_steps[key] += [(per_pos[i][0] + 1, per_pos[i][1]) for i in visited([a for a, _ in per_pos])]
        follow_s += w.follow_s
        lookup_s += w.lookup_s
        positions += len(cont) - 1
        log(f"prompt {i + 1}/{len(prompts)}: {len(cont)} tokens walked")
    if not all(draft_s.values()) or not follow_s:
        raise SpecdecError("the continuations are too short to time the drafter: raise --tokens")
    sizes = {c.tree_size + 1 for c in configs} | {n + 1 for st in union_steps.values() for _, n in st} | {1}
    sizes = sorted(sizes)
    log(f"timing the target forward for N in {sizes}")
    t_target = forward_costs(target, sizes, reps)
    follow = statistics.median(follow_s)
    rows = rank([Row(c, statistics.mean(steps[c]), statistics.median(draft_s[c]), t_target[c.tree_size + 1],
                     follow) for c in configs])
    best = rows[0]
    look = statistics.median(lookup_s) if lookup_s else 0.0
    both = rank(rows + [Row(c, statistics.mean(a for a, _ in st), statistics.median(draft_s[c]) + look,
                            statistics.mean(t_target[n + 1] for _, n in st), follow, lookup)
                        for (c, lookup), st in union_steps.items()])
    return {
        **asdict(best.config),
        "tau": round(best.tau, 4),
        "tokens_per_second": round(best.tokens_per_second, 2),
        "vanilla_tokens_per_second": round(1 / t_target[1], 2),  # one forward per token, no drafting
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_summary(),
        "calibration": {"prompts": len(prompts), "tokens": tokens, "positions": positions,
                        "forwards_replayed": len(steps[best.config])},
        "target_ms": {str(n): round(t * 1e3, 3) for n, t in t_target.items()},
        "follow_ms": round(follow * 1e3, 3),
        "top": [r.as_dict() for r in rows[:20]],
        # the acceptance model (greedy tau per budget): machine-independent, what adaptive `auto` sizes trees from
        "acceptance": [{**asdict(r.config), "tau": round(r.tau, 4)}
                       for r in sorted(rows, key=lambda r: astuple(r.config))],
        # `auto`: the fastest of the trees above and of the trees joined with a prompt-lookup chain
        "auto": {**asdict(both[0].config), "lookup": both[0].lookup, "tau": round(both[0].tau, 4),
                 "tokens_per_second": round(both[0].tokens_per_second, 2)},
        "lookups_tried": list(lookups),
        "top_with_lookup": [r.as_dict() for r in both[:10]],
    }
