"""Structured output: the answer constrained to a JSON schema, a regex or a Lark grammar (llguidance).

Lossless under the constraint: every verified row's logits are masked by the grammar state its path
reaches, so greedy picks the best allowed token and sampling draws from the target's distribution
renormalised over the allowed tokens (the mask comes before temperature, top-k and top-p, as in
llama.cpp and vLLM). A drafted token the grammar forbids is pruned with its subtree before the verify;
where the grammar allows one continuation, those tokens join the draft for free (jump-forward)."""

from __future__ import annotations

import functools
import json
import threading
import time

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from specdec.errors import SpecdecError
from specdec.sampling import argmax_rows
from specdec.tree import DraftTree

KINDS = ("json_schema", "json_object", "regex", "grammar")  # GenerationParams' fields that constrain
FORCED_MAX = 16  # forced tokens drafted at most per step (a long literal keeps coming the next step)


@functools.lru_cache(maxsize=64)  # GenerationParams checks it when made, the Decoder reads it per request
def compile_grammar(kind: str, source: str | bool) -> str:
    """llguidance's grammar text for one constraint, checked: a bad schema, regex or grammar is one
    SpecdecError naming the parameter, before any model loads."""
    M = llguidance.LLMatcher
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"json_schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise SpecdecError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        grammar = M.grammar_from_json_schema(source)
    elif kind == "json_object":
        grammar = M.grammar_from_json_schema('{"type": "object"}')
    elif kind == "regex":
        grammar = M.grammar_from_regex(source)
    elif kind == "grammar":
        text = source
        if "::=" in text:  # GBNF (llama.cpp's grammar files): llguidance reads it as Lark
            try:
                text = gbnf_to_lark(text)
            except Exception as e:
                raise SpecdecError(f"grammar: not a valid GBNF grammar: {_first_line(str(e))}") from None
        grammar = M.grammar_from_lark(text)
    else:
        raise ValueError(f"unknown constraint {kind!r}")
    error = M.validate_grammar(grammar)
    if error:
        raise SpecdecError(f"{kind}: {_first_line(error)}")
    return grammar


def _first_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines()[:3] if line.strip())


class Vocabulary:
    """A tokenizer as llguidance reads it, built once per Decoder on first use (~1.5 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, frozenset(eos_ids)
        self._ll = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._ll is None:
                import llguidance.hf  # imports transformers' tokenizer classes

                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                        eos_token=sorted(self.eos_ids) or None)
            return self._ll

    def constraint(self, grammar: str, greedy: bool = False) -> Constraint:
        return Constraint(llguidance.LLMatcher(self.get(), grammar), self.vocab_size, self.eos_ids, greedy)


class Constraint:
    """One request's grammar state. Each step: `plan(tree)` prunes the draft to what the grammar allows
    along the tree's paths (consume a node's token going down, roll back coming up); `mask(logits)` masks
    the verify forward's rows by their own states; `consume(tokens)` advances by what was emitted.

    Greedy (`greedy`): the verifier reads each row's argmax alone, and where the grammar allows the raw
    argmax it is the masked one too (masking only lowers other tokens), so a row's mask is computed only
    when its argmax is forbidden; otherwise every row's mask is computed at plan()."""

    def __init__(self, matcher, vocab_size: int, eos_ids: frozenset[int], greedy: bool = False) -> None:
        self.m, self.vocab_size, self.eos_ids, self.greedy = matcher, vocab_size, eos_ids, greedy
        self.words = (vocab_size + 31) // 32
        self._masks = torch.zeros(0, self.words, dtype=torch.int32)
        self._paths: list[list[int]] = []  # greedy: each planned row's path of tokens after the root
        self.mask_s = 0.0  # seconds spent on the grammar (the benchmark's mask time per step)
        self.pruned = 0  # drafted nodes it forbade

    def forced(self) -> list[int]:
        """The tokens the grammar forces next, if any (a key, `": "`, a closing brace)."""
        return list(self.m.compute_ff_tokens()[:FORCED_MAX])

    def plan(self, tree: DraftTree, max_nodes: int) -> DraftTree:
        """The draft cut to the grammar (and, unless greedy, every kept row's mask computed for `mask`). A
        node whose token its parent's state forbids is dropped with its subtree: p(x) = 0 rejects it surely,
        and for a point mass that rejection leaves p as it was. A sampled node (T > 0) stays, without its
        subtree: its rejection moves the residual its later siblings are judged by, so dropping it would not
        be exact. Forced tokens join a deterministic draft as a chain, before the drafter's nodes."""
        t0 = time.perf_counter()
        if tree.draft_probs is None and max_nodes > 0:
            forced = self.forced()
            if forced:
                chain = DraftTree.chain(torch.tensor(forced[:max_nodes], device=tree.tokens.device))
                tree = chain.union(tree) if len(tree) else chain
                if len(tree) > max_nodes:  # topological order: a prefix is a tree
                    tree = tree.select(torch.arange(max_nodes))
        toks, children = tree.tokens.tolist(), tree.children()
        sampled = tree.draft_probs is not None and not self.greedy
        keep: list[int] = []
        bits_of: dict[int, torch.Tensor] = {}  # node (-1: the root) -> the mask of its row
        path_of: dict[int, list[int]] = {-1: []}
        m = self.m

        def visit(node: int) -> None:  # the matcher stands at the state after node's path
            bits = None if self.greedy else self._fill()
            bits_of[node] = bits
            for c in children[node + 1]:
                x = toks[c]
                if not (self._allows([], x) if bits is None else (bits[x >> 5] >> (x & 31)) & 1):
                    if sampled:
                        keep.append(c)
                        bits_of[c] = bits  # never read: the node is surely rejected
                    continue
                keep.append(c)
                path_of[c] = path_of[node] + [x]
                if x in self.eos_ids:  # the answer ends there: nothing below it is verified
                    bits_of[c] = bits
                    continue
                if not m.consume_token(x):
                    raise RuntimeError(f"the grammar allowed token {x} but refused it: {m.get_error()}")
                visit(c)
                m.rollback(1)

        visit(-1)
        keep.sort()
        self.pruned += len(tree) - len(keep)
        if len(keep) < len(tree):
            tree = tree.select(torch.tensor(keep, dtype=torch.long))
        if self.greedy:
            self._paths = [[]] + [path_of[i] for i in keep]
        else:
            self._masks = torch.stack([bits_of[-1]] + [bits_of[i] for i in keep])
        self.mask_s += time.perf_counter() - t0
        return tree

    def allowed(self, path: list[int], candidates: list[int], k: int) -> list[int]:
        """tree.Allowed: the indices of the first k candidates the grammar allows after `path` (tokens drafted
        after the root, each allowed), checked one by one without computing a mask."""
        t0 = time.perf_counter()
        out = []
        for i, x in enumerate(candidates):
            if self._allows(path, x):
                out.append(i)
                if len(out) == k:
                    break
        self.mask_s += time.perf_counter() - t0
        return out

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The planned rows' logits, what each row's state forbids set to -inf (greedy: only in rows whose
        argmax it forbids; the other rows' argmax is already the masked one)."""
        t0 = time.perf_counter()
        if self.greedy:
            out = self._greedy_mask(logits)
        else:
            out = _masked(logits, self._masks[: logits.shape[0]])
        self.mask_s += time.perf_counter() - t0
        return out

    def _greedy_mask(self, logits: torch.Tensor) -> torch.Tensor:
        m, out = self.m, logits
        for r, x in enumerate(argmax_rows(logits)):
            path = self._paths[r]
            if path and path[-1] in self.eos_ids:  # nothing follows an end: the row is never read
                continue
            if self._allows(path, x):
                continue
            for t in path:
                m.consume_token(t)
            bits = self._fill()
            m.rollback(len(path))
            if out is logits:
                out = logits.clone()
            out[r] = _masked(logits[r : r + 1], bits[None])[0]
        return out

    def consume(self, tokens: list[int]) -> None:
        """Advance by the emitted tokens (an end token stops the grammar)."""
        for x in tokens:
            if self.m.is_stopped():
                return
            if not self.m.consume_token(x):
                raise RuntimeError(f"the grammar refused the emitted token {x}: {self.m.get_error()}")

    def _allows(self, path: list[int], x: int) -> bool:
        """Whether the grammar allows x after path (from the current state), without a mask. A stopped matcher
        (the grammar complete) validates nothing, though its mask allows the end: checked apart."""
        if x >= self.vocab_size:
            return False
        n = self.m.validate_tokens(path + [x])
        if n == len(path) + 1:
            return True
        if n < len(path) or x not in self.eos_ids:
            return False
        for t in path:
            self.m.consume_token(t)
        stopped = self.m.is_stopped()
        self.m.rollback(len(path))
        return stopped

    def _fill(self) -> torch.Tensor:
        bits = torch.empty(self.words, dtype=torch.int32)
        self.m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        return bits


def _masked(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with what each row's mask bits [n, words] forbid set to -inf."""
    allowed = torch.from_numpy(np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little").view(np.bool_))
    v = logits.shape[-1]
    if allowed.shape[-1] < v:  # ids past the tokenizer's vocabulary (padding rows of an LM head)
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], v - allowed.shape[-1])], -1)
    return torch.where(allowed[:, :v].to(logits.device), logits, float("-inf"))
