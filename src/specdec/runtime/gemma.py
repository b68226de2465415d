"""Gemma 3's decoder on the Llama block (llama.Block): everything its layers do differently, in one place.

- RMSNorm scales by (1 + w), computed in fp32; four norms a layer: before and after attention, before and
  after the MLP (the "after" ones on the branch, before the residual add);
- QK-norm: a per-head RMSNorm of q and k before RoPE;
- GeGLU (gelu, tanh approximation) in place of SwiGLU;
- attention scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.

The runner-level differences (the embedding times sqrt(hidden_size), a RoPE table per layer type: local
layers have their own base) are embed_scale and rope_kinds here; sliding windows and logit soft-capping are
generic (base.layer_windows, base.soft_capped). On the fused kernels (kernels/fused.cpp) every norm is
their RMSNorm, q and k are normalized in `project`, and RoPE, the cache writes and attention are Llama's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.runtime.llama import Block

MODEL_TYPES = ("gemma3_text",)


def is_gemma(cfg) -> bool:
    return cfg.model_type in MODEL_TYPES


def supported(cfg) -> bool:
    """What GemmaBlock implements (anything else runs on the HF runner)."""
    return (getattr(cfg, "hidden_activation", None) == "gelu_pytorch_tanh"
            and getattr(cfg, "attn_logit_softcapping", None) is None
            and not getattr(cfg, "use_bidirectional_attention", False))


def norm_scale(norm) -> torch.Tensor:
    """What a Gemma RMSNorm multiplies by: 1 + w, in fp32 as HF computes it."""
    return 1 + norm.weight.detach().float()


def embed_scale(cfg, dtype: torch.dtype) -> torch.Tensor | None:
    """sqrt(hidden_size) rounded to the model's dtype, as HF's scaled embedding multiplies (None: no scale)."""
    return torch.tensor(cfg.hidden_size ** 0.5).to(dtype) if is_gemma(cfg) else None


# Gemma's turn format (its instruction-tuned models' template; a system message opens the first user turn):
# a base model's GGUF carries no template, yet its vocabulary holds the turn tokens
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ ((first if loop.first else '') + m['content']) | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def chat_ready(tokenizer, cfg) -> None:
    """A Gemma 3 tokenizer without a chat template gets Gemma's, and `<end_of_turn>` ends a generation."""
    if not is_gemma(cfg) or tokenizer.chat_template is not None:
        return
    eot = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if eot is None or eot == tokenizer.unk_token_id:
        return
    tokenizer.chat_template = CHAT_TEMPLATE
    eos = cfg.eos_token_id
    cfg.eos_token_id = sorted({*([] if eos is None else [eos] if isinstance(eos, int) else eos), eot})


def rope_kinds(cfg, n_layers: int) -> list[str | None]:
    """Each layer's RoPE table: its layer type for Gemma (local and global bases differ), else the one (None)."""
    return list(cfg.layer_types) if is_gemma(cfg) else [None] * n_layers


class GemmaBlock(Block):
    """A Gemma 3 decoder layer: the Llama block's fused q/k/v and gate/up linears, with Gemma's norms,
    QK-norm, GeGLU and attention scale."""

    def __init__(self, layer, index: int, eps: float, pack: bool = True, weights: str | None = None,
                 invariant: bool = True) -> None:
        super().__init__(layer, index, eps, pack, weights, invariant)
        a = layer.self_attn
        self.scale = a.scaling
        kernel_scale = 1 / torch.tensor(float(self.head_dim)).sqrt()  # the attention kernel's 1.0f / sqrt(hd)
        if self.fused is not None and torch.tensor(self.scale, dtype=torch.float32) != kernel_scale:
            self.fused = None
        self.in_norm = norm_scale(layer.input_layernorm)
        self.attn_out_norm = norm_scale(layer.post_attention_layernorm)
        self.post_norm = norm_scale(layer.pre_feedforward_layernorm)  # the MLP's input norm, as in Block
        self.mlp_out_norm = norm_scale(layer.post_feedforward_layernorm)
        self.q_scale, self.k_scale = norm_scale(a.q_norm), norm_scale(a.k_norm)  # the fused path's, per head
        # the torch path's: one [heads + kv heads, head_dim] table, q's and k's norms in one op
        self.qk_scale = torch.cat([self.q_scale.expand(self.n_heads, -1), self.k_scale.expand(self.n_kv, -1)])

    def native_norms(self) -> list[torch.Tensor]:
        return [self.q_scale, self.k_scale, self.attn_out_norm, self.mlp_out_norm]

    def norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x.reshape(-1, x.shape[-1]), scale, self.eps).view(x.shape)
        return F.rms_norm(x.float(), (scale.shape[-1],), eps=self.eps).mul(scale).to(x.dtype)

    def qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        return self.norm(qk, self.qk_scale)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """On the fused kernels q and k leave normalized (their kernels take RoPE and attention as Llama's do);
        on the torch ops attend normalizes them."""
        qkv = super().project(h)
        if self.fused is None or h.shape[0] != 1:
            return qkv
        n, nh, nkv, hd = qkv.shape[1], self.n_heads, self.n_kv, self.head_dim
        x = qkv[0]
        q = self.fused.rms_norm(x[:, : nh * hd].reshape(n * nh, hd), self.q_scale, self.eps).view(n, nh * hd)
        k = self.fused.rms_norm(x[:, nh * hd: (nh + nkv) * hd].reshape(n * nkv, hd), self.k_scale,
                                self.eps).view(n, nkv * hd)
        return torch.cat([q, k, x[:, (nh + nkv) * hd:]], dim=-1)[None]

    def finish(self, a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.norm(self.o(a), self.attn_out_norm)
        g, u = self.gate_up(self.norm(h, self.post_norm)).chunk(2, dim=-1)
        return h + self.norm(self.down(F.gelu(g, approximate="tanh") * u), self.mlp_out_norm)
