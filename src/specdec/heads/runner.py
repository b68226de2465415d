"""Batch-1 inference for an EagleHead (EAGLE or FSPAD variants) on the target's lean machinery:
llama.Block layers (the first without input norm), a kv.KVCache, explicit positions and a bool mask,
and the same commit/rollback protocol as the target runners."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from specdec.errors import SpecdecError
from specdec.heads.fspad import feature_sampler, gated_sample, pad_outputs
from specdec.runtime.base import Cached
from specdec.runtime.kv import KVCache
from specdec.runtime.lean import EXACT_ROWS
from specdec.runtime.llama import Block, PackedRows, Rope, chain_attention, make_room, native_stack
from specdec.runtime.packed import Linear
from specdec.tree import Allowed

if TYPE_CHECKING:  # heads.model imports transformers' Llama modules (seconds): drafting does not need them
    from specdec.heads.model import EagleHead


# one sequence's rows of a packed head forward: (its runner, tokens [n], features [n, H], positions, mask)
HeadPart = tuple["HeadRunner", torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


class _Rows(NamedTuple):
    """A fork's new rows in a head forward (HeadRunner._plan)."""
    kv: KVCache
    start: int
    n: int
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    few: bool  # few enough to attend row by row


class PadBlock(Block):
    """PAD's last layer: its doubled down_proj puts two halves of a 2H output, f's and f̃'s, on the same
    residual. Its MLP output keeps that 2H output (`out`) and returns the residual, to which the runner
    applies pad_outputs. With `tail_only` (rows no draft step continues from) it computes f̃'s half alone
    and adds it like any layer: the block returns f̃."""

    native = False  # its MLP output is its own (mlp_out)

    def __init__(self, layer, index: int, eps: float, pack: bool, weights: str | None) -> None:
        super().__init__(layer, index, eps, pack, weights)
        w, h = layer.mlp.down_proj, layer.mlp.down_proj.weight.shape[0] // 2
        self.tail = Linear(w.weight[h:], None if w.bias is None else w.bias[h:], pack, weights)
        self.out: torch.Tensor | None = None
        self.tail_only = False

    def mlp_out(self, y: torch.Tensor, h: torch.Tensor, fused: bool) -> torch.Tensor:
        if self.tail_only:
            return self.tail(y, h) if fused else h + self.tail(y)
        self.out = self.down(y)
        return h


class HeadRunner(Cached):
    aux_layers: tuple[int, ...] = ()  # target layers whose input hidden states target_input reads
    overflow = "the EAGLE head's cache would exceed {} rows"

    def __init__(self, head: EagleHead, embed: torch.Tensor,
                 lm_head: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
                 pack: bool = True, initial_capacity: int = 512, weights: str | None = None) -> None:
        cfg = head.config
        if embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise SpecdecError(f"target embeddings are {tuple(embed.shape)}, the EAGLE head expects "
                               f"{(cfg.vocab_size, cfg.hidden_size)}")
        # weights: the precision of the target it drafts for (a cheaper target wants a cheaper draft)
        self.weights = weights
        self._build(head, pack, weights)
        self.stack = native_stack(self.layers)
        self.fused = all(b.fused is not None for b in self.layers)
        self.embed = embed.detach()
        if head.lm_head is not None:
            self.lm = Linear(head.lm_head.weight, None, pack, weights)
        elif callable(lm_head) and not isinstance(lm_head, torch.Tensor):
            self.lm = lm_head
        elif lm_head is not None:
            self.lm = Linear(lm_head, None, pack, weights)
        else:
            raise SpecdecError("a full-vocabulary EAGLE head needs the target's LM head")
        self.d2t = None if head.d2t is None else head.d2t.detach().clone()
        self._d2t_ids: list[int] | None = None  # d2t as a list, for a grammar's checks
        self.hidden_size = cfg.hidden_size
        self.max_length = cfg.max_position_embeddings
        self.device, self.dtype = embed.device, head.layers[0].self_attn.q_proj.weight.dtype
        self.cache = KVCache(len(self.layers), cfg.num_key_value_heads, cfg.head_dim, self.max_length, self.device,
                             self.dtype, initial_capacity)
        self.rope = Rope(head.rotary_emb, self.device, self.dtype, self.max_length)
        self.rope.grow(self.cache.capacity)
        # The token's half of the connector depends on the token alone (EAGLE: W_e e + b; FSPAD: SiLU(gate(e))),
        # so over the draft vocabulary it is a table: one projection fewer per draft step. A full-vocabulary
        # head would need a table the size of the target's embeddings, so it keeps computing it.
        self.token_table = None if self.d2t is None else self._token_table()
        # forks' forwards pack (forward_many) only where every linear is row-invariant
        blocks = [x for b in self.layers for x in (b.qkv, b.o, b.gate_up, b.down)]
        linears = [self.lm, self.fc, getattr(self, "fc_f", None), *(self.sampler or []), *blocks,
                   getattr(self.pad_block, "tail", None)]
        self.exact_rows = EXACT_ROWS if all(getattr(x, "invariant", False) for x in linears if x is not None) else 0

    def fork(self) -> HeadRunner:
        """The same head with an empty cache of its own. Forks share the layers' per-forward scratch (PAD's
        tail, EAGLE-3's token rows): they run one at a time."""
        r = copy.copy(self)
        r.cache = self.cache.fresh(self.cache.capacity)
        return r

    def _build(self, head: EagleHead, pack: bool, weights: str | None) -> None:
        """The connector and the decoder layers."""
        cfg = head.config
        self.connector, self.pad = head.connector, head.pad
        if head.sampler is not None:
            s = head.sampler
            self.fc, self.sampler = None, [Linear(m.weight, None, pack, weights)
                                           for m in (s.gate_proj, s.up_proj, s.down_proj)]
        else:
            self.fc, self.sampler = Linear(head.fc.weight, head.fc.bias, pack, weights), None
            if head.d2t is not None:  # f's half alone, for rows whose token half comes from the table
                self.fc_f = Linear(head.fc.weight[:, cfg.hidden_size:], None, pack, weights)
        last = len(head.layers) - 1
        self.layers = [(PadBlock if head.pad and i == last else Block)(layer, i, cfg.rms_norm_eps, pack, weights)
                       for i, layer in enumerate(head.layers)]
        self.pad_block = self.layers[-1] if head.pad else None

    def target_input(self, features: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """What a committed row reads from the target (EagleHead.target_input): EAGLE's f_t."""
        return features

    @torch.inference_mode()
    def _token_table(self) -> torch.Tensor:
        e = self.embed[self.d2t].to(self.dtype)
        if self.sampler is not None:
            return F.silu(self.sampler[0](e))
        return self.fc(torch.cat([e, torch.zeros_like(e)], dim=-1))

    def _connect(self, tokens: torch.Tensor, f: torch.Tensor, draft: bool) -> torch.Tensor:
        """η for rows (x_{t+1}, f_t); draft: `tokens` are draft-vocabulary ids (the table's rows)."""
        if draft and self.token_table is not None:
            t = self.token_table[tokens]
            if self.sampler is not None:
                return gated_sample(t, f, self.sampler[1], self.sampler[2])
            return self.fc_f(f, t)
        if draft:
            tokens = self.to_target(tokens)
        e = F.embedding(tokens, self.embed).to(self.dtype)
        return self.fc(torch.cat([e, f], dim=-1)) if self.fc is not None else feature_sampler(e, f, *self.sampler)

    @property
    def family(self) -> int:
        """Runners whose forwards forward_many may pack (forks of this one) share this."""
        return id(self.layers)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, draft: bool = False,
                feature: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """tokens [n] target ids of x_{t+1} (draft=True: draft-vocabulary ids), features [n, H] f_t (target's
        or the head's own f̂); mask [n, cached + n] bool (default: causal after every cached row). Returns
        (f̂_{t+1}, the LM head's input) [n, H] each: the same tensor unless PAD (then f and f̃: draft on with f̂).
        feature=False: no draft step continues from these rows (a tree's last depth), so PAD skips f's half
        of its doubled down_proj and f̂ comes back None."""
        return self._run([(self, tokens, features, positions, mask)], draft, feature)[0]

    def forward_many(self, parts: Sequence[HeadPart], draft: bool = False,
                     feature: bool = True) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """forward for each part (a fork of this runner, tokens, features, positions, mask), each into its own
        cache, packed as LeanRunner.forward_many packs: the linears run once on all rows of forwards of at most
        exact_rows rows, each sequence attends over its own cache, and each row gets the bits it gets alone.
        Without exact rows each part runs alone."""
        outs: list = []
        group: list[HeadPart] = []

        def run(group: list[HeadPart]) -> None:
            if len(group) == 1:
                r, *args = group[0]
                outs.append(r.forward(*args, draft=draft, feature=feature))
            else:
                outs.extend(self._run(group, draft, feature))

        for part in parts:
            if group and sum(p[1].numel() for p in group) + part[1].numel() > self.exact_rows:
                run(group)
                group = []
            group.append(part)
        if group:
            run(group)
        return outs

    def _plan(self, runner: HeadRunner, tokens: torch.Tensor, positions: torch.Tensor | None,
              mask: torch.Tensor | None) -> _Rows:
        """Where a fork's new rows go in its cache and what they attend to."""
        n = tokens.numel()
        start, positions = runner._new_rows(n, positions, mask)
        kv = runner.cache
        make_room(kv, n, [self.rope])
        cos, sin = self.rope(positions)
        causal, few = False, n <= EXACT_ROWS
        if mask is not None:
            mask = mask.to(self.device)
        elif not (few and self.fused):  # the fused kernels read no mask as a chain
            mask, causal = chain_attention(start, n, self.device)
        return _Rows(kv, start, n, cos, sin, mask, causal, few)

    @torch.inference_mode()
    def _run(self, parts: Sequence[HeadPart], draft: bool,
             feature: bool) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """One forward over the new rows of several forks of this runner (one: a plain forward)."""
        plans = [self._plan(r, t, pos, m) for r, t, _, pos, m in parts]
        join = (lambda xs: xs[0]) if len(parts) == 1 else torch.cat
        h = self._connect(join([p[1].to(self.device) for p in parts]),
                          join([p[2].to(self.dtype) for p in parts]), draft)[None]
        if self.pad_block is not None:
            self.pad_block.tail_only = not feature
        sizes = [p.n for p in plans]
        packed = None
        if len(parts) > 1 and self.fused and all(p.few for p in plans):
            packed = PackedRows(torch.cat([p.cos.reshape(p.n, -1) for p in plans]),
                                torch.cat([p.sin.reshape(p.n, -1) for p in plans]),
                                [p.kv.k for p in plans], [p.kv.v for p in plans], [p.start for p in plans], sizes,
                                {None: [None if p.mask is None else p.mask.reshape(p.n, -1) for p in plans]})
        native = self._native(plans, packed)
        if native is not None:  # the loop below in one native call (llama.native_stack), bit for bit
            h = native(h[0])[None]
        for layer in self.layers if native is None else ():
            # the fused kernels attend row by row (cheaper than SDPA for a few rows)
            args = [(p.cos, p.sin, p.kv, p.start, p.mask, p.causal, True if layer.fused is not None and p.few else None)
                    for p in plans]
            if len(parts) == 1:
                h = layer(h, *args[0])
                continue
            qkv = layer.project(h)
            if packed is not None:
                a = layer.attend_many(qkv, packed, None)
            else:
                a = torch.cat([layer.attend(x, *arg) for x, arg in zip(qkv.split(sizes, dim=1), args)], dim=1)
            h = layer.finish(a, h)
        for p in plans:
            p.kv.n_pending += p.n
        f, g = self._outputs(h[0], feature)
        if len(parts) == 1:
            return [(f, g)]
        return list(zip([None] * len(parts) if f is None else f.split(sizes), g.split(sizes)))

    def _native(self, plans: list[_Rows], packed: PackedRows | None):
        """h [rows, H] -> h after every layer in one native call, where the loop would take the fused kernels
        (a few rows of one fork, or several forks packed); else None."""
        if self.stack is None:
            return None
        end = len(self.layers)
        if packed is not None:
            k = packed
            return lambda x: self.stack.forward_many(x, k.cos, k.sin, k.ks, k.vs, k.starts, k.sizes, [k.masks[None]],
                                                     0, end)
        p = plans[0]
        if len(plans) > 1 or not (p.few or p.n == 1):
            return None
        mask = None if p.mask is None else p.mask.reshape(p.n, -1)
        return lambda x: self.stack.forward(x, [p.cos.reshape(p.n, -1)], [p.sin.reshape(p.n, -1)], p.kv.k, p.kv.v,
                                            p.start, [mask], 0, end)

    def _outputs(self, h: torch.Tensor, feature: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(what the next draft step reads, the LM head's input) from the last layer's output [n, H]."""
        n = h.shape[0]
        if self.pad_block is not None and not feature:
            return None, h
        if self.pad_block is not None:
            f, g = pad_outputs(h, self.pad_block.out.reshape(n, -1))
            self.pad_block.out = None
            return f, g
        return h, h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary; map indices with `to_target`."""
        return self.lm(hidden)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def over_draft_ids(self, allowed: Allowed | None) -> Allowed | None:
        """A grammar's check (tree.Allowed, over target ids) taking this head's draft ids."""
        if allowed is None or self.d2t is None:
            return allowed
        if self._d2t_ids is None:
            self._d2t_ids = self.d2t.tolist()
        ids = self._d2t_ids
        return lambda path, candidates, k: allowed([ids[x] for x in path], [ids[x] for x in candidates], k)


class _HiddenQkv:
    """EAGLE-3's attention input for llama.Block: the Block (without input norm) hands its hidden input h
    to qkv, which reads cat(input_layernorm(e), hidden_norm(h)), 2H wide; h stays the residual. The
    normalised embeddings e of the forward's rows are set by Eagle3Runner._connect."""

    def __init__(self, qkv: Linear, hidden_norm: torch.Tensor, eps: float) -> None:
        self.qkv, self.norm, self.eps, self.tokens = qkv, hidden_norm, eps, None

    @property
    def invariant(self) -> bool:
        return self.qkv.invariant

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, self.norm.shape, self.norm, self.eps)
        return self.qkv(torch.cat([self.tokens.reshape(h.shape), h], dim=-1))


class Eagle3Runner(HeadRunner):
    """An Eagle3Head on the lean machinery: fc over the target's aux states (target_input), one llama.Block
    whose qkv reads 2H (_HiddenQkv), and the head's own final norm before the LM head."""

    def _build(self, head: EagleHead, pack: bool, weights: str | None) -> None:
        cfg = head.config
        self.connector, self.pad, self.sampler, self.pad_block = "fc", False, None, None
        self.aux_layers = head.aux_layers
        self.fc = Linear(head.fc.weight, None, pack, weights)
        layer = head.layers[0]
        block = Block(layer, 0, cfg.rms_norm_eps, pack, weights)
        self.token_norm, block.in_norm = block.in_norm, None  # the Block's own norm would read h
        block.qkv = self.qkv = _HiddenQkv(block.qkv, layer.hidden_norm.weight.detach(), cfg.rms_norm_eps)
        self.layers = [block]
        self.norm, self.eps = head.norm.weight.detach(), cfg.rms_norm_eps

    def target_input(self, features: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """fc(the aux layers' hidden states [n, kH]) -> [n, H]."""
        if aux is None:
            raise SpecdecError("an EAGLE-3 head reads the target's aux-layer hidden states, none were given")
        with torch.inference_mode():
            return self.fc(aux.to(self.device, self.dtype))

    def _token_table(self) -> None:
        return None  # the token's normalised embedding is one gather and a norm: nothing worth a table

    def _connect(self, tokens: torch.Tensor, f: torch.Tensor, draft: bool) -> torch.Tensor:
        e = F.embedding(self.to_target(tokens) if draft else tokens, self.embed).to(self.dtype)
        self.qkv.tokens = F.rms_norm(e, self.token_norm.shape, self.token_norm, self.eps)
        return f

    def _outputs(self, h: torch.Tensor, feature: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        self.qkv.tokens = None
        return h, F.rms_norm(h, self.norm.shape, self.norm, self.eps)


def runner_for(head: EagleHead, embed: torch.Tensor,
               lm_head: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
               **kw) -> HeadRunner:
    """The runner of this kind of head."""
    return (Eagle3Runner if head.kind == "eagle3" else HeadRunner)(head, embed, lm_head, **kw)
