"""A lean forward for the Llama family (Llama, Qwen2, Mistral) that reads a stock HF model's weights.

Why not call the HF module: on a 2-core CPU a 135M model's decode step is dominated by per-op Python
overhead and MKL's small-batch GEMMs (DESIGN.md §7). Here q/k/v and gate/up are fused into one
pre-packed GEMM each, RoPE tables are precomputed, and the KV cache is one preallocated tensor, so
compaction is a single index copy. The HF model stays the reference: tests compare the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.target.base import ForwardOut, Runner
from specdec.target.packed import Linear

SUPPORTED = ("llama", "qwen2", "mistral")


def supports(model) -> bool:
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return (
        cfg.model_type in SUPPORTED
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and rope.get("rope_type", "default") != "dynamic"  # dynamic NTK depends on sequence length
    )


class _Layer:
    def __init__(self, layer, pack: bool) -> None:
        a, m = layer.self_attn, layer.mlp
        qkv_b = None
        if a.q_proj.bias is not None:
            qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        self.qkv = Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), qkv_b, pack)
        self.o = Linear(a.o_proj.weight, a.o_proj.bias, pack)
        gu_b = None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias])
        self.gate_up = Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]), gu_b, pack)
        self.down = Linear(m.down_proj.weight, m.down_proj.bias, pack)
        self.in_norm = layer.input_layernorm.weight.detach()
        self.post_norm = layer.post_attention_layernorm.weight.detach()


class LeanRunner(Runner):
    def __init__(self, model, pack: bool = True, initial_capacity: int = 1024) -> None:
        super().__init__()
        if not supports(model):
            raise ValueError(f"LeanRunner does not support model_type={model.config.model_type!r}")
        cfg = self.config = model.config
        base = model.get_decoder()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden_size = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.max_length = cfg.max_position_embeddings
        self.embed = base.embed_tokens.weight.detach()
        self.layers = [_Layer(layer, pack) for layer in base.layers]
        self.norm = base.norm.weight.detach()
        head = model.get_output_embeddings()
        self.lm_head = Linear(head.weight, getattr(head, "bias", None), pack)
        self.vocab_size = head.weight.shape[0]
        self.windows = self._windows(cfg, len(self.layers))
        self._rotary = base.rotary_emb
        self._cos = self._sin = torch.empty(0)
        self._alloc(initial_capacity)

    @staticmethod
    def _windows(cfg, n_layers: int) -> list[int | None]:
        w = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        if not w or (cfg.model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False)):
            return [None] * n_layers
        if types:
            return [w if t == "sliding_attention" else None for t in types]
        return [w] * n_layers

    def _alloc(self, capacity: int) -> None:
        capacity = min(capacity, self.max_length)
        shape = (len(self.layers), self.n_kv, capacity, self.head_dim)
        k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        pos = torch.zeros(capacity, dtype=torch.long, device=self.device)
        if hasattr(self, "k"):
            used = self.length + self.n_pending
            k[:, :, :used], v[:, :, :used], pos[:used] = self.k[:, :, :used], self.v[:, :, :used], self.pos[:used]
        self.k, self.v, self.pos, self.capacity = k, v, pos, capacity
        if self._cos.shape[0] < capacity:
            # tables up to the capacity; positions never exceed the number of cache rows
            ids = torch.arange(capacity, device=self.device)[None]
            cos, sin = self._rotary(self.embed[:1][None], ids)
            self._cos, self._sin = cos[0].to(self.dtype), sin[0].to(self.dtype)

    def reset(self) -> None:
        self.length = self.n_pending = 0

    def _truncate(self, length: int) -> None:
        pass  # rows past `length` are simply overwritten later

    def _compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]
        self.pos[dst] = self.pos[src]

    @torch.inference_mode()
    def _forward(self, tokens, positions, mask, logits_rows) -> ForwardOut:
        n = tokens.numel()
        start = self.length + self.n_pending
        end = start + n
        if end > self.capacity:
            self._alloc(max(end, 2 * self.capacity))
        self.pos[start:end] = positions
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        cos, sin = self._cos[positions], self._sin[positions]
        if mask is None and n > 1:
            causal = start == 0
            if not causal:
                mask = torch.ones(n, end, dtype=torch.bool, device=self.device)
                mask[:, start:] = mask[:, start:].tril()
        else:
            causal = False
        masks = {}
        h = F.embedding(tokens, self.embed)
        for li, layer in enumerate(self.layers):
            x = F.rms_norm(h, (self.hidden_size,), layer.in_norm, self.eps)
            q, k, v = layer.qkv(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = _rope(q.view(n, nh, hd).transpose(0, 1), cos, sin)
            k = _rope(k.view(n, nkv, hd).transpose(0, 1), cos, sin)
            self.k[li, :, start:end] = k
            self.v[li, :, start:end] = v.view(n, nkv, hd).transpose(0, 1)
            w = self.windows[li]
            m = mask
            if w is not None and end > w:
                if w not in masks:
                    base = mask if mask is not None else (
                        torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
                    )
                    masks[w] = base & ((positions[:, None] - self.pos[None, :end]) < w)
                m, causal_l = masks[w], False
            else:
                causal_l = causal
            a = F.scaled_dot_product_attention(
                q[None], self.k[li, :, :end][None], self.v[li, :, :end][None],
                attn_mask=m, is_causal=causal_l, enable_gqa=nh != nkv,
            )
            h = h + layer.o(a[0].transpose(0, 1).reshape(n, nh * hd))
            x = F.rms_norm(h, (self.hidden_size,), layer.post_norm, self.eps)
            g, u = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(g) * u)
        feats = F.rms_norm(h, (self.hidden_size,), self.norm, self.eps)
        rows = feats if logits_rows is None else feats[logits_rows]
        return ForwardOut(self.lm_head(rows), feats)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
