"""Hydra heads (Ankner et al., 2024): Medusa heads made sequentially dependent.

Head k (0-based) predicts the token at depth k + 1 below the root, as Medusa's head k, but reads the
embeddings of the tokens on its path too: the root (the token the target emitted from f_t) and the
drafts at depths 1..k, from the target's input embedding table E:
    x = [f, E[root], E[d_1], ..., E[d_k]];  h = f + SiLU(W_0 x + b_0);  h = h + SiLU(W_l h + b_l) (l >= 1);
    logits = LM_k(h).
W_0 starts at zero, so every head begins as the target's own LM head on f (Medusa's identity init).
Everything else (LM heads shared or own, a reduced draft vocabulary, the file layout) is MedusaHeads';
on disk config.json says model_type "hydra" and W_0 of head k is [H, (k + 2) H].

Hydra++'s prefix attention (optional): one decoder layer of the target's shape (`prefix.*` tensors, sizes
in config.json "prefix_attention") runs causally over the features of the whole context, and its output g
replaces f above. Its o_proj and down_proj start at zero, so it starts as the identity (g = f). At decode
time it keeps a KV cache of the committed rows (PrefixRunner).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import SpecdecError
from specdec.heads.medusa import MedusaHeads
from specdec.runtime.base import Cached
from specdec.runtime.kv import KVCache
from specdec.runtime.llama import Block, Rope, chain_attention, make_room
from specdec.runtime.packed import Linear

# the target's sizes a prefix layer copies (config.json "prefix_attention")
PREFIX_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "max_position_embeddings", "rope_parameters")


class HydraHeads(MedusaHeads):
    model_type = "hydra"
    label = "Hydra"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 lm_head: str = "target", prefix: dict | None = None) -> None:
        super().__init__(hidden_size, vocab_size, num_heads, num_layers, lm_head)
        for k, blk in enumerate(self.blocks):
            blk.layers[0] = nn.Linear((k + 2) * hidden_size, hidden_size)
            with torch.no_grad():
                blk.layers[0].weight.zero_()
                blk.layers[0].bias.zero_()
        self.prefix_config, self.prefix, self.prefix_rotary = None, None, None
        if prefix is not None:
            self._add_prefix(prefix)

    def config_extra(self) -> dict:
        return {} if self.prefix_config is None else {"prefix_attention": self.prefix_config}

    @classmethod
    def config_kwargs(cls, raw: dict, path) -> dict:
        prefix = raw.get("prefix_attention")
        if prefix is not None and not isinstance(prefix, dict):
            raise SpecdecError(f"Hydra heads {path}: config.json prefix_attention must be an object of a decoder "
                               f"layer's sizes, got {prefix!r}")
        return {"prefix": prefix}

    @staticmethod
    def prefix_sizes(target_config) -> dict:
        """A prefix layer's sizes: the target's (config.json "prefix_attention")."""
        out = {k: getattr(target_config, k, None) for k in PREFIX_KEYS}
        out["head_dim"] = out["head_dim"] or target_config.hidden_size // target_config.num_attention_heads
        return {k: dict(v) if isinstance(v, dict) else v for k, v in out.items() if v is not None}

    def llama_config(self):
        from transformers import LlamaConfig

        cfg = LlamaConfig(**self.prefix_config, num_hidden_layers=1, hidden_act="silu", attention_bias=False,
                          mlp_bias=False)
        cfg._attn_implementation = "sdpa"  # causal without a mask tensor (context passes none)
        return cfg

    def _add_prefix(self, sizes: dict) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        if sizes.get("hidden_size") != self.hidden_size:
            raise SpecdecError(f"prefix_attention hidden_size must be the heads' {self.hidden_size}, got "
                               f"{sizes.get('hidden_size')!r}")
        self.prefix_config = dict(sizes)
        try:
            cfg = self.llama_config()
            self.prefix, self.prefix_rotary = LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise SpecdecError(f"prefix_attention sizes are not a decoder layer's: {e}") from None
        with torch.no_grad():  # the identity at the start: g = f
            self.prefix.self_attn.o_proj.weight.zero_()
            self.prefix.mlp.down_proj.weight.zero_()

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, H] of whole sequences (from position 0; right padding is harmless) -> g, the
        prefix layer's causal output; f itself without one."""
        if self.prefix is None:
            return features
        b, t, _ = features.shape
        pos = torch.arange(t, device=features.device).expand(b, t)
        return self.prefix(features, attention_mask=None, position_ids=pos, past_key_values=None, use_cache=False,
                           position_embeddings=self.prefix_rotary(features, pos))

    def head_hidden(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Head k on its inputs x [..., (k + 2) H] (f first) -> [..., H]."""
        layers = self.blocks[k].layers
        h = x[..., :self.hidden_size] + F.silu(layers[0](x))
        for lin in layers[1:]:
            h = h + F.silu(lin(h))
        return h

    def hidden_of(self, ids: torch.Tensor, features: torch.Tensor, embed: torch.Tensor | None) -> torch.Tensor:
        """ids [B, T], features [B, T, H] -> [K, B, T - 2, H]: row j of head k reads f_j and the embeddings
        of x_{j+1}..x_{j+k+1} (teacher forcing on the data's tokens); rows whose path leaves the sequence
        read zeros and are never labels. With a prefix layer, its g_j in place of f_j."""
        if embed is None:
            raise SpecdecError("Hydra heads need the target's input embedding table")
        features = self.context(features)
        b, t, h = features.shape
        n = max(t - 2, 0)
        e = F.pad(F.embedding(ids, embed.to(features.dtype)), (0, 0, 0, self.num_heads + 1))
        out = []
        for k in range(self.num_heads):
            x = torch.cat([features[:, :n]] + [e[:, s:s + n] for s in range(1, k + 2)], dim=-1)
            out.append(self.head_hidden(k, x))
        return torch.stack(out)

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        raise SpecdecError("Hydra heads read the path's tokens too: use hidden_of(ids, features, embed)")


class PrefixRunner(Cached):
    """Hydra++'s prefix layer at decode time: every committed row's feature goes through one llama.Block
    once, in order, on a KV cache of its own; the heads read the last row's output."""

    overflow = "the Hydra prefix layer's cache would exceed {} rows"

    def __init__(self, heads: HydraHeads, device: torch.device, dtype: torch.dtype, pack: bool,
                 weights: str | None, initial_capacity: int = 512) -> None:
        cfg = heads.llama_config()
        self.device, self.dtype, self.max_length = device, dtype, cfg.max_position_embeddings
        self.block = Block(heads.prefix, 0, cfg.rms_norm_eps, pack, weights)
        self.cache = KVCache(1, cfg.num_key_value_heads, cfg.head_dim, self.max_length, device, dtype,
                             initial_capacity)
        self.rope = Rope(heads.prefix_rotary, device, dtype, self.max_length)
        self.rope.grow(self.cache.capacity)

    def fork(self) -> PrefixRunner:
        r = copy.copy(self)
        r.cache = self.cache.fresh(self.cache.capacity)
        return r

    @torch.inference_mode()
    def extend(self, features: torch.Tensor) -> torch.Tensor:
        """features [n, H] of the next n committed rows -> the prefix layer's output of the last, [H]."""
        n = features.shape[0]
        start, positions = self._new_rows(n, None, None)
        kv = self.cache
        make_room(kv, n, [self.rope])
        cos, sin = self.rope(positions)
        mask, causal = chain_attention(start, n, self.device)
        rows = True if self.block.fused is not None and n <= 64 else None
        h = self.block(features.to(self.device, self.dtype)[None], cos, sin, kv, start, mask, causal, rows)
        kv.n_pending += n
        self.commit(range(n))
        return h[0, -1]


class HydraRunner:
    """Inference for HydraHeads: one head on a batch of paths (every node of one tree depth) per call."""

    def __init__(self, heads: HydraHeads, embed: torch.Tensor, target_lm_head: torch.Tensor | Callable | None = None,
                 pack: bool = True, weights: str | None = None) -> None:
        self.num_heads, self.hidden_size, self.vocab_size = heads.num_heads, heads.hidden_size, heads.vocab_size
        self.dtype = heads.blocks[0].layers[0].weight.dtype
        self.layers = [[(lin.weight.detach(), lin.bias.detach()) for lin in blk.layers] for blk in heads.blocks]
        self.embed = embed.detach()
        if heads.lm_heads is not None:
            self.lm = [Linear(lm.weight.detach(), None, pack, weights) for lm in heads.lm_heads]
        elif callable(target_lm_head) and not isinstance(target_lm_head, torch.Tensor):
            if heads.d2t is not None:
                raise SpecdecError("a reduced-vocabulary Hydra head needs the target's LM head weight")
            self.lm = target_lm_head
        elif target_lm_head is not None:
            rows = target_lm_head.detach() if heads.d2t is None else target_lm_head.detach()[heads.d2t]
            self.lm = Linear(rows, None, pack, weights)
        else:
            raise SpecdecError("Hydra heads sharing the target's LM head need its weight")
        self.d2t = None if heads.d2t is None else heads.d2t.detach().clone()
        self.prefix = None if heads.prefix is None else PrefixRunner(heads, self.embed.device, self.dtype, pack,
                                                                     weights)

    def fork(self) -> HydraRunner:
        """The same heads with a prefix cache of its own (nothing else holds per-sequence state)."""
        r = copy.copy(self)
        r.prefix = None if self.prefix is None else self.prefix.fork()
        return r

    def begin(self, features: torch.Tensor) -> torch.Tensor:
        """A new sequence: the features of its prefilled rows [n, H] -> what the heads read for the root."""
        if self.prefix is None:
            return features[-1]
        self.prefix.reset()
        return self.prefix.extend(features)

    def extend(self, features: torch.Tensor) -> torch.Tensor:
        """The features of the rows just committed [n, H] -> what the heads read for the new root."""
        return features[-1] if self.prefix is None else self.prefix.extend(features)

    @torch.inference_mode()
    def step(self, k: int, feature: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        """Head k's logits [R, V'] over the draft vocabulary for R paths: paths [R, k + 1] holds target ids,
        the root first, then the drafts at depths 1..k."""
        r = paths.shape[0]
        f = feature.reshape(1, -1).to(self.dtype).expand(r, -1)
        e = self.embed[paths.reshape(-1)].to(self.dtype).reshape(r, -1)
        x = torch.cat([f, e], dim=-1)
        (w0, b0), *deeper = self.layers[k]
        h = f + F.silu(F.linear(x, w0, b0))
        for w, b in deeper:
            h = h + F.silu(F.linear(h, w, b))
        return self.lm[k](h) if isinstance(self.lm, list) else self.lm(h)

    @torch.inference_mode()
    def logits(self, feature: torch.Tensor, root: int = 0) -> torch.Tensor:
        """[K, V']: every head along the greedy chain from `root` (the draft of a one-path tree)."""
        path, out = [root], []
        for k in range(self.num_heads):
            row = self.step(k, feature, torch.tensor([path]))[0]
            out.append(row)
            path.append(int(self.to_target(row.argmax().reshape(1))[0]))
        return torch.stack(out)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t.to(draft_ids.device)[draft_ids]
