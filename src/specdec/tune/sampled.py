"""The sampled half of the acceptance model: tau at T = 1 of EAGLE-2 trees whose children are drawn from the
draft (`children=sample`), per budget, on the calibration prompts.

The fastest of those trees is what `eagle2` and `fspad` draft for sampled requests (tune writes it as
`sampled`). Fastest by the cost model greedy trees are ranked with (`choose_sampled`): tau over the draft
time per step measured here plus the target's forward over the tree from tune's table. Why not the wall
time of the same decoding: each tree's decoding is timed at a different moment, so any drift in the
machine's load lands on one tree (64-token runs spread 77-95 tok/s for the shipped head), while one
forward table prices every tree alike.

Why measured by decoding and not by replay: a sampled tree's acceptance depends on the draws, and the text
it is checked against is itself sampled, so there is no single continuation to replay. Every budget runs on
the same prompts and seeds (common random numbers), so the differences between budgets are less noisy than
each tau. Machine-independent like the greedy table: it ships with the head next to it in tuning.json.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.stats import Stats
from specdec.tree import TreeBudget
from specdec.tune.search import Row, rank

# trees whose first tree_size nodes of a sampled expansion differ in shape: chains (topk 1), bushes at
# depth 1, and mixes; topk <= 3 because a sampled node's later children are rarely accepted
SAMPLED_CANDIDATES = tuple(TreeBudget(*b) for b in (
    (1, 1, 1), (2, 1, 2), (1, 2, 2), (3, 1, 3), (2, 2, 3), (1, 3, 3), (2, 2, 4), (2, 3, 4), (3, 2, 4),
    (3, 2, 6), (2, 3, 6), (3, 3, 6), (3, 3, 8)))


def sampled_acceptance(decoder, prompts: Sequence[list[int]], tokens: int = 128, temperature: float = 1.0,
                       seed: int = 0,
                       budgets: Sequence[TreeBudget] = SAMPLED_CANDIDATES,
                       log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """[{depth, topk, tree_size, tau, draft_ms, tokens_per_second}] per budget: emitted tokens per target
    forward, the drafter's time per forward (propose and catching up) and new tokens per second of
    decoding (prefill excluded: the same for every budget), pooled over the prompts, each prompt sampled
    with seed + its index. decoder: an api.Decoder over an EAGLE-2 drafter."""
    drafter = decoder.drafter
    if drafter.children != "sample":
        raise SpecdecError("sampled acceptance needs an EAGLE-2 drafter with children='sample'")
    rows = []
    own = drafter.sampled_budget
    try:
        for b in budgets:
            drafter.sampled_budget = b
            forwards = emitted = 0
            busy = drafting = 0.0
            for i, prompt in enumerate(prompts):
                stats = Stats()
                # unseeded requests draw children from the draft (recursive rejection): what this table
                # prices; torch's generator seeded per prompt keeps the draws common to every budget
                torch.manual_seed(seed + i)
                params = SamplingParams(temperature)
                for _ in decoder.steps(prompt, params, tokens, stats):
                    pass
                forwards += len(stats.accept_lengths)
                emitted += sum(stats.accept_lengths)
                busy += stats.total_time - stats.wait_time - stats.prefill_time
                drafting += stats.draft_time
            rows.append({**asdict(b), "tau": round(emitted / max(forwards, 1), 4),
                         "draft_ms": round(drafting / max(forwards, 1) * 1e3, 4),
                         "tokens_per_second": round(emitted / busy, 2) if busy > 0 else 0.0})
            log(f"sampled children, T={temperature}, {b}: tau {rows[-1]['tau']:.3f}, "
                f"{rows[-1]['tokens_per_second']:.1f} tok/s")
    finally:
        drafter.sampled_budget = own
    return rows


def choose_sampled(rows: Sequence[dict], target_ms: dict[str, float]) -> dict:
    """The fastest row by search.rank's cost model (ties: the smaller tree), as tune writes it under
    `sampled`; target_ms: tune's forward times by row count ("N": ms), covering every tree's size + 1."""
    priced = [Row(TreeBudget(r["depth"], r["topk"], r["tree_size"]), r["tau"], r["draft_ms"] / 1e3,
                  target_ms[str(r["tree_size"] + 1)] / 1e3, 0.0)
              for r in rows if r.get("draft_ms") and str(r["tree_size"] + 1) in target_ms]
    if not priced:
        raise SpecdecError("no sampled tree was timed")
    best = rank(priced)[0]
    return {**asdict(best.config), "tau": round(best.tau, 4), "tokens_per_second": round(best.tokens_per_second, 2)}
