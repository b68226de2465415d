"""N-gram drafting over the prompt and everything generated so far, after SuffixDecoding (Oliaro et al.
2024): find the longest earlier occurrence of the context's suffix, and grow a draft tree best first
from what followed it, branching where the continuation counts disagree. No model, no training.

Where SuffixDecoding walks a suffix tree, this reads the incremental n-gram index prompt lookup uses
(prompt_lookup.NgramIndex: n <= max_ngram, O(new tokens) a step) and follows the latest occurrence of
a max_ngram-gram further back to measure longer matches. Each node's drafted token x gets a confidence,
the chance it is right given its parent was: with counts c(x) of the continuations of the matched
n-gram (total C, length n), c(x) / (C + KAPPA / n) (a continuation not seen yet keeps KAPPA / n of
the mass: short matches guess, long ones copy); where the latest occurrence matches L > n tokens, its
follower gets at least 1 / (1 + KAPPA / L) and the others share the rest. A node's score is the log
of its path's product of confidences (EAGLE-2's value V), so its nodes come best first and any prefix
of them is a tree: a caller verifies as many as pay (drafters/policy.py calibrates the confidences
and prices each prefix).

Like SuffixDecoding's global tree, earlier answers help too: each finished answer of the drafter and
its forks goes into a shared History (bounded), which supplies the counts where the request's own text
has no match as long (n >= HISTORY_MIN_N): a coding assistant's answers repeat each other's idioms.

Drafts are point masses (no q): the verifier stays exact at any temperature, and they merge with
other point-mass drafts (drafters/union.py).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading

import torch

from specdec.drafters.base import DecodeContext, Drafter
from specdec.drafters.prompt_lookup import KAPPA, NgramIndex
from specdec.drafters.registry import Method, Options, option, register
from specdec.errors import SpecdecError
from specdec.tree import Allowed, DraftTree

MAX_MATCH = 64  # longest match measured (beyond it a copy is as sure as it gets)
HISTORY_TOKENS = 16384  # earlier answers' tokens kept (the n-gram index costs ~1 kB a token)
HISTORY_MIN_N = 3  # shorter matches in other answers guess worse than the request's own text
SEP = -1  # between answers: no context contains it, and it is never drafted


class History:
    """Earlier answers' tokens and their n-gram index, shared by a drafter and its forks (and their
    threads: a lock, and counts handed out as copies). At most `cap` tokens: past that, the older half is
    dropped."""

    def __init__(self, max_ngram: int, cap: int = HISTORY_TOKENS) -> None:
        self.max_ngram, self.cap = max_ngram, cap
        self.tokens: list[int] = []
        self.index = NgramIndex(max_ngram)
        self.lock = threading.Lock()

    def add(self, answer: list[int]) -> None:
        if not answer:
            return
        with self.lock:
            self.tokens.extend(answer[-self.cap:])
            self.tokens.append(SEP)
            if len(self.tokens) > self.cap:  # keep the newer half, from an answer's start
                keep = self.tokens[-(self.cap // 2):]
                cut = keep.index(SEP) + 1 if SEP in keep[:-1] else 0
                self.tokens, self.index = keep[cut:], NgramIndex(self.max_ngram)
            self.index.extend(self.tokens)

    def following(self, gram: tuple) -> tuple[dict[int, int], int] | None:
        """(how often each token followed gram in earlier answers, the latest occurrence's follower)."""
        with self.lock:
            counts = self.index.following(gram)
            if counts is None:
                return None
            counts = {x: c for x, c in counts.items() if x != SEP}
            latest = self.tokens[self.index.latest(gram)]
        if not counts:
            return None
        return counts, latest if latest != SEP else max(counts, key=counts.get)


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, tree_size: int = 16, topk: int = 2, max_ngram: int = 6, min_value: float = 0.0,
                 history: int | History = HISTORY_TOKENS) -> None:
        """history: a History to share, or how many earlier answers' tokens to keep (0: none)."""
        bad_history = not isinstance(history, History) and history < 0
        if tree_size < 1 or topk < 1 or max_ngram < 1 or not 0.0 <= min_value < 1.0 or bad_history:
            raise SpecdecError(f"n-gram drafting needs tree_size, topk, max_ngram >= 1, 0 <= min_value < 1 and "
                               f"history >= 0, got tree_size={tree_size}, topk={topk}, max_ngram={max_ngram}, "
                               f"min_value={min_value}, history={history}")
        self.tree_size, self.topk, self.max_ngram, self.min_value = tree_size, topk, max_ngram, min_value
        self.draft_depth = tree_size
        self.index: NgramIndex | None = None
        if isinstance(history, History):
            self.history: History | None = history
        else:
            self.history = History(max_ngram, history) if history > 0 else None

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.tree_size, self.topk, self.max_ngram, self.min_value, self.history or 0)

    def begin(self, ctx: DecodeContext) -> None:
        self.index = None

    def end(self, answer: list[int]) -> None:
        if self.history is not None:
            self.history.add(answer)

    def propose(self, ctx: DecodeContext) -> DraftTree:
        k = min(self.tree_size, ctx.max_nodes)
        toks = ctx.tokens
        if k < 1 or len(toks) < 2:
            return DraftTree.empty()
        self.index = NgramIndex.over(self.index, toks, self.max_ngram)
        tokens: list[int] = []
        parents: list[int] = []
        logv: list[float] = []
        # (-value, push order, parent, token, path to it, the n-gram its parent matched)
        heap: list[tuple[float, int, int, int, tuple, int]] = []
        order = itertools.count()  # equal values: the earlier pushed first (a parent's better child first)
        self._push(heap, order, toks, (), -1, 1.0, self.max_ngram, ctx.allowed)
        while heap and len(tokens) < k:
            neg, _, parent, tok, path, n = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            logv.append(math.log(-neg))
            if len(tokens) < k:  # a node matches at most one token more than its parent did
                self._push(heap, order, toks, path, len(tokens) - 1, -neg, n + 1, ctx.allowed)
        if not tokens:
            return DraftTree.empty()
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(logv))

    def scored(self, ctx: DecodeContext) -> tuple[list[int], list[int], list[float], DraftTree]:
        """propose() with each node's parent and confidence given its parent (from the path values), for a
        caller that prices its prefixes (`auto`)."""
        tree = self.propose(ctx)
        s, par = tree.scores.tolist() if len(tree) else [], tree.parents.tolist()
        return tree.tokens.tolist(), par, [math.exp(v - (s[p] if p >= 0 else 0.0)) for v, p in zip(s, par)], tree

    def _push(self, heap: list, order, toks: list[int], path: tuple, node: int, value: float, longest: int,
              allowed: Allowed | None) -> None:
        found, n = self.continuations(toks, path, longest)
        if allowed is not None and found:  # under a grammar: the likeliest continuations it allows
            found = [found[i] for i in allowed(list(path), [x for x, _ in found], self.topk)]
        for tok, conf in found[: self.topk]:
            v = value * conf
            if v > self.min_value:
                heapq.heappush(heap, (-v, next(order), node, tok, path + (tok,), n))

    def continuations(self, toks: list[int], path: tuple = (), longest: int | None = None) -> tuple[list, int]:
        """(token, confidence) of what may follow toks + path, most confident first (ties: the latest
        occurrence's follower), from the counts of the longest n-gram suffix (n <= longest) that occurred
        before; and that n (0: none)."""
        index, seq = self.index, toks[-self.max_ngram:] + list(path)
        for n in range(min(self.max_ngram, len(seq), longest or self.max_ngram), 0, -1):
            gram = tuple(seq[-n:])
            counts = index.following(gram)
            if counts is not None:
                end = index.latest(gram)
                latest = toks[end]
                length = self._match_length(toks, path, end, n) if n == self.max_ngram else n
                break
            earlier = self.history.following(gram) if self.history is not None and n >= HISTORY_MIN_N else None
            if earlier is not None:
                (counts, latest), length = earlier, n
                break
        else:
            return [], 0
        total = sum(counts.values())
        floor = KAPPA / n
        c_latest = counts[latest] / (total + floor)
        if length > n:  # its occurrence matches further back than the n-gram the counts are of
            c_latest = max(c_latest, 1.0 / (1.0 + KAPPA / length))
        rest = total - counts[latest] + floor  # the others share what the latest follower leaves
        out = [(x, c_latest if x == latest else (1.0 - c_latest) * c / rest) for x, c in counts.items()]
        out.sort(key=lambda xc: (-xc[1], xc[0] != latest))
        return out, n

    @staticmethod
    def _match_length(toks: list[int], path: tuple, end: int, n: int) -> int:
        """How far back toks + path agrees with the text before toks[end] (>= n, at most MAX_MATCH)."""
        p = len(path)
        length = n
        while length < MAX_MATCH and end - length - 1 >= 0:
            back = length + 1  # the token `back` places from the end of toks + path
            mine = path[p - back] if back <= p else toks[len(toks) - (back - p)] if back - p <= len(toks) else None
            if mine is None or mine != toks[end - length - 1]:
                break
            length += 1
        return length


class NgramOptions(Options):
    tree_size: int = option(8, "nodes kept at most (the best first)", ge=1)
    topk: int = option(1, "continuations kept per node (1: a chain)", ge=1)
    max_ngram: int = option(6, "longest n-gram indexed (longer matches are followed along their latest occurrence)",
                            ge=1)
    min_value: float = option(0.1, "drop nodes whose path confidence is below this", ge=0.0, le=0.99)
    history: int = option(HISTORY_TOKENS, "earlier answers' tokens kept for matches (0: this request's text only)",
                          ge=0)


register(Method("ngram", "n-gram lookup over the prompt, the answer so far and earlier answers (SuffixDecoding-"
                "style): the continuations of the longest earlier match, best first", NgramOptions,
                lambda t, o: NgramDrafter(o.tree_size, o.topk, o.max_ngram, o.min_value, o.history)))
