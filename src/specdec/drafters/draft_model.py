"""Classic speculative sampling with a small LM that shares the target's tokenizer
(Leviathan et al. 2023; Chen et al. 2023): a sampled chain of gamma tokens, or a top-k tree."""

from __future__ import annotations

import torch

from specdec.drafters.base import DecodeContext, Drafter
from specdec.sampling import probs_from_logits, sample
from specdec.target.base import Runner
from specdec.tree import DraftTree, NodeSlots, build_dynamic_tree


class DraftModelDrafter(Drafter):
    name = "sps"

    def __init__(self, runner: Runner, target_vocab: int, gamma: int = 4, tree_topk: int = 0,
                 tree_tokens: int = 8) -> None:
        """tree_topk 0: a chain of `gamma` tokens sampled from the draft (exact SpS). tree_topk k > 0:
        an EAGLE-2-style tree of depth gamma, k children per expanded node, `tree_tokens` nodes kept."""
        if gamma < 1 or tree_topk < 0 or tree_tokens < 1:
            raise ValueError("gamma and tree_tokens must be >= 1, tree_topk >= 0")
        self.runner, self.gamma, self.topk, self.tree_tokens = runner, gamma, tree_topk, tree_tokens
        self.target_vocab = target_vocab
        self.cached: list[int] = []  # tokens whose KV the draft cache holds (committed)

    def begin(self, ctx: DecodeContext) -> None:
        self.runner.reset()
        self.cached = []

    def _catch_up(self, tokens: list[int]) -> torch.Tensor:
        """Bring the draft cache to `tokens` (reusing the common prefix); logits after the last one."""
        common = 0
        for a, b in zip(self.cached, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # feed at least the root to get its logits
        self.runner.truncate(common)
        feed = tokens[common:]
        out = self.runner.forward(torch.tensor(feed), logits_rows=slice(-1, None))
        self.runner.commit(range(len(feed)))
        self.cached = list(tokens)
        return self._pad(out.logits[-1])

    def _pad(self, logits: torch.Tensor) -> torch.Tensor:
        # some pairs pad their embedding tables differently; extra rows are never-used ids
        v = self.target_vocab
        if logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:
            return logits[..., :v]
        return torch.nn.functional.pad(logits, (0, v - logits.shape[-1]), value=float("-inf"))

    def propose(self, ctx: DecodeContext) -> DraftTree:
        depth = min(self.gamma, ctx.max_nodes)
        if depth <= 0:
            return DraftTree.empty()
        logits = self._catch_up(ctx.tokens)
        if self.topk:
            return self._tree(ctx, logits, depth)
        toks, qs = [], []
        for i in range(depth):
            q = probs_from_logits(logits, ctx.params)
            x = int(q.argmax()) if ctx.params.greedy else sample(q, ctx.generator)
            toks.append(x)
            qs.append(q)
            if i + 1 < depth:
                logits = self._pad(self.runner.forward(torch.tensor([x])).logits[-1])
        self.runner.commit(range(depth - 1))  # a chain continuing ctx: reusable if accepted
        self.cached = ctx.tokens + toks[:-1]
        return DraftTree.chain(torch.tensor(toks), None if ctx.params.greedy else torch.stack(qs))

    def _tree(self, ctx: DecodeContext, logits: torch.Tensor, depth: int) -> DraftTree:
        # top-k children are deterministic: the verifier treats them as point masses (lossless at T>0)
        temp = ctx.params.temperature or 1.0
        slots, root_pos = NodeSlots(), len(ctx.tokens) - 1
        committed = self.runner.length

        def step(sel, tokens, parents):
            sel_l, par = sel.tolist(), parents.tolist()
            mask = slots.mask(sel_l, par, committed)
            pos = torch.tensor([root_pos + _depth(n, par) for n in sel_l])
            out = self.runner.forward(tokens[sel], pos, mask)
            return torch.log_softmax(self._pad(out.logits).float() / temp, dim=-1)

        tree = build_dynamic_tree(torch.log_softmax(logits.float() / temp, -1), step, depth, self.topk,
                                  min(self.tree_tokens, ctx.max_nodes))
        self.runner.rollback()
        return tree


def _depth(node: int, parents: list[int]) -> int:
    d = 1
    while parents[node] >= 0:
        node = parents[node]
        d += 1
    return d
