"""`auto`: the fastest lossless method we know for this target, decided when the Decoder is built.

With an EAGLE head for the target (the given one, or one shipped in the package): EAGLE-2 with the
tree and prompt-lookup chain `specdec tune` chose for this head. The tuned chain drafts for greedy
requests only: tune prices it for greedy decoding, and sampled text repeats far less (MT-bench turn 1
at T=1: the chain cost more than it gave). Without a head: vanilla.
"""

from __future__ import annotations

from specdec.drafters.base import Drafter, NoDrafter
from specdec.drafters.eagle import Eagle2Options, EagleDrafter, head_runner, tuned_budget
from specdec.drafters.registry import Method, Target, register
from specdec.drafters.union import with_lookup
from specdec.heads.shipped import find_shipped_head
from specdec.tuning import load_tuning


def build_auto(target: Target, opts: Eagle2Options) -> Drafter:
    if opts.head is None and find_shipped_head(target.model) is None:
        return NoDrafter()
    runner, head_dir = head_runner(target, opts, "auto")
    tuned = load_tuning(head_dir, auto=True) or {}
    drafter = EagleDrafter(runner, tuned_budget(opts, head_dir, tuned), rank_by=opts.rank_by, rerank=opts.rerank)
    if opts.lookup is not None:  # asked for: every request, greedy or sampled
        return with_lookup(drafter, opts.lookup)
    return with_lookup(drafter, tuned.get("lookup", 0), greedy_only=True)


register(Method("auto", "the default: `eagle2` with the head shipped for this target and the tree + prompt-lookup "
                "chain `specdec tune` chose for it (the chain for greedy requests only); else `vanilla`",
                Eagle2Options, build_auto))
