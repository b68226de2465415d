"""Batch-1 inference for an EagleHead on the target's lean machinery: llama.Block layers (the first
without input norm), a kv.KVCache, explicit positions and a bool mask, and the same commit/rollback
protocol as the target runners."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.errors import SpecdecError
from specdec.target.base import Cached
from specdec.target.kv import KVCache
from specdec.target.llama import Block, Rope, chain_attention
from specdec.target.packed import Linear

if TYPE_CHECKING:  # heads.model imports transformers' Llama modules (seconds): drafting does not need them
    from specdec.heads.model import EagleHead


class HeadRunner(Cached):
    overflow = "the EAGLE head's cache would exceed {} rows"

    def __init__(self, head: EagleHead, embed: torch.Tensor,
                 lm_head: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
                 pack: bool = True, initial_capacity: int = 512, weights: str | None = None) -> None:
        cfg = head.config
        if embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise SpecdecError(f"target embeddings are {tuple(embed.shape)}, the EAGLE head expects "
                               f"{(cfg.vocab_size, cfg.hidden_size)}")
        # weights: the precision of the target it drafts for (a cheaper target wants a cheaper draft)
        self.fc = Linear(head.fc.weight, head.fc.bias, pack, weights)
        self.layers = [Block(layer, i, cfg.rms_norm_eps, pack, weights) for i, layer in enumerate(head.layers)]
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
        self.hidden_size = cfg.hidden_size
        self.max_length = cfg.max_position_embeddings
        self.device, self.dtype = embed.device, head.fc.weight.dtype
        self.cache = KVCache(len(self.layers), cfg.num_key_value_heads, cfg.head_dim, self.max_length, self.device,
                             self.dtype, initial_capacity)
        self.rope = Rope(head.rotary_emb, self.device, self.dtype, self.max_length)
        self.rope.grow(self.cache.capacity)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [n] target ids of x_{t+1}, features [n, H] f_t (target's or the head's own f̂);
        mask [n, cached + n] bool (default: causal after every cached row). Returns f̂_{t+1} [n, H]."""
        n = tokens.numel()
        start, positions = self._new_rows(n, positions, mask)
        kv = self.cache
        if start + n > kv.capacity:
            kv.reserve(n)
            self.rope.grow(kv.capacity)
        e = F.embedding(tokens.to(self.device), self.embed).to(self.dtype)
        h = self.fc(torch.cat([e, features.to(self.dtype)], dim=-1))[None]
        cos, sin = self.rope(positions)
        causal = False
        if mask is None:
            mask, causal = chain_attention(start, n, self.device)
        else:
            mask = mask.to(self.device)
        for layer in self.layers:
            h = layer(h, cos, sin, kv, start, mask, causal)
        kv.n_pending += n
        return h[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary; map indices with `to_target`."""
        return self.lm(hidden)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]
