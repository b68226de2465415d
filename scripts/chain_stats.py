#!/usr/bin/env python3
"""How far prompt-lookup chains match, by the n-gram length they matched: the prior `auto` prices a chain
by (drafters/controller.py, LOOKUP_PRIOR and LOOKUP_PRIOR_SAMPLED).

The target answers hand-written prompts and GSM8K *train* questions (never benchmark prompts) with vanilla
decoding; at every position of each answer the lookup runs on the tokens so far, and its chain is compared
with the tokens that followed. Prints P(the first i tokens all match), i = 1.., per n-gram length.

    .venv/bin/python scripts/chain_stats.py --temperature 0
    .venv/bin/python scripts/chain_stats.py --temperature 1
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from specdec import api
from specdec.drafters.base import DecodeContext
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.sampling import SamplingParams

GSM8K = Path(__file__).resolve().parents[1] / "src/specdec/data/gsm8k/train.jsonl"
HAND = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle gear system works to a ten-year-old.",
    "List five tips for keeping houseplants alive, with a sentence on each.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "What are the main differences between a cold and the flu?",
    "Draft a polite email asking a landlord to fix a leaking tap.",
    "Summarize the plot of a classic heist movie in one paragraph, then list its main characters.",
    "Describe the water cycle step by step.",
    "Give me a weekly meal plan for a vegetarian on a budget.",
    "Write a limerick about a cat who loves jazz.",
    "How do I reverse a linked list in C? Show code.",
    "Explain the difference between TCP and UDP with examples.",
    "Write a product description for a solar-powered backpack.",
    "Compare renting and buying a home in a short table.",
    "Translate 'good morning, how are you today?' into French, Spanish and German, and explain each.",
    "Write a SQL query that finds the top three customers by total order value, and explain it.",
    "Give a step-by-step recipe for pancakes.",
    "What is recursion? Give two examples in JavaScript.",
    "Write a cover letter opening paragraph for a junior data analyst position.",
    "Explain photosynthesis in simple terms.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=60, help="hand-written prompts first, then GSM8K train")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--chain-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
    random.Random(7).shuffle(rows)
    prompts = (HAND + [r["question"] for r in rows])[: args.prompts]
    dec = api.load(args.model, method="vanilla", threads=args.threads)
    pld = PromptLookupDrafter(chain_len=args.chain_len)
    L, T = args.chain_len, args.temperature
    hits = {n: [0] * L for n in (1, 2, 3)}
    seen = {n: [0] * L for n in (1, 2, 3)}
    for i, p in enumerate(prompts):
        g = dec.generate([{"role": "user", "content": p}], max_new_tokens=args.max_new_tokens, temperature=T,
                         seed=i if T else None)
        toks, start = list(g.prompt_ids) + list(g.token_ids), len(g.prompt_ids)
        pld.index = None
        for e in range(start, len(toks)):
            chain = pld.lookup(DecodeContext(toks[:e], SamplingParams(T), None, start))
            if not chain:
                continue
            rest, n = toks[e:], pld.last_ngram
            m = next((j for j, (a, b) in enumerate(zip(chain, rest)) if a != b), min(len(chain), len(rest)))
            for j in range(min(len(chain), len(rest), m + 1)):  # nothing is known past the answer's end
                seen[n][j] += 1
                hits[n][j] += j < m
    for n in (1, 2, 3):
        s, tail = 1.0, []
        for j in range(L):
            if seen[n][j] < 5:
                break
            s *= hits[n][j] / seen[n][j]
            tail.append(round(s, 3))
        print(f"{n}-gram ({seen[n][0]} chains): {tail[:12]}")


if __name__ == "__main__":
    main()
