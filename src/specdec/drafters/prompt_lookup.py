"""Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the context's last
n-gram and propose the tokens that followed it. No model; wins on inputs that get copied (code edits,
summaries, RAG)."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specdec.drafters.base import DecodeContext, Drafter
from specdec.drafters.registry import Method, Options, option, register
from specdec.errors import SpecdecError
from specdec.tree import DraftTree


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, chain_len: int = 8) -> None:
        if not 1 <= min_ngram <= max_ngram or chain_len < 1:
            raise SpecdecError(f"prompt lookup needs 1 <= min_ngram <= max_ngram and chain_len >= 1, got "
                               f"min_ngram={min_ngram}, max_ngram={max_ngram}, chain_len={chain_len}")
        self.max_ngram, self.min_ngram, self.chain_len = max_ngram, min_ngram, chain_len
        self.draft_depth = chain_len

    last_ngram = 0  # the n-gram length the last propose() matched (0: none): longer ones predict better

    def propose(self, ctx: DecodeContext) -> DraftTree:
        # a deterministic chain: q is a point mass, so the verifier stays exact at any temperature
        self.last_ngram = 0
        k = min(self.chain_len, ctx.max_nodes)
        toks = np.asarray(ctx.tokens)
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(toks[:-1], n)  # excludes the suffix matching itself
            hits = np.flatnonzero((windows == toks[-n:]).all(axis=1))
            if hits.size and k > 0:
                start = int(hits[-1]) + n
                follow = toks[start:start + k]
                if follow.size:
                    self.last_ngram = n
                    return DraftTree.chain(torch.from_numpy(follow.astype(np.int64)))
        return DraftTree.empty()


class LookupOptions(Options):
    chain_len: int = option(8, "tokens copied per step", ge=1, aliases=("num_tokens",))
    max_ngram: int = option(3, "longest n-gram matched", ge=1)
    min_ngram: int = option(1, "shortest n-gram matched", ge=1)


register(Method("pld", "prompt lookup: copy what followed the last n-gram earlier in the context", LookupOptions,
                lambda t, o: PromptLookupDrafter(o.max_ngram, o.min_ngram, o.chain_len)))
