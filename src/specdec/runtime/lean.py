"""A lean forward for the Llama family (Llama, Qwen2, Mistral; Gemma 3 on gemma.GemmaBlock) that reads a
stock HF model's weights:
llama.Block per layer over one preallocated kv.KVCache (docs/design.md, "CPU costs"). The HF model stays the
reference: tests compare the two.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.runtime import gemma, stream
from specdec.runtime.base import ForwardOut, Part, Runner, in_window, layer_windows, logit_cap, soft_capped
from specdec.runtime.gguf import QuantTensor, QuantWeight, quant_types, requantized
from specdec.runtime.kv import KVCache
from specdec.runtime.llama import Block, PackedRows, Rope, chain_attention, make_room, native_stack, visible_columns
from specdec.runtime.packed import GGUF, HeadRows, Linear, precision_name

SUPPORTED = ("llama", "qwen2", "mistral", *gemma.MODEL_TYPES)
# Forwards of up to this many rows (decode steps, verify trees) attend row by row, which makes a row's
# output independent of its forward's other rows (llama.attend_rows); longer ones (prompt prefill, which
# vanilla and speculative decoding share) use one attention call per layer.
EXACT_ROWS = 64
PROBE_MIN_PARAMS = 4_000_000  # below this, one-row steps stay on the packed kernel unprobed
FORK_CAPACITY = 256  # a fork's first cache rows (it grows by doubling)


def supports(model) -> bool:
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    ropes = rope.values() if gemma.is_gemma(cfg) else [rope]  # Gemma: parameters per layer type
    return (
        cfg.model_type in SUPPORTED
        and (gemma.supported(cfg) if gemma.is_gemma(cfg) else getattr(cfg, "hidden_act", "silu") == "silu")
        and all(r.get("rope_type", "default") != "dynamic" for r in ropes)  # dynamic NTK depends on length
    )


class LeanRunner(Runner):
    exact_rows = EXACT_ROWS
    def __init__(self, model, pack: bool = True, initial_capacity: int = 1024, weights: str | None = None,
                 exact: bool | None = None) -> None:
        if not supports(model):
            raise ValueError(f"LeanRunner does not support model_type={model.config.model_type!r}")
        cfg = self.config = model.config
        self.softcap = logit_cap(cfg)
        base = model.get_decoder()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.hidden_size = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.max_length = cfg.max_position_embeddings
        embed = base.embed_tokens.weight
        self.embed = embed if isinstance(embed, QuantTensor) else embed.detach()  # GGUF: rows looked up quantized
        self.embed_scale = gemma.embed_scale(cfg, self.dtype)
        self.weights = weights or precision_name(self.dtype)  # what decoding is lossless relative to
        # exact rows by default only where they matter: a reduced-precision target amplifies 1e-7 into other
        # tokens; at the model's own precision the fast path (one attention call, GEMV decode steps) keeps
        # greedy equal up to numerical ties. Why not always: a tree row's gathered K/V copy costs ~2x at
        # 700 cached rows, and one-row steps must use the many-row kernel.
        exact = self.weights != precision_name(self.dtype) if exact is None else exact
        block = gemma.GemmaBlock if gemma.is_gemma(cfg) else Block
        self.layers = [block(layer, i, self.eps, pack, weights, exact) for i, layer in enumerate(base.layers)]
        self.n_layers = len(self.layers)
        self.n_heads, self.n_kv, self.head_dim = self.layers[0].n_heads, self.layers[0].n_kv, self.layers[0].head_dim
        self.norm = gemma.norm_scale(base.norm) if gemma.is_gemma(cfg) else base.norm.weight.detach()
        head = model.get_output_embeddings()
        self._head = (head.weight, getattr(head, "bias", None), (pack, weights, exact))  # restrict_head's source
        self.lm_head: Linear | HeadRows = Linear(head.weight, self._head[1], pack, weights, exact)
        linears = [self.lm_head] + [x for b in self.layers for x in (b.qkv, b.o, b.gate_up, b.down)]
        # the fused kernels attend row by row at no extra cost: exact rows at every precision there
        self.fused = self.layers[0].fused if all(b.fused is not None for b in self.layers) else None
        exact = exact or self.fused is not None
        self.exact_rows = EXACT_ROWS if exact and all(x.invariant for x in linears) else 0
        self.vocab_size = head.weight.shape[0]
        self.windows = layer_windows(cfg, len(self.layers))
        # A GGUF file's model keeps K and V in fp16, as llama.cpp does by default: half the bytes a step reads
        # from the cache (at a few thousand tokens more than the weights). Only the fused kernels read it, the
        # same way in every forward, so decoding stays exact relative to this model.
        kv_dtype = torch.float16 if self.weights == GGUF and self.fused is not None else self.dtype
        self.cache = KVCache(len(self.layers), self.n_kv, self.head_dim, self.max_length, self.device, kv_dtype,
                             initial_capacity, positions=True)
        self.rope_kinds = gemma.rope_kinds(cfg, len(self.layers))
        self.ropes = {k: Rope(base.rotary_emb, self.device, self.dtype, self.max_length, k)
                      for k in dict.fromkeys(self.rope_kinds)}
        for rope in self.ropes.values():
            rope.grow(self.cache.capacity)  # positions never exceed the number of cache rows
        self.decode_kernel = self._pick_decode_kernel(linears)
        self.stack = self._native_stack()
        # which build of the kernels ran (their source hash): costs measured on another build are stale
        self.kernel_build = stream.kernel().__name__ if self.decode_kernel == "stream" else ""
        self.kernel_path = self._kernel_path()

    def _kernel_path(self) -> str:
        """'stream+fused' (the streaming kernel, the layers' small ops fused too), 'stream' (its linears
        only), else the fallback: 'onednn' (packed weights) or 'torch', '+gemv' when MKL's GEMV runs
        the one-row decode steps."""
        if self.decode_kernel == "stream":
            return "stream+fused" if self.fused is not None else "stream"
        path = "onednn" if self.lm_head.packed else "torch"
        return path + "+gemv" if self.decode_kernel == "gemv" else path

    def shared_lm_head(self, weights: str) -> Linear | None:
        return self.lm_head if weights == self.weights and self.head_ids is None else None

    def restrict_head(self, ids: torch.Tensor) -> bool:
        weight, bias, args = self._head
        self.lm_head = HeadRows(weight, bias, ids, args)
        self.head_ids, self.vocab_size = self.lm_head.ids.to(self.device), self.lm_head.ids.numel()
        return True

    def score_also(self, ids: list[int]) -> None:
        if isinstance(self.lm_head, HeadRows):
            self.lm_head = self.lm_head.with_extra(ids)
            self.head_ids, self.vocab_size = self.lm_head.ids.to(self.device), self.lm_head.ids.numel()

    def requantize(self, qtype: int) -> bool:
        weights = [x for b in self.layers for x in (b.qkv, b.o, b.gate_up, b.down)]
        weights.append(self.lm_head.linear if isinstance(self.lm_head, HeadRows) else self.lm_head)
        if not all(isinstance(x.stream, QuantWeight) for x in weights):
            return False
        fresh = iter(requantized([p for x in weights for p in x.stream.parts], qtype))
        for x in weights:
            x.stream = QuantWeight([next(fresh) for _ in x.stream.parts], x.stream.bias)
        self.requantized_to = quant_types()[qtype][0]
        self.stack = self._native_stack()
        return True

    def _native_stack(self):
        """llama.native_stack of the layers, each reading its RoPE table and window's mask (in the order of
        self.ropes and of the distinct windows)."""
        kinds, windows = list(self.ropes), list(dict.fromkeys(self.windows))
        return native_stack(self.layers, [kinds.index(k) for k in self.rope_kinds],
                            [windows.index(w) for w in self.windows])

    def _pick_decode_kernel(self, linears: list[Linear]) -> str:
        """'stream' (the streaming kernel, at every row count), else 'gemv' or 'packed': which kernel runs
        a one-row decode step, timed here. Why measured: MKL's GEMV beat oneDNN's packed GEMM by ~25% on a
        Xeon and lost by ~60% on an AMD EPYC (30.8 vs 50 ms per SmolLM2 step). The loser's copy is dropped."""
        if all(x.stream is not None for x in linears):
            return "stream"
        gemv = [x for x in linears if x.gemv is not None]
        small = sum(x.gemv.numel() for x in gemv) < PROBE_MIN_PARAMS  # nothing to gain, and keep tiny models stable
        if small:
            for x in gemv:
                x.gemv = None
        if not gemv or small:
            return "packed"
        saved = [x.gemv for x in gemv]

        def use(on: bool) -> None:
            for x, w in zip(gemv, saved):
                x.gemv = w if on else None

        ids = torch.zeros(16, dtype=torch.long, device=self.device)
        self.forward(ids)
        self.commit(range(16))
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(4):  # interleaved, the first round a warm-up
            for on in (True, False):
                use(on)
                t = time.perf_counter()
                self.forward(ids[:1])
                self.rollback()
                if rep:
                    times[on].append(time.perf_counter() - t)
        self.reset()
        best = min(times[True]) < min(times[False])
        use(best)
        return "gemv" if best else "packed"

    @property
    def rope(self) -> Rope:
        """The RoPE table of a model with one (every family but Gemma)."""
        (rope,) = self.ropes.values()
        return rope

    def fork(self) -> LeanRunner:
        r = copy.copy(self)  # layers, RoPE tables and LM head shared: only the cache is the fork's own
        r.cache = self.cache.fresh(FORK_CAPACITY)
        return r

    @property
    def family(self) -> int:
        return id(self.layers)

    def forward_many(self, parts: Sequence[Part], aux_layers: tuple[int, ...] = (),
                     logits_rows: Sequence[slice | None] | None = None) -> list[ForwardOut]:
        """Sequences packed into forwards of at most exact_rows rows: their linears run once on all their rows,
        each row's bits those it gets alone (row-invariant linears, attention per sequence). Without exact
        rows (or a sequence longer than them) a sequence runs alone, as it would anyway."""
        outs: list[ForwardOut | None] = [None] * len(parts)
        lrs = logits_rows or [None] * len(parts)
        group: list[int] = []

        def run(group: list[int]) -> None:
            if len(group) == 1:
                r, t, pos, m = parts[group[0]]
                outs[group[0]] = r.forward(t, pos, m, lrs[group[0]], aux_layers)
                return
            seqs = []
            for i in group:
                r, t, pos, m = parts[i]
                _, pos = r._new_rows(t.numel(), pos, m)
                seqs.append((r, t.to(self.device), pos.to(self.device), None if m is None else m.to(self.device)))
            for i, out in zip(group, self._run(seqs, [lrs[i] for i in group], tuple(aux_layers))):
                outs[i] = out
            for r, t, _, _ in seqs:
                r.cache.n_pending += t.numel()

        rows = 0
        for i, (_, t, _, _) in enumerate(parts):
            if group and rows + t.numel() > self.exact_rows:
                run(group)
                group, rows = [], 0
            group.append(i)
            rows += t.numel()
        if group:
            run(group)
        return outs

    def _forward(self, tokens, positions, mask, logits_rows, aux_layers=()) -> ForwardOut:
        return self._run([(self, tokens, positions, mask)], [logits_rows], aux_layers)[0]

    @torch.inference_mode()
    def _run(self, seqs: list[Part], logits_rows: list[slice | None], aux_layers: tuple[int, ...]) -> list[ForwardOut]:
        """One forward over the new rows of several forks of this runner (one: a plain forward): each
        sequence's rows attend over its own cache as in a forward of its own."""
        plans = [self._attention_plan(*s) for s in seqs]
        sizes = [t.numel() for _, t, _, _ in seqs]
        tokens = seqs[0][1] if len(seqs) == 1 else torch.cat([t for _, t, _, _ in seqs])
        h = (self.embed.rows(tokens)[None] if isinstance(self.embed, QuantTensor)
             else F.embedding(tokens[None], self.embed))
        if self.embed_scale is not None:
            h = h * self.embed_scale
        # packed attention reads one RoPE table (Gemma's two: each sequence attends in its own call)
        packed = _packed(plans, sizes) if len(seqs) > 1 and self.fused and len(self.ropes) == 1 else None
        aux = []
        native = self._native(plans, sizes, packed)
        if native is not None:  # the loop below in native calls, one per stretch between kept aux states
            x, at = h[0], 0
            for i in [*sorted(set(aux_layers)), self.n_layers]:
                x = native(x, at, i)
                at = i
                if i < self.n_layers:
                    aux.append(x)
            h = x[None]
        for i, (layer, w, r) in enumerate(zip(self.layers, self.windows, self.rope_kinds) if native is None else ()):
            if i in aux_layers:
                aux.append(h[0])
            qkv = layer.project(h)
            if len(seqs) == 1:
                p = plans[0]
                a = layer.attend(qkv, *p.rope[r], p.kv, p.start, *p.masks[w])
            elif packed is not None:
                a = layer.attend_many(qkv, packed, w)
            else:
                parts = qkv.split(sizes, dim=1)
                a = torch.cat([layer.attend(x, *p.rope[r], p.kv, p.start, *p.masks[w])
                               for x, p in zip(parts, plans)], dim=1)
            h = layer.finish(a, h)
        feats = self.fused.rms_norm(h[0], self.norm, self.eps) if self.fused else self.layers[-1].norm(h[0], self.norm)
        aux_t = torch.cat(aux, -1) if aux_layers else None
        if len(seqs) == 1:
            wanted = feats if logits_rows[0] is None else feats[logits_rows[0]]
            return [ForwardOut(soft_capped(self.lm_head(wanted), self.softcap), feats, aux_t)]
        fs = feats.split(sizes)
        wanted = [f if lr is None else f[lr] for f, lr in zip(fs, logits_rows)]
        heads = [r.lm_head for r, _, _, _ in seqs]
        if all(h is self.lm_head for h in heads):
            logits = self.lm_head(torch.cat(wanted)).split([x.shape[0] for x in wanted])
        else:  # forks of a draft scoring each request's own ids too (score_also): each its own head
            logits = [h(x) for h, x in zip(heads, wanted)]
        auxs = aux_t.split(sizes) if aux_t is not None else [None] * len(seqs)
        return [ForwardOut(soft_capped(lg, self.softcap), f, a) for lg, f, a in zip(logits, fs, auxs)]

    def _native(self, plans: list[_Plan], sizes: list[int], packed: PackedRows | None):
        """(h [rows, H], first layer, last layer) -> h after those layers in one native call (llama.native_stack),
        where the layer loop would take the fused kernels (exact rows; one sequence, or several packed); else None."""
        if self.stack is None:
            return None
        windows = list(dict.fromkeys(self.windows))
        if packed is not None:
            k, masks = packed, [packed.masks[w] for w in windows]
            return lambda x, a, b: self.stack.forward_many(x, k.cos, k.sin, k.ks, k.vs, k.starts, k.sizes, masks, a, b)
        p, n = plans[0], sizes[0]
        if len(plans) > 1 or (n > 1 and any(p.masks[w][2] is None for w in windows)):
            return None
        coss, sins = zip(*[(c.reshape(n, -1), s.reshape(n, -1)) for c, s in (p.rope[k] for k in self.ropes)])
        masks = [None if m is None else m.reshape(n, -1) for m in (p.masks[w][0] for w in windows)]
        return lambda x, a, b: self.stack.forward(x, list(coss), list(sins), p.kv.k, p.kv.v, p.start, masks, a, b)

    def pretend_cached(self, n: int) -> None:
        """Runner.pretend_cached without the forward: rows up to `n` hold whatever the preallocated cache holds
        (zeros after a reset, written pages), at a chain of positions. Why: the prefill before timing a long
        context's forwards was most of `auto`'s cost measurement (35 s of Qwen-1.5B's 57 on a Zen 1)."""
        kv = self.cache
        start = kv.length + kv.n_pending
        if start < n:
            make_room(kv, n - start, self.ropes.values())
            kv.pos[start:n] = torch.arange(start, n, device=self.device)
        kv.commit(range(n - kv.length))

    def _attention_plan(self, runner: LeanRunner, tokens: torch.Tensor, positions: torch.Tensor,
                        mask: torch.Tensor | None) -> _Plan:
        """Where a sequence's new rows go in its cache and what each attends to, per sliding window."""
        n = tokens.numel()
        kv = runner.cache
        start = kv.length + kv.n_pending
        end = start + n
        make_room(kv, n, self.ropes.values())
        kv.pos[start:end] = positions
        rope = {k: r(positions) for k, r in self.ropes.items()}
        causal, chain = False, mask is None
        if mask is None:
            mask, causal = chain_attention(start, n, self.device)
        exact = n <= self.exact_rows
        masks: dict[int | None, tuple] = {}
        for w in dict.fromkeys(self.windows):
            m, c = mask, causal
            if w is not None and end > w:  # sliding window: also hide rows `w` or more positions back
                base = mask if mask is not None else (
                    torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start))
                m, c = in_window(base, positions, kv.pos[:end], w), False
            rows = None
            if exact:  # the fused kernels read the mask themselves
                rows = True if self.fused else visible_columns(None if chain and m is mask else m, start, n)
            masks[w] = (m, c, rows)
        return _Plan(kv, start, rope, masks)


@dataclass
class _Plan:
    kv: KVCache
    start: int
    rope: dict  # RoPE table (LeanRunner.rope_kinds) -> (cos, sin) of the new rows
    masks: dict  # sliding window (None: none) -> (mask, causal, rows) for Block.attend


def _packed(plans: list[_Plan], sizes: list[int]) -> PackedRows | None:
    """Several sequences' attention inputs for one fused call per layer (Block.attend_many), when every
    sequence's rows would take the fused kernels alone (a long prefill takes SDPA)."""
    windows = plans[0].masks.keys()
    if not all(rows is not None or n == 1 for p, n in zip(plans, sizes) for _, _, rows in p.masks.values()):
        return None
    return PackedRows(torch.cat([p.rope[None][0].reshape(n, -1) for p, n in zip(plans, sizes)]),
                      torch.cat([p.rope[None][1].reshape(n, -1) for p, n in zip(plans, sizes)]),
                      [p.kv.k for p in plans], [p.kv.v for p in plans], [p.start for p in plans], sizes,
                      {w: [None if p.masks[w][0] is None else p.masks[w][0].reshape(n, -1)
                           for p, n in zip(plans, sizes)] for w in windows})
