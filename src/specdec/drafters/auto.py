"""`auto`: the fastest lossless method we know for the target, decided when the Decoder is built: adaptive
speculation (drafters/adaptive.py) over an EAGLE head's trees (the given head or one shipped for the
target) beside the lookup chain `specdec tune` found paying (else the n-gram draft), or, without a head
(or with `draft=` and no `head=`), over the n-gram draft's prefixes and the draft model's chains. `adaptive=false`: the
static choice (the tuned tree and chain; without a head, method `ngram`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from specdec.drafters.adaptive import DRAFT_ALPHA, AdaptiveDrafter
from specdec.drafters.base import Drafter, NoDrafter
from specdec.drafters.clock import StepClock
from specdec.drafters.costs import load_costs
from specdec.drafters.draft_model import (
    DRAFT_QUANT,
    DRAFT_VOCAB,
    DraftModelDrafter,
    DraftQuant,
    draft_quant_option,
    draft_runner,
)
from specdec.drafters.eagle import Eagle2Options, EagleDrafter, head_runner, tuned_budget
from specdec.drafters.ngram import NgramDrafter, NgramOptions
from specdec.drafters.policy import EDGES, menu_from_tuning
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.registry import Method, Target, option, register
from specdec.drafters.union import with_lookup
from specdec.errors import SpecdecError
from specdec.heads.shipped import find_shipped_head
from specdec.tree import TreeBudget
from specdec.tuning import load_acceptance, load_lookup_rates, load_tuning

HEAD_ONLY = ("full_vocab", "depth", "topk", "tree_size", "rank_by", "rerank", "children")
NODES = 16  # n-gram draft nodes offered per step without a head (the policy verifies the prefix that pays)
TOPK = 2  # continuations per n-gram node: a branch where the counts disagree
MIN_VALUE = 0.01  # nodes less likely than this to be accepted are not worth drafting
DRAFT_CHAINS = (1, 2, 3, 4, 6)  # draft-model chain lengths offered


class AutoOptions(Eagle2Options):
    head: str | None = option(None, "EAGLE head dir (default: the one shipped for this target; none: no head)",
                              shown="shipped", metavar="PATH")
    adaptive: bool = option(True, "size (or skip) the draft every step from measured costs and live acceptance; "
                            "false: the static tuned tree (explicit depth/topk/tree_size also pin it)")
    recalibrate: bool = option(False, "re-measure this machine's costs (else cached per machine, threads, torch, "
                               "target and head)")
    use_draft: bool = option(True, "with draft=: also chains from the draft model where they pay (false: without them)")
    draft_vocab: int = option(DRAFT_VOCAB, "with draft=: the draft model's LM head scores only this many of the most "
                              "frequent token ids; 0: the whole vocabulary", ge=0)
    draft_quant: DraftQuant = draft_quant_option()
    children: Literal["topk", "sample"] | None = option(
        None, "at T > 0: children drawn from the draft (sized from the head's sampled acceptance table, "
              "`specdec tune`) or top-k children; default: sample where the table exists (adaptive), else topk",
        shown="sample if tuned; static: topk")

    @model_validator(mode="after")
    def _no_head_no_tree(self):
        given = [k for k in HEAD_ONLY if k in self.model_fields_set]
        if self.head == "none" and given:
            raise ValueError(f"{', '.join(given)} shape an EAGLE head's tree, and head=none: drop them")
        return self

    @model_validator(mode="after")
    def _sampled_alone(self):  # adaptive auto never merges a sampled tree with the chain: lookup is fine
        if self.children == "sample" and self.lookup and not self.adaptive:
            raise ValueError("children=sample cannot share its tree with a lookup chain (lookup must be 0 "
                             "with adaptive=false): a merged tree holds point masses only")
        return self


def build_auto(target: Target, opts: AutoOptions) -> Drafter:
    # a draft model given and used overrules a shipped head (head= names one to run beside n-grams instead)
    drafting = target.draft_model is not None and opts.use_draft
    if opts.head == "none" or (opts.head is None and (drafting or not any(
            find_shipped_head(target.model, kind) for kind in ("eagle", "eagle3")))):
        given = [k for k in HEAD_ONLY if k in opts.model_fields_set]
        if given:
            raise SpecdecError(f"auto: {', '.join(given)} shape an EAGLE head's tree, and it drafts with no head "
                               "here (none ships for this target, or draft= is given): pass head=DIR, or drop them")
        return build_headless(target, opts.lookup, opts.adaptive, opts.recalibrate,
                              opts.draft_vocab if opts.use_draft else None, opts.draft_quant)
    runner, head_dir = head_runner(target, opts, "auto")
    tuned = load_tuning(head_dir, auto=True) or {}
    pinned = any(v is not None for v in (opts.depth, opts.topk, opts.tree_size))
    budget = tuned_budget(opts, head_dir, tuned)
    if opts.adaptive and not pinned:
        # the chain asked for or tuned, else the n-gram tree (Qwen2.5-Coder-1.5B, 20 HumanEval, its tuning found
        # no chain: 1.26x vanilla with a 12-token chain, 1.34x with the n-gram tree in the same run)
        chain = opts.lookup if opts.lookup is not None else tuned.get("lookup")
        ngram = None if opts.lookup == 0 else beside_head(chain)
        menu = menu_from_tuning(load_acceptance(head_dir))
        rows = load_acceptance(head_dir, sampled=True) if opts.children != "topk" else []
        if opts.children == "sample" and not rows:
            raise SpecdecError(f"children=sample: {head_dir} has no sampled acceptance table to size its trees "
                               "from; run `specdec tune`, or use children=topk")
        sampled = menu_from_tuning(rows) if rows else None
        drafter = EagleDrafter(runner, budget, rank_by=opts.rank_by, rerank=opts.rerank,
                               children="sample" if sampled else "topk")
        costs, path, origin = load_costs(target.runner, drafter, menu, ngram, head_dir, opts.recalibrate,
                                         sampled or ())
        rates = load_lookup_rates(head_dir, len(EDGES) + 1, ngram_key(ngram)) if ngram is not None else None
        return AdaptiveDrafter(costs, drafter, menu, ngram, sampled, rates,
                               StepClock(), origin, path)
    if opts.children == "sample" and opts.lookup:  # a pinned tree is static too
        raise SpecdecError("children=sample with a pinned tree cannot share it with a lookup chain: use lookup=0")
    drafter = EagleDrafter(runner, budget, rank_by=opts.rank_by, rerank=opts.rerank, children=opts.children or "topk")
    if opts.lookup is not None:  # asked for: every request, greedy or sampled
        return with_lookup(drafter, opts.lookup)
    return with_lookup(drafter, tuned.get("lookup", 0), greedy_only=True)


def beside_head(chain: int | None) -> PromptLookupDrafter | NgramDrafter:
    """The n-gram part of `auto` beside a head: the lookup chain of `chain` tokens, else the n-gram tree."""
    return PromptLookupDrafter(chain_len=chain) if chain else NgramDrafter(NODES, TOPK, min_value=MIN_VALUE)


def ngram_key(ngram: PromptLookupDrafter | NgramDrafter) -> str:
    """Names an n-gram drafter's confidences: tune's lookup rates apply to the drafter they were measured with."""
    return f"{ngram.name}:{ngram.tree_size}"  # pld:4, ngram:16


def draft_menu() -> list[tuple[TreeBudget, float]]:
    """Draft-model chains as budgets (depth k, one child, k nodes) with their prior accepted tokens."""
    return [(TreeBudget(k, 1, k), sum(DRAFT_ALPHA ** i for i in range(1, k + 1))) for k in DRAFT_CHAINS]


def build_headless(target: Target, lookup: int | None, adaptive: bool, recalibrate: bool,
                   draft_vocab: int | None = DRAFT_VOCAB, draft_quant: DraftQuant = DRAFT_QUANT) -> Drafter:
    """`auto` without an EAGLE head. lookup: n-gram draft nodes (None: NODES; 0: none); draft_vocab: the ids
    the draft model scores (0: all; None: no draft-model chains)."""
    nodes = NODES if lookup is None else lookup
    if not adaptive:  # the static choice: method `ngram` as registered (lookup: its nodes)
        o = NgramOptions()
        return NgramDrafter(lookup or o.tree_size, o.topk, o.max_ngram, o.min_value) if nodes else NoDrafter()
    ngram = NgramDrafter(nodes, TOPK, min_value=MIN_VALUE) if nodes else None
    draft = None
    if target.draft_model is not None and draft_vocab is not None:
        draft = DraftModelDrafter(draft_runner(target, draft_vocab, draft_quant), target.runner.vocab_size)
    if ngram is None and draft is None:
        return NoDrafter()
    menu = draft_menu() if draft is not None else []
    costs, path, origin = load_costs(target.runner, draft, menu, ngram, recalibrate=recalibrate)
    return AdaptiveDrafter(costs, draft, menu, ngram, clock=StepClock(), origin=origin, cache=path)


register(Method("auto", "the default: adaptive speculation with the EAGLE head shipped for this target (every step the "
                "EAGLE-2 tree and prompt-lookup chain, or none, that pay most under costs measured on this "
                "machine; `adaptive=false`: the static tuned tree); without a head, or given `draft=` (and no "
                "`head=`), the same choice over the prefixes of an `ngram` draft and the draft model's chains "
                "(`adaptive=false`: `ngram`; `lookup`: its nodes, default 16)", AutoOptions, build_auto,
                takes_draft=True))
