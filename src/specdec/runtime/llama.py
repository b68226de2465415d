"""The Llama-family decoder block (Llama, Qwen2, Mistral; EAGLE's head layers; Gemma 3's, with the
differences in gemma.py), written once for the lean target runner (one sequence or several packed) and the EAGLE
head runner.

Why not call the HF module: on a 2-core CPU a small model's decode step is dominated by per-op Python
overhead and MKL's small-batch GEMMs (docs/design.md, "CPU costs"). Here q/k/v and gate/up are fused into one
pre-packed GEMM each, RoPE tables are precomputed, and K/V go into a preallocated kv.KVCache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.runtime import stream
from specdec.runtime.gguf import QuantWeight, cat_rows
from specdec.runtime.kv import KVCache
from specdec.runtime.packed import Linear


class Rope:
    """cos/sin tables [positions, head_dim] from an HF rotary module, computed once and grown on demand:
    a forward indexes them instead of calling the module. `sin` carries rotate_half's sign (-sin on the
    first half), so applying it is a flip and two products (apply_rope)."""

    def __init__(self, rotary: nn.Module, device: torch.device, dtype: torch.dtype, max_length: int,
                 kind: str | None = None) -> None:
        self.rotary, self.max_length = rotary, max_length
        self.kind = () if kind is None else (kind,)  # the layer type of a module with one table per type
        self.like = torch.empty(0, device=device, dtype=dtype)  # the module reads only device and dtype
        self.cos = self.sin = torch.empty(0, device=device, dtype=dtype)

    def grow(self, n: int) -> None:
        """Tables for positions < n (capped at max_length)."""
        n = min(n, self.max_length)
        if self.cos.shape[0] < n:
            cos, sin = self.rotary(self.like, torch.arange(n, device=self.like.device)[None], *self.kind)
            sin = sin[0].to(self.like.dtype)
            half = sin.shape[-1] // 2
            self.cos, self.sin = cos[0].to(self.like.dtype), torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def make_room(kv: KVCache, n: int, ropes) -> None:
    """Room in kv for n rows after the used ones, and each RoPE table grown with it (a position never exceeds
    the rows a cache holds)."""
    if kv.length + kv.n_pending + n > kv.capacity:
        kv.reserve(n)
        for rope in ropes:
            rope.grow(kv.capacity)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, bit for bit, with `sin` from Rope (sign folded in): swapping
    the halves is one flip, where rotate_half is a chunk, a negation and a cat."""
    shape = x.shape
    swapped = x.unflatten(-1, (2, shape[-1] // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * sin


def visible_columns(mask: torch.Tensor | None, start: int, n: int) -> list[slice | torch.Tensor]:
    """Per new row, the cache columns it attends to: a slice when contiguous (a chain, a sliding
    window), else their indices (a tree row sees the cache plus its ancestors). mask None = a chain."""
    if mask is None:
        return [slice(0, start + i + 1) for i in range(n)]
    out: list[slice | torch.Tensor] = []
    for row in mask:
        idx = row.nonzero().flatten()
        a, b = int(idx[0]), int(idx[-1]) + 1
        out.append(slice(a, b) if b - a == idx.numel() else idx)
    return out


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list, gqa: bool,
                scale: float | None = None) -> torch.Tensor:
    """Attention one query row at a time, each over exactly its visible K/V rows in cache order.

    Why: SDPA's result for a row depends on how many rows share the call (measured: 1e-7 apart), and
    reduced-precision weights amplify that into different tokens. Called this way, row i of a verify
    forward makes the very call a one-token decode step at the same point makes: bit-identical output,
    so speculative decoding matches vanilla exactly, at any weight precision (docs/design.md, "Batch invariance")."""
    outs = [F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, c], v[:, :, c], enable_gqa=gqa, scale=scale)
            for i, c in enumerate(rows)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def chain_attention(start: int, n: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for n new rows after `start` cached ones seeing every cached row and causal among
    themselves. With nothing cached SDPA's is_causal does it without a mask tensor; one row needs neither."""
    if n == 1:
        return None, False
    if start == 0:
        return None, True
    mask = torch.ones(n, start + n, dtype=torch.bool, device=device)
    mask[:, start:] = mask[:, start:].tril()
    return mask, False


@dataclass
class PackedRows:
    """Several sequences' new rows in one forward, for Block.attend_many: their RoPE tables (rows packed
    like the sequences'), caches, first new columns, row counts, and masks per sliding window."""
    cos: torch.Tensor
    sin: torch.Tensor
    ks: list[torch.Tensor]
    vs: list[torch.Tensor]
    starts: list[int]
    sizes: list[int]
    masks: dict  # window -> one [n, end] bool mask or None (a chain) per sequence


class Block:
    """One HF decoder layer's weights, fused (qkv, gate_up) and pre-packed. Optional q/k/v biases (Qwen2);
    no input norm when the layer has nn.Identity there (EAGLE's first head layer)."""

    scale: float | None = None  # attention's scale (None: SDPA's 1 / sqrt(head_dim))
    native = True  # native_stack runs its fused path (a subclass it does not know sets False)

    def __init__(self, layer: nn.Module, index: int, eps: float, pack: bool = True, weights: str | None = None,
                 invariant: bool = True) -> None:
        a, m = layer.self_attn, layer.mlp
        self.index, self.eps = index, eps  # index: this layer's slot in the KVCache
        hd = self.head_dim = a.head_dim
        self.n_heads, self.n_kv = a.q_proj.weight.shape[0] // hd, a.k_proj.weight.shape[0] // hd
        self.split = [self.n_heads * hd, self.n_kv * hd, self.n_kv * hd]
        self.gqa = self.n_heads != self.n_kv
        qkv_b = None
        if a.q_proj.bias is not None:
            qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        args = (pack, weights, invariant)
        self.qkv = Linear(cat_rows([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), qkv_b, *args)
        self.o = Linear(a.o_proj.weight, a.o_proj.bias, *args)
        gu_b = None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias])
        self.gate_up = Linear(cat_rows([m.gate_proj.weight, m.up_proj.weight]), gu_b, *args)
        self.down = Linear(m.down_proj.weight, m.down_proj.bias, *args)
        norm = layer.input_layernorm
        self.in_norm = None if isinstance(norm, nn.Identity) else norm.weight
        self.post_norm = layer.post_attention_layernorm.weight.detach()
        if self.in_norm is not None:
            self.in_norm = self.in_norm.detach()
        # the streaming kernel's per-layer ops (kernels/fused.cpp) where every linear streams (CPU, fp32)
        self.fused = fused_ops(self)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int,
                 mask: torch.Tensor | None = None, causal: bool = False, rows: list | None = None) -> torch.Tensor:
        """h [B, n, H] -> [B, n, H]. Writes this layer's K/V at cache columns start..start+n, then attends
        over columns < start+n. cos/sin (Rope) are [n, head_dim] or [B, n, head_dim]; mask bool (True = visible)
        broadcasts to [B, heads, n, start+n]. rows (visible_columns, or True on the fused path, which reads
        the mask itself): attend row by row instead, which makes every row's output independent of the
        others (attend_rows)."""
        return self.finish(self.attend(self.project(h), cos, sin, kv, start, mask, causal, rows), h)

    # The three phases of a layer, apart so that a packed forward (lean.LeanRunner.forward_many) runs
    # project and finish once on several sequences' rows, and each sequence attends over its own cache
    # (attend_many: all of them in one call per layer on the fused kernels).
    # One sequence (B = 1) on the fused kernels: the same computation in ~8 calls instead of ~25.

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, n, H] -> the q/k/v projections [B, n, (heads + 2 kv heads) * head_dim]."""
        if self.fused is not None and h.shape[0] == 1:
            x = h[0] if self.in_norm is None else self.fused.rms_norm(h[0], self.in_norm, self.eps)
            return self.qkv(x)[None]
        x = h if self.in_norm is None else self.norm(h, self.in_norm)
        return self.qkv(x)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The family's RMSNorm over the last dimension."""
        return F.rms_norm(x, (weight.shape[-1],), weight, self.eps)

    def qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """q and k [B, n, heads + kv heads, head_dim] before RoPE: as they are (Gemma normalizes them)."""
        return qk

    def attend_many(self, qkv: torch.Tensor, rows: PackedRows, window: int | None) -> torch.Tensor:
        """attend for several sequences' rows packed in qkv [1, R, ...] on the fused kernels: one call for
        RoPE and the cache writes, one for attention, each sequence over its own cache (the bits of a call
        per sequence)."""
        ops, li = self.fused, self.index
        q = ops.rope_store_many(qkv[0], rows.cos, rows.sin, rows.ks, rows.vs, li, rows.starts, rows.sizes,
                                self.n_heads, self.n_kv)
        return ops.attend_many(q, rows.ks, rows.vs, li, rows.starts, rows.sizes, rows.masks[window])[None]

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache, start: int,
               mask: torch.Tensor | None, causal: bool, rows: list | bool | None) -> torch.Tensor:
        """RoPE, this layer's K/V stored at columns start.., attention: [B, n, heads * head_dim]."""
        b, n, _ = qkv.shape
        nh, nkv, hd, li = self.n_heads, self.n_kv, self.head_dim, self.index
        if self.fused is not None and b == 1:
            ops, kc, vc = self.fused, kv.k[li, 0], kv.v[li, 0]
            q = ops.rope_store(qkv[0], cos.reshape(n, hd), sin.reshape(n, hd), kc, vc, start, nh, nkv)
            if rows is not None or n == 1:  # every row over exactly its own columns (cheaper than SDPA for a few)
                return ops.attend(q, kc, vc, start, None if mask is None else mask.reshape(n, -1))[None]
            end = start + n  # a long prefill: one SDPA call
            a = F.scaled_dot_product_attention(q.view(1, n, nh, hd).transpose(1, 2), kc[None, :, :end].to(q.dtype),
                                               vc[None, :, :end].to(q.dtype), attn_mask=mask, is_causal=causal,
                                               enable_gqa=self.gqa, scale=self.scale)
            return a.transpose(1, 2).reshape(1, n, nh * hd)
        end = start + n
        qk = apply_rope(self.qk_norm(qkv[..., :(nh + nkv) * hd].view(b, n, nh + nkv, hd)), cos.unsqueeze(-2),
                        sin.unsqueeze(-2))
        q = qk[:, :, :nh].transpose(1, 2)
        kv.k[li, :, :, start:end] = qk[:, :, nh:].transpose(1, 2)
        kv.v[li, :, :, start:end] = qkv[..., (nh + nkv) * hd:].view(b, n, nkv, hd).transpose(1, 2)
        if rows is not None:
            if rows is True:
                rows = visible_columns(None if mask is None else mask.reshape(n, -1), start, n)
            a = attend_rows(q, kv.k[li], kv.v[li], rows, self.gqa, self.scale)
        else:
            a = F.scaled_dot_product_attention(q, kv.k[li, :, :, :end], kv.v[li, :, :, :end], attn_mask=mask,
                                               is_causal=causal, enable_gqa=self.gqa, scale=self.scale)
        return a.transpose(1, 2).reshape(b, n, nh * hd)

    def finish(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The attention output a [B, n, heads * head_dim] and the layer's input h -> the layer's output."""
        if self.fused is not None and h.shape[0] == 1:
            ops = self.fused
            h = self.o(a[0], h[0])
            y = ops.silu_mul(self.gate_up(ops.rms_norm(h, self.post_norm, self.eps)))
            return self.mlp_out(y, h, fused=True)[None]
        h = h + self.o(a)
        x = self.norm(h, self.post_norm)
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.mlp_out(F.silu(g) * u, h, fused=False)

    def native_norms(self) -> list[torch.Tensor] | None:
        """The norms native_stack applies beyond Llama's (Gemma's q, k, attention-output and MLP-output ones)."""
        return None

    def mlp_out(self, y: torch.Tensor, h: torch.Tensor, fused: bool) -> torch.Tensor:
        """The layer's output from the MLP's activation y and the residual h: h + down(y) (fused: down adds
        h in its kernel). A subclass whose MLP output is not one residual add overrides it (PAD's)."""
        return self.down(y, h) if fused else h + self.down(y)


def native_stack(blocks: list[Block], ropes: list[int] | None = None, windows: list[int] | None = None):
    """The blocks as one native call per forward (kernels/layers.cpp: Stack.forward(h [n, H], coss, sins, kv.k,
    kv.v, start, masks, first, last)), or None where a block's path is not one the stack knows (PAD's MLP output)
    or a linear is off the quantized kernels. ropes, windows: each block's RoPE table and mask among those a
    forward passes (default: the first). The same kernels in the same order, so the same bits; what it saves
    is ~10 Python calls per layer."""
    if not blocks or any(not b.native or b.fused is None for b in blocks):
        return None
    linears = [getattr(x, "stream", None) for b in blocks for x in (b.qkv, b.o, b.gate_up, b.down)]
    if not all(isinstance(x, QuantWeight) for x in linears):
        return None
    stack = blocks[0].fused.Stack()
    spec = lambda w: ([(ws, ts, key.startswith("qlinear16/")) for ws, ts, key in w.groups], w.bias)  # noqa: E731
    for i, b in enumerate(blocks):
        stack.add(b.in_norm, b.post_norm, b.eps, b.index, b.n_heads, b.n_kv, ropes[i] if ropes else 0,
                  windows[i] if windows else 0, *(spec(x.stream) for x in (b.qkv, b.o, b.gate_up, b.down)),
                  b.native_norms())
    return stack


def fused_ops(block: Block):
    """The fused kernels' module for this block, or None (then the torch ops run): they need every linear
    on the streaming kernel (CPU, fp32 activations) and a head_dim the attention kernel takes."""
    linears = (block.qkv, block.o, block.gate_up, block.down)
    if not all(x.stream is not None for x in linears) or block.head_dim not in (16, 32, 64, 128, 256):
        return None
    if block.gate_up.out_features % 16 or block.post_norm.shape[0] % 8:
        return None
    return stream.kernel()
