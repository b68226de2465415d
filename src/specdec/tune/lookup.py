"""How often `auto`'s n-gram nodes beside a head are accepted, by their raw confidence: the priors of its n-gram
calibration (drafters/policy.Calibration), measured on tune's calibration answers. Why: the raw confidence
of a node (its match length) is a shape, not a rate: on SmolLM2's calibration answers a node after a
one-token match (raw 0.33) was accepted 0.17 of the time greedy and 0.11 at T = 1, one after a long match
(raw >= 0.8) 0.95 and 0.81, where the formula's priors said 0.33 / 0.18 and 0.8+ / 0.44+."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from specdec.drafters.adaptive import tried
from specdec.drafters.base import DecodeContext, NoDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.policy import EDGES
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.sampling import SamplingParams
from specdec.stats import Stats
from specdec.tree import children_of

MIN_TRIES = 20  # a bucket with fewer tested nodes keeps the formula's prior (None)


def node_outcomes(prompt: list[int], answer: list[int], ngram: PromptLookupDrafter | NgramDrafter
                  ) -> list[tuple[float, bool]]:
    """(raw confidence, accepted) of every node of `ngram`'s drafts the answer tests: at each step its
    draft, scored as `auto` scores it (adaptive.tried: node by node while their parents matched)."""
    toks, out = prompt + answer[:1], []
    ngram.begin(DecodeContext(toks, SamplingParams(), None, len(prompt)))
    for t in range(len(prompt), len(prompt) + len(answer) - 1):  # one growing list: the index extends
        draft, parents, confs, _ = ngram.scored(DecodeContext(toks, SamplingParams(), None, len(prompt)))
        tested, _ = tried(children_of(parents), draft, answer[t - len(prompt) + 1:])
        out += [(confs[node], hit) for node, hit in tested]
        toks.append(answer[t - len(prompt) + 1])
    return out


def lookup_rates(decoder, prompts: Sequence[list[int]], tokens: int,
                 ngram: Callable[[], PromptLookupDrafter | NgramDrafter], temperature: float = 0.0,
                 seeds: int = 1) -> list[float | None]:
    """Accepted share of n-gram nodes (from a fresh ngram() per answer) per calibration bucket
    (policy.EDGES), over the target's own answers (vanilla: seeds answers per prompt at T > 0, seed k the
    k-th); None where fewer than MIN_TRIES."""
    hits, tries = [0] * (len(EDGES) + 1), [0] * (len(EDGES) + 1)
    for seed in range(seeds if temperature > 0 else 1):
        for prompt in prompts:
            params = SamplingParams(temperature, seed=seed) if temperature > 0 else SamplingParams()
            answer = [t for step in decoder.steps(prompt, params, tokens, Stats(), drafter=NoDrafter()) for t in step]
            for conf, hit in node_outcomes(prompt, answer, ngram()):
                b = bisect.bisect_right(EDGES, conf)
                hits[b] += hit
                tries[b] += 1
    return [round(h / n, 4) if n >= MIN_TRIES else None for h, n in zip(hits, tries)]
