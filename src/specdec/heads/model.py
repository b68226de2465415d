"""The EAGLE draft head (DESIGN.md §4, §6) as an nn.Module: for training and as the weights the lean
heads.runner.HeadRunner packs.

Row t of the head reads (x_{t+1}, f_t): fc(cat(embed(x_{t+1}), f_t)) -> one Llama decoder layer
without input norm (EAGLE; optionally more, ordinary pre-norm layers after it) -> f̂_{t+1}, at
position t. Token logits come from the target's frozen LM head (no final norm), or from a reduced
head over the V_d most frequent tokens with a draft->target id map.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specdec.errors import SpecdecError

_COPIED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
           "rms_norm_eps", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id")


def head_config(target_config, **overrides) -> LlamaConfig:
    """The head's LlamaConfig: sizes, norm eps and RoPE of the target, one layer (EAGLE) unless overridden."""
    kw = {k: getattr(target_config, k) for k in _COPIED if getattr(target_config, k, None) is not None}
    kw["head_dim"] = kw.get("head_dim") or target_config.hidden_size // target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None)
    if rope:
        kw["rope_parameters"] = dict(rope)
    kw.update(num_hidden_layers=1, hidden_act="silu", attention_bias=False, mlp_bias=False,
              tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    kw.update(overrides)
    return LlamaConfig(**kw)


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig, draft_vocab_size: int | None = None, fc_bias: bool = False) -> None:
        super().__init__()
        if config.num_hidden_layers < 1:
            raise SpecdecError(f"an EAGLE head needs a decoder layer, config says {config.num_hidden_layers}")
        config._attn_implementation = "sdpa"
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE: the fc output enters the layer un-normalised
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.draft_vocab_size = draft_vocab_size
        self.meta: dict = {}  # the "specdec" block of config.json (training recipe, target fingerprint)
        if draft_vocab_size is not None:
            self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.arange(draft_vocab_size))  # absolute target ids
        else:
            self.lm_head = None
            self.register_buffer("d2t", None)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None) -> torch.Tensor:
        """Reference/training forward. embeds = embed(x_{t+1}), features = f_t, both [B, T, H];
        returns f̂_{t+1} [B, T, H]. Causal by default (right padding is harmless: pads never reach real
        rows); attention_mask [B, 1, T, cached + T] bool and an HF cache serve unrolled training."""
        b, t, _ = embeds.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=embeds.device).expand(b, t)
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos_sin = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                      use_cache=past_key_values is not None, position_embeddings=cos_sin)
        return x

    @torch.no_grad()
    def grow(self, n_layers: int) -> None:
        """Append pre-norm decoder layers whose residual branches start at zero (o_proj, down_proj = 0):
        the deeper head computes exactly what this one did, and training takes it from there."""
        if n_layers < len(self.layers):
            raise SpecdecError(f"cannot shrink a {len(self.layers)}-layer head to {n_layers} layers")
        ref = self.fc.weight
        for i in range(len(self.layers), n_layers):
            layer = LlamaDecoderLayer(self.config, i).to(ref.device, ref.dtype)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            self.layers.append(layer)
        self.config.num_hidden_layers = n_layers

    def logits(self, hidden: torch.Tensor, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """Over the draft vocabulary (the full target vocabulary unless reduced)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if target_lm_head is None:
            raise ValueError("a full-vocabulary head needs the target's LM head weight")
        return F.linear(hidden, target_lm_head)

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """Reduce the LM head to `token_ids` (target ids), initialised from the target's rows."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() == 0 or int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
            raise SpecdecError(f"draft vocabulary ids must lie in [0, {self.vocab_size})")
        self.draft_vocab_size = ids.numel()
        self.lm_head = nn.Linear(self.hidden_size, ids.numel(), bias=False).to(target_lm_head.device)
        self.lm_head.weight.copy_(target_lm_head[ids.to(target_lm_head.device)])
        self.d2t = ids.to(target_lm_head.device)

    def t2d(self) -> torch.Tensor:
        m = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.fc.weight.device)
        if self.d2t is not None:
            m[self.d2t] = True
        else:
            m[:] = True
        return m
