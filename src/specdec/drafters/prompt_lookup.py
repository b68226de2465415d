"""Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the context's last
n-gram and propose the tokens that followed it. No model; wins on inputs that get copied (code edits,
summaries, RAG)."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specdec.drafters.base import DecodeContext, Drafter
from specdec.tree import DraftTree


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 8) -> None:
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
            raise ValueError("need 1 <= min_ngram <= max_ngram and num_tokens >= 1")
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens

    def propose(self, ctx: DecodeContext) -> DraftTree:
        # a deterministic chain: q is a point mass, so the verifier stays exact at any temperature
        k = min(self.num_tokens, ctx.max_nodes)
        toks = np.asarray(ctx.tokens)
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(toks[:-1], n)  # excludes the suffix matching itself
            hits = np.flatnonzero((windows == toks[-n:]).all(axis=1))
            if hits.size and k > 0:
                start = int(hits[-1]) + n
                follow = toks[start:start + k]
                if follow.size:
                    return DraftTree.chain(torch.from_numpy(follow.astype(np.int64)))
        return DraftTree.empty()
