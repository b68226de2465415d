"""Classic speculative sampling with a small LM that shares the target's tokenizer
(Leviathan et al. 2023; Chen et al. 2023): a sampled chain of chain_len tokens, or a top-k tree."""

from __future__ import annotations

import copy
from collections.abc import Generator
from dataclasses import astuple
from typing import Literal

import torch

from specdec.drafters.base import DecodeContext, Drafting, TreeDrafter
from specdec.drafters.forwards import RunnerForward
from specdec.drafters.registry import Method, Options, Target, option, register
from specdec.errors import SpecdecError
from specdec.runtime.base import ForwardOut, Runner
from specdec.runtime.loading import Runtime, build_runner, check_same_vocab
from specdec.sampling import probs_from_logits, sample, tempered_log_probs
from specdec.tree import WIDEN, Allowed, DraftTree, NodeSlots, TreeBudget, dynamic_tree, grow
from specdec.vocab import draft_vocab

DRAFT_VOCAB = 32768  # ids a draft model scores by default: see docs/benchmarks.md for the coverage measured
# blocks a GGUF draft's matrices are re-quantized to by default: see docs/benchmarks.md for what it gives
DRAFT_QUANT = "q4_0"
MAX_EXTRA = 2048  # the request's own ids a reduced draft vocabulary scores besides (fp32 rows)


class DraftModelDrafter(TreeDrafter):
    def __init__(self, runner: Runner, target_vocab: int, chain_len: int = 4, tree: TreeBudget | None = None) -> None:
        """tree None: a chain of `chain_len` tokens sampled from the draft (exact SpS). Else an
        EAGLE-2-style top-k tree of that budget."""
        if chain_len < 1:
            raise ValueError("chain_len must be >= 1")
        self.runner, self.chain_len, self.tree = runner, chain_len, tree
        self.name = "sps" if tree is None else "sps-tree"
        self.draft_depth = chain_len if tree is None else tree.depth
        self.target_vocab = target_vocab
        self.cached: list[int] = []  # tokens whose KV the draft cache holds (committed)
        # a reduced vocabulary (restrict_head) also scores the request's own tokens outside it
        self.fixed: torch.Tensor | None = None
        if runner.head_ids is not None:
            self.fixed = torch.zeros(max(target_vocab, int(runner.head_ids.max()) + 1), dtype=torch.bool)
            self.fixed[runner.head_ids.cpu()] = True
        self.extra: list[int] = []
        self.scanned = 0  # context tokens looked at for ids outside the reduced vocabulary

    def fork(self) -> DraftModelDrafter | None:
        runner = self.runner.fork()
        if runner is None:
            return None
        d = copy.copy(self)  # the draft model's weights shared: the cache is the fork's own
        d.runner, d.cached, d.extra = runner, [], []
        return d

    def begin(self, ctx: DecodeContext) -> None:
        self.runner.reset()
        self.cached = []
        if self.fixed is not None:
            self.extra, self.scanned = [], 0
            self.runner.score_also([])

    def _score_context(self, tokens: list[int]) -> None:
        """Let the draft propose the request's own tokens too: ids of the context outside the reduced
        vocabulary join its head (a prompt's names and rare words are what an answer repeats)."""
        have = set(self.extra)
        new = [t for t in dict.fromkeys(tokens[self.scanned:])
               if t < self.fixed.numel() and not self.fixed[t] and t not in have]
        self.scanned = len(tokens)
        if new and len(self.extra) < MAX_EXTRA:
            self.extra = self.extra + new[:MAX_EXTRA - len(self.extra)]
            self.runner.score_also(self.extra)

    def _catch_up(self, tokens: list[int]) -> Generator[RunnerForward, ForwardOut, torch.Tensor]:
        """Bring the draft cache to `tokens` (reusing the common prefix); logits after the last one."""
        common = 0
        for a, b in zip(self.cached, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # feed at least the root to get its logits
        if self.fixed is not None:
            self._score_context(tokens)
        self.runner.truncate(common)
        feed = tokens[common:]
        out = yield RunnerForward(self.runner, torch.tensor(feed), logits_rows=slice(-1, None))
        self.runner.commit(range(len(feed)))
        self.cached = list(tokens)
        return out.logits[-1]

    def _argmax(self, raw: torch.Tensor) -> int:
        """The draft's likeliest target id from its own logits (a reduced vocabulary's columns), without
        spreading them over the target's whole vocabulary first (~0.5 ms a draft token at 152k ids)."""
        i = int(raw.argmax())
        x = int(self.runner.head_ids[i]) if self.runner.head_ids is not None else i
        return x if x < self.target_vocab else int(self._pad(raw).argmax())  # a padding id: the slow way

    def _pad(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's ids: a reduced vocabulary's columns put back (the rest -inf)."""
        v = self.target_vocab
        ids = self.runner.head_ids
        if ids is not None:  # every id it scores is below fixed's size (the fixed set, or a context id)
            width = self.fixed.numel() if self.fixed is not None else max(v, int(ids.max()) + 1)
            full = logits.new_full((*logits.shape[:-1], width), float("-inf"))
            full[..., ids] = logits
            logits = full
        # some pairs pad their embedding tables differently; extra rows are never-used ids
        if logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:
            return logits[..., :v]
        return torch.nn.functional.pad(logits, (0, v - logits.shape[-1]), value=float("-inf"))

    def drafting(self, ctx: DecodeContext, budget: TreeBudget | None = None) -> Drafting:
        """budget: this call's size instead of the drafter's own (a chain drafts budget.depth tokens)."""
        # a draft with a shorter context window than the target's stops drafting where its window ends:
        # the engine then takes plain target steps (still exact) instead of the draft failing mid-answer
        tree = (budget or self.tree) if self.tree is not None else None
        window = self.runner.max_length - len(ctx.tokens)
        room = min(ctx.max_nodes, window)
        depth = min(budget.depth if budget is not None else self.draft_depth, room)
        # a tree's expansion feeds up to topk rows per depth through the draft before it is cut down
        if depth <= 0 or (tree is not None and tree.topk * tree.depth > window):
            return DraftTree.empty()
        raw = yield from self._catch_up(ctx.tokens)
        if tree is not None:
            return (yield from self._tree(ctx, self._pad(raw), tree.capped(room)))
        toks, qs = [], []
        for i in range(depth):
            if ctx.params.greedy and ctx.allowed is None:  # a greedy chain keeps no q (a point mass)
                x = self._argmax(raw)
            else:
                q = probs_from_logits(self._pad(raw), ctx.params)
                if ctx.params.greedy:
                    x = _best_allowed(q, toks, ctx.allowed)
                    if x is None:  # the grammar allows none of the likeliest tokens here: the chain ends
                        depth = i
                        break
                elif ctx.coupling is not None:  # the likeliest match of the target's draw at this position
                    x = ctx.coupling.pick(q, len(ctx.tokens) + i)
                else:
                    x = sample(q, ctx.generator)
                qs.append(q)
            toks.append(x)
            if i + 1 < depth:
                raw = (yield RunnerForward(self.runner, torch.tensor([x]))).logits[-1]
        if not toks:
            return DraftTree.empty()
        self.runner.commit(range(depth - 1))  # a chain continuing ctx: reusable if accepted
        self.cached = ctx.tokens + toks[:-1]
        return DraftTree.chain(torch.tensor(toks), None if ctx.params.greedy else torch.stack(qs))

    def _tree(self, ctx: DecodeContext, logits: torch.Tensor, budget: TreeBudget) -> Drafting:
        # top-k children are deterministic: the verifier treats them as point masses (lossless at T>0)
        slots, root_pos = NodeSlots(), len(ctx.tokens) - 1
        committed = self.runner.length

        def step(sel, tokens, parents):
            mask = slots.mask(sel, parents, committed)
            pos = torch.tensor([root_pos + _depth(n, parents) for n in sel])
            out = yield RunnerForward(self.runner, torch.tensor([tokens[i] for i in sel]), pos, mask)
            lp = tempered_log_probs(self._pad(out.logits), ctx.params)
            # a seeded request: rank by log q + the noise of the target's draw at the children's position
            return lp if coupling is None else coupling.perturb(lp, (pos + 1).tolist())

        coupling = None if ctx.params.greedy else ctx.coupling
        root_lp = tempered_log_probs(logits, ctx.params)
        if coupling is not None:
            root_lp = coupling.perturb(root_lp[None], [root_pos + 1])[0]
        tree = yield from grow(dynamic_tree(root_lp, *astuple(budget), allowed=ctx.allowed), step)
        self.runner.rollback()
        return tree


def _best_allowed(q: torch.Tensor, path: list[int], allowed: Allowed | None) -> int | None:
    """The likeliest token (under a grammar: the likeliest of the WIDEN it allows after path; None: none)."""
    if allowed is None:
        return int(q.argmax())
    top = torch.topk(q, min(WIDEN, q.numel())).indices.tolist()
    ok = allowed(path, top, 1)
    return top[ok[0]] if ok else None


def _depth(node: int, parents: list[int]) -> int:
    d = 1
    while parents[node] >= 0:
        node = parents[node]
        d += 1
    return d


# ---- registration ----

DraftQuant = Literal["file", "q4_0", "q4_1"]


def draft_quant_option():
    return option(DRAFT_QUANT, "a GGUF draft model's matrices re-quantized at load to these blocks (a draft step "
                  "reads fewer bytes; the target still verifies every token); file: as the file stores them")


class DraftVocabOptions(Options):
    draft_vocab: int = option(DRAFT_VOCAB, "the draft model's LM head scores only this many of the most frequent "
                              "token ids (FR-Spec; the target still verifies every draft); 0: the whole vocabulary",
                              ge=0)
    draft_quant: DraftQuant = draft_quant_option()


class ChainOptions(DraftVocabOptions):
    chain_len: int = option(4, "tokens drafted per step", ge=1, aliases=("gamma",))


class TreeOptions(DraftVocabOptions):
    depth: int = option(4, "draft steps from the root", ge=1, aliases=("gamma",))
    topk: int = option(4, "children per expanded node", ge=1)
    tree_size: int = option(8, "nodes kept in the tree", ge=1, aliases=("tree_tokens", "total_tokens"))


def draft_runner(target: Target, vocab: int = 0, quant: DraftQuant = "file") -> Runner:
    """The draft model's runner; vocab > 0: its LM head over that many of the most frequent ids (vocab.py);
    quant: its matrices' blocks (Runner.requantize)."""
    if target.draft_model is None:
        raise SpecdecError("a draft-model method needs a draft model: pass draft=<HF dir or .gguf>")
    if target.tokenizer is not None and target.draft_tokenizer is not None:
        check_same_vocab(target.tokenizer, target.draft_tokenizer)
    rt = target.runtime or Runtime()
    runner = build_runner(target.draft_model, rt.model_copy(update={"weights": None}))  # the draft's own dtype
    ids = draft_vocab(target.draft_tokenizer or target.tokenizer, runner.vocab_size, vocab)
    if ids is not None:
        runner.restrict_head(ids)
    if quant != "file":
        from gguf import GGMLQuantizationType

        runner.requantize(int(GGMLQuantizationType[quant.upper()]))
    return runner


register(Method("sps", "a draft LM with the same tokenizer: a sampled chain (Leviathan et al.; Chen et al.)",
                ChainOptions,
                lambda t, o: DraftModelDrafter(draft_runner(t, o.draft_vocab, o.draft_quant), t.runner.vocab_size,
                                               o.chain_len),
                needs_draft=True))
register(Method("sps-tree", "a draft LM with the same tokenizer: an EAGLE-2-style dynamic top-k tree", TreeOptions,
                lambda t, o: DraftModelDrafter(draft_runner(t, o.draft_vocab, o.draft_quant), t.runner.vocab_size,
                                               tree=TreeBudget(o.depth, o.topk, o.tree_size)),
                needs_draft=True))
