"""Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the context's last
n-gram and propose the tokens that followed it. No model; wins on inputs that get copied (code edits,
summaries, RAG)."""

from __future__ import annotations

import torch

from specdec.drafters.base import DecodeContext, Drafter
from specdec.drafters.registry import Method, Options, option, register
from specdec.errors import SpecdecError
from specdec.tree import DraftTree, allowed_prefix

KAPPA = 2.0  # pseudo-count of a continuation not seen yet, over the match length (ngram.py's confidences too)


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, chain_len: int = 8) -> None:
        if not 1 <= min_ngram <= max_ngram or chain_len < 1:
            raise SpecdecError(f"prompt lookup needs 1 <= min_ngram <= max_ngram and chain_len >= 1, got "
                               f"min_ngram={min_ngram}, max_ngram={max_ngram}, chain_len={chain_len}")
        self.max_ngram, self.min_ngram, self.chain_len = max_ngram, min_ngram, chain_len
        self.draft_depth = self.tree_size = chain_len  # a chain: as deep as it has nodes
        self.index: NgramIndex | None = None

    last_ngram = 0  # the n-gram length the last propose() matched (0: none): longer ones predict better

    def fork(self) -> PromptLookupDrafter:
        return PromptLookupDrafter(self.max_ngram, self.min_ngram, self.chain_len)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        # a deterministic chain: q is a point mass, so the verifier stays exact at any temperature
        toks = self.lookup(ctx)
        return DraftTree.chain(torch.tensor(toks, dtype=torch.long)) if toks else DraftTree.empty()

    def scored(self, ctx: DecodeContext) -> tuple[list[int], list[int], list[float], None]:
        """lookup() as a chain with each node's parent and confidence given its parent, for a caller that
        prices it (`auto`): node i continues a match of n + i tokens, so 1 / (1 + KAPPA / (n + i)), as
        ngram.py rates a match of that length seen once. No tree is built (None): most are never verified."""
        toks = self.lookup(ctx)
        if not toks:
            return toks, [], [], None
        n = self.last_ngram
        return toks, list(range(-1, len(toks) - 1)), [1.0 / (1.0 + KAPPA / (n + i)) for i in range(len(toks))], None

    def lookup(self, ctx: DecodeContext) -> list[int]:
        """The chain's tokens ([]: no match), and last_ngram set. Why apart from propose: a caller that
        verifies the chain only when it pays (`auto`) needs its length, and a tree only then."""
        self.last_ngram = 0
        k = min(self.chain_len, ctx.max_nodes)
        toks = ctx.tokens
        if k < 1:
            return []
        index = self.index = NgramIndex.over(self.index, toks, self.max_ngram, counts=False)
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            end = index.latest(toks[-n:])
            if end is not None:
                self.last_ngram = n
                chain = allowed_prefix(ctx.allowed, toks[end:end + k])
                if not ctx.eos_ids.isdisjoint(chain):  # nothing after an end token is emitted: a chain that
                    # copies the chat template on (a phrase of the prompt restated, then <|im_end|>...) stops there
                    return chain[:next(i for i, t in enumerate(chain) if t in ctx.eos_ids) + 1]
                return chain
        return []


class NgramIndex:
    """Each n-gram (n <= max_ngram) of a growing token list: where it last occurred and how often each
    token followed it, updated by the new tokens only. Why: a numpy scan of the whole context cost ~0.3 ms
    a step at 1k tokens (2% of a SmolLM2 forward, paid on plain steps too); this is O(new tokens). The
    suffix itself is never indexed: an n-gram counts once a token follows it (a draft copies that token on).
    counts=False keeps no counts (`following` is None): a lookup needs only where, and `auto` looks up on
    every step."""

    def __init__(self, max_ngram: int, counts: bool = True) -> None:
        self.max_ngram = max_ngram
        self.ends: list[dict[tuple, int]] = [{} for _ in range(max_ngram + 1)]  # [n][n-gram] -> end index
        # [n][n-gram] -> {next: times}
        self.counts: list[dict[tuple, dict[int, int]]] | None = [{} for _ in range(max_ngram + 1)] if counts else None
        self.src: list[int] | None = None
        self.done = 0  # n-grams ending before this index are indexed (ends in [1, len) of the list)
        self.last = None  # the token at done - 1 when indexed (a list edited in place is re-indexed)

    @classmethod
    def over(cls, index: NgramIndex | None, toks: list[int], max_ngram: int, counts: bool = True) -> NgramIndex:
        """`index` brought up to date with toks, or a new one if toks is not the list it follows."""
        if index is None or index.max_ngram != max_ngram or not index.follows(toks) or \
                (index.counts is not None) != counts:
            index = cls(max_ngram, counts)
        index.extend(toks)
        return index

    def follows(self, toks: list[int]) -> bool:
        """Whether toks is the list this index was built on, only appended to since."""
        return toks is self.src and len(toks) >= self.done and (self.done == 0 or toks[self.done - 1] == self.last)

    def extend(self, toks: list[int]) -> None:
        self.src = toks
        counts, ends = self.counts, self.ends
        for e in range(max(self.done, 1), len(toks)):
            nxt = toks[e]
            for n in range(1, min(e, self.max_ngram) + 1):
                gram = tuple(toks[e - n:e])
                ends[n][gram] = e
                if counts is None:
                    continue
                seen = counts[n].get(gram)
                if seen is None:
                    counts[n][gram] = {nxt: 1}
                else:
                    seen[nxt] = seen.get(nxt, 0) + 1
        self.done = max(self.done, len(toks))
        self.last = toks[self.done - 1] if self.done else None

    def latest(self, ngram: list[int] | tuple) -> int | None:
        """The index just past the latest earlier occurrence of ngram (not the list's own suffix)."""
        return self.ends[len(ngram)].get(tuple(ngram))

    def following(self, ngram: tuple) -> dict[int, int] | None:
        """How many times each token followed ngram earlier in the list (None: it never occurred, or no counts)."""
        return None if self.counts is None else self.counts[len(ngram)].get(ngram)


class LookupOptions(Options):
    chain_len: int = option(8, "tokens copied per step", ge=1, aliases=("num_tokens",))
    max_ngram: int = option(3, "longest n-gram matched", ge=1)
    min_ngram: int = option(1, "shortest n-gram matched", ge=1)


register(Method("pld", "prompt lookup: copy what followed the last n-gram earlier in the context", LookupOptions,
                lambda t, o: PromptLookupDrafter(o.max_ngram, o.min_ngram, o.chain_len)))
