"""`auto`: the fastest lossless method we know for this target, decided when the Decoder is built.

With an EAGLE head for the target (the given one, or one shipped in the package): adaptive speculation
(drafters/adaptive.py) — every step, the EAGLE-2 tree and prompt-lookup chain that maximise expected
tokens per second under costs measured on this machine, or no draft at all. `adaptive=false` gives the
static choice instead: the tree and chain `specdec tune` chose on its machine, the chain for greedy
requests only (sampled text repeats far less). Without a head: vanilla.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from specdec.drafters.adaptive import AdaptiveDrafter, load_costs, menu_from_tuning
from specdec.drafters.base import Drafter, NoDrafter
from specdec.drafters.eagle import Eagle2Options, EagleDrafter, head_runner, tuned_budget
from specdec.drafters.registry import Method, Target, option, register
from specdec.drafters.union import with_lookup
from specdec.heads.shipped import find_shipped_head
from specdec.tuning import load_acceptance, load_tuning

DEFAULT_LOOKUP = 12  # chain tokens when the tuning file has no choice (tune's choice for the shipped head)


class AutoOptions(Eagle2Options):
    adaptive: bool = option(True, "size (or skip) the draft every step from measured costs and live acceptance; "
                            "false: the static tuned tree (explicit depth/topk/tree_size also pin it)")
    recalibrate: bool = option(False, "re-measure this machine's costs (else cached per machine, threads, torch, "
                               "target and head)")
    children: Literal["topk", "sample"] | None = option(None, "top-k children only: the controller reranks "
                                                           "its trees by value", shown="topk")

    @field_validator("children")
    @classmethod
    def _topk_only(cls, v: str | None) -> str | None:
        if v == "sample":  # its controller prices value-reranked trees: sampled ones cannot be reranked
            raise ValueError("auto drafts top-k children; for sampled children use eagle2:children=sample")
        return v


def build_auto(target: Target, opts: AutoOptions) -> Drafter:
    if opts.head is None and find_shipped_head(target.model) is None:
        return NoDrafter()
    runner, head_dir = head_runner(target, opts, "auto")
    tuned = load_tuning(head_dir, auto=True) or {}
    pinned = any(v is not None for v in (opts.depth, opts.topk, opts.tree_size))
    drafter = EagleDrafter(runner, tuned_budget(opts, head_dir, tuned), rank_by=opts.rank_by, rerank=opts.rerank)
    if opts.adaptive and not pinned:
        lookup = opts.lookup if opts.lookup is not None else tuned.get("lookup") or DEFAULT_LOOKUP
        menu = menu_from_tuning(load_acceptance(head_dir))
        costs, _, _ = load_costs(target.runner, drafter, head_dir, menu, lookup, opts.recalibrate)
        return AdaptiveDrafter(drafter, menu, costs, lookup)
    if opts.lookup is not None:  # asked for: every request, greedy or sampled
        return with_lookup(drafter, opts.lookup)
    return with_lookup(drafter, tuned.get("lookup", 0), greedy_only=True)


register(Method("auto", "the default: adaptive speculation with the EAGLE head shipped for this target (every step the "
                "EAGLE-2 tree and prompt-lookup chain, or none, that pay most under costs measured on this "
                "machine); `adaptive=false`: the static tuned tree; no head: `vanilla`", AutoOptions, build_auto))
