"""The feature-level draft head (EAGLE, docs/design.md, "Drafters"; and FSPAD's variants) as an nn.Module: for
training and as the weights the lean heads.runner.HeadRunner packs.

Row t of the head reads (x_{t+1}, f_t): a connector (EAGLE's fc(cat(embed(x_{t+1}), f_t)), or FSPAD's
Feature Sampler) -> one Llama decoder layer without input norm (EAGLE; optionally more, ordinary
pre-norm layers after it) -> f̂_{t+1}, at position t. Token logits come from the target's frozen LM
head (no final norm), or from a reduced head over the V_d most frequent tokens with a draft->target id
map. With PAD (FSPAD) the last layer has two outputs: f̂ continues the draft, f̃ gives the logits.
Eagle3Head (EAGLE-3) reads other target states and has its own layer and final norm: see its docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specdec.errors import SpecdecError
from specdec.heads.fspad import CONNECTORS, feature_sampler, pad_outputs

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


class FeatureSampler(nn.Module):
    """FSPAD's connector (heads.fspad.feature_sampler); tensors sampler.{gate,up,down}_proj.weight."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return feature_sampler(embeds, features, self.gate_proj, self.up_proj, self.down_proj)


class EagleHead(nn.Module):
    kind = "eagle"
    aux_layers: tuple[int, ...] = ()  # target layers whose input hidden states it reads (target_input)
    feature_loss = True  # its output f̂_{t+1} is trained towards the target's feature f_{t+1}

    def __init__(self, config: LlamaConfig, draft_vocab_size: int | None = None, fc_bias: bool = False,
                 connector: str = "fc", pad: bool = False, sampler_size: int | None = None) -> None:
        """connector "fc" (EAGLE) or "sampler" (FSPAD's Feature Sampler, intermediate size `sampler_size`,
        default the target's intermediate_size); pad: FSPAD's Partial Alignment Distillation."""
        super().__init__()
        if config.num_hidden_layers < 1:
            raise SpecdecError(f"an EAGLE head needs a decoder layer, config says {config.num_hidden_layers}")
        if connector not in CONNECTORS:
            raise SpecdecError(f"connector must be one of {', '.join(CONNECTORS)}, got {connector!r}")
        config._attn_implementation = "sdpa"
        self.config = config
        h = config.hidden_size
        self.connector, self.pad = connector, bool(pad)
        self.sampler_size = (sampler_size or config.intermediate_size) if connector == "sampler" else None
        self.fc = nn.Linear(2 * h, h, bias=fc_bias) if connector == "fc" else None
        self.sampler = FeatureSampler(h, self.sampler_size) if connector == "sampler" else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE: the connector's output enters un-normalised
        if self.pad:  # the last layer's MLP writes f and f̃ (heads.fspad.pad_outputs)
            self.layers[-1].mlp.down_proj = nn.Linear(config.intermediate_size, 2 * h, bias=config.mlp_bias)
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

    def target_input(self, features: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """What row t reads from the target at a committed position: EAGLE's f_t (aux: unused)."""
        return features

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                past_key_values=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference/training forward. embeds = embed(x_{t+1}), features = f_t, both [B, T, H]; returns
        (f̂_{t+1}, the input of the LM head), both [B, T, H]: the same tensor unless the head has PAD.
        Causal by default (right padding is harmless: pads never reach real rows); attention_mask
        [B, 1, T, cached + T] bool and an HF cache serve unrolled training."""
        b, t, _ = embeds.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=embeds.device).expand(b, t)
        if self.sampler is not None:
            x = self.sampler(embeds, features)
        else:
            x = self.fc(torch.cat([embeds, features], dim=-1))
        cos_sin = self.rotary_emb(x, position_ids)
        kw = dict(attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                  position_embeddings=cos_sin)
        for layer in self.layers[:-1] if self.pad else self.layers:
            x = layer(x, use_cache=past_key_values is not None, **kw)
        if not self.pad:
            return x, x
        # PAD: LlamaDecoderLayer adds an H-wide MLP output to its residual; this one is 2H wide
        last = self.layers[-1]
        x = x + last.self_attn(last.input_layernorm(x), **kw)[0]
        return pad_outputs(x, last.mlp(last.post_attention_layernorm(x)))

    @torch.no_grad()
    def grow(self, n_layers: int) -> None:
        """Append pre-norm decoder layers whose residual branches start at zero (o_proj, down_proj = 0):
        the deeper head computes exactly what this one did, and training takes it from there."""
        if n_layers < len(self.layers):
            raise SpecdecError(f"cannot shrink a {len(self.layers)}-layer head to {n_layers} layers")
        if self.pad and n_layers > len(self.layers):
            raise SpecdecError("cannot grow a PAD head: its two outputs come from its last layer")
        ref = self.layers[0].self_attn.q_proj.weight
        for i in range(len(self.layers), n_layers):
            layer = LlamaDecoderLayer(self.config, i).to(ref.device, ref.dtype)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            self.layers.append(layer)
        self.config.num_hidden_layers = n_layers

    @torch.no_grad()
    def with_variant(self, connector: str, pad: bool, sampler_size: int | None = None) -> EagleHead:
        """This head with FSPAD's options added (a warm start of an FSPAD head from an EAGLE one): every
        tensor of the same name and shape is kept; a new Feature Sampler starts with down_proj = 0 (η = f);
        a new PAD down_proj writes the old MLP output twice, so f = f̃ = the old output. Dropping an
        option is refused: what it learned has no place in the other head."""
        if (self.connector == "sampler" and connector != "sampler") or (self.pad and not pad):
            raise SpecdecError(f"cannot turn a head with connector={self.connector}, pad={self.pad} into "
                               f"connector={connector}, pad={pad}: only FSPAD's options can be added")
        if self.sampler is not None and sampler_size not in (None, self.sampler_size):
            raise SpecdecError(f"the head's Feature Sampler has size {self.sampler_size}, not {sampler_size}")
        sampler_size = sampler_size or self.sampler_size
        ref = self.layers[0].self_attn.q_proj.weight
        new = EagleHead(self.config, self.draft_vocab_size, connector=connector, pad=pad,
                        sampler_size=sampler_size if connector == "sampler" else None).to(ref.device, ref.dtype)
        mine, theirs = self.state_dict(), new.state_dict()
        keep = {k: v for k, v in mine.items() if k in theirs and v is not None and theirs[k] is not None
                and v.shape == theirs[k].shape}
        new.load_state_dict(keep, strict=False)
        if new.sampler is not None and self.sampler is None:
            new.sampler.down_proj.weight.zero_()
        if pad and not self.pad:
            new.layers[-1].mlp.down_proj.weight.copy_(self.layers[-1].mlp.down_proj.weight.repeat(2, 1))
        new.meta = dict(self.meta)
        return new

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
        m = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.layers[0].self_attn.q_proj.weight.device)
        if self.d2t is not None:
            m[self.d2t] = True
        else:
            m[:] = True
        return m


class Eagle3Head(EagleHead):
    """EAGLE-3 (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
    Training-Time Test"): the EAGLE head with three changes.

    1. It reads the hidden states entering k target layers (low, middle, high: `aux_layers`), fused by
       fc: kH -> H (`target_input`); draft steps past the first read the head's own output h' instead.
    2. Its one decoder layer normalises the token embedding (input_layernorm) and the hidden input
       (hidden_norm) apart, and its attention reads both concatenated (q/k/v take 2H); the residual is the
       un-normalised hidden input; then post_attention_layernorm + MLP as in Llama.
    3. h' is no target feature (no feature loss): the logits are lm_head(norm(h')) with its own norm.
    Tensors: fc.weight [H, kH], layers.0.{input_layernorm,hidden_norm}.weight, the layer's usual
    tensors, norm.weight."""

    kind = "eagle3"
    feature_loss = False

    def __init__(self, config: LlamaConfig, aux_layers: tuple[int, ...] | list[int],
                 draft_vocab_size: int | None = None) -> None:
        if config.num_hidden_layers != 1:
            raise SpecdecError(f"an EAGLE-3 head has one decoder layer, config says {config.num_hidden_layers}")
        if not aux_layers:
            raise SpecdecError("an EAGLE-3 head needs the target layers it reads (aux_layers)")
        super().__init__(config, draft_vocab_size)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.aux_layers = tuple(int(i) for i in aux_layers)
        self.fc = nn.Linear(len(self.aux_layers) * h, h, bias=False)
        layer = self.layers[0]
        layer.input_layernorm, layer.hidden_norm = LlamaRMSNorm(h, eps), LlamaRMSNorm(h, eps)
        a = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(a, name)
            setattr(a, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.norm = LlamaRMSNorm(h, eps)

    @torch.no_grad()
    def start_as(self, layer: dict[str, torch.Tensor], norm: torch.Tensor) -> None:
        """Start the draft layer as a target decoder layer (fp32 tensors named as in HF's Llama layer, its
        final norm `norm`): the hidden half of q/k/v, o, the MLP, its norms; the embedding half of q/k/v
        at zero and fc passing the highest aux layer's state through. A narrower MLP keeps the target's
        intermediate channels with the largest |gate| |up| |down|. Biases the head lacks are left out."""
        h = self.hidden_size
        a, mlp, own = self.layers[0].self_attn, self.layers[0].mlp, self.layers[0]
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(a, name).weight
            w.zero_()
            w[:, h:] = layer[f"self_attn.{name}.weight"]
        a.o_proj.weight.copy_(layer["self_attn.o_proj.weight"])
        gate, up, down = (layer[f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
        keep = score.topk(mlp.gate_proj.weight.shape[0]).indices.sort().values
        mlp.gate_proj.weight.copy_(gate[keep])
        mlp.up_proj.weight.copy_(up[keep])
        mlp.down_proj.weight.copy_(down[:, keep])
        own.hidden_norm.weight.copy_(layer["input_layernorm.weight"])
        own.post_attention_layernorm.weight.copy_(layer["post_attention_layernorm.weight"])
        self.norm.weight.copy_(norm)
        self.fc.weight.zero_()
        self.fc.weight[:, -h:] = torch.eye(h)

    @staticmethod
    def default_layers(n_layers: int) -> list[int]:
        """EAGLE-3's low, middle and high layers of an n-layer target (those of official exports)."""
        return sorted({min(2, n_layers - 1), n_layers // 2, max(n_layers - 3, 0)})

    def target_input(self, features: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """fc(the aux layers' hidden states [.., kH]) -> [.., H] (features: unused)."""
        if aux is None:
            raise SpecdecError("an EAGLE-3 head reads the target's aux-layer hidden states, none were given")
        return self.fc(aux)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                past_key_values=None) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds = embed(x_{t+1}), features = the hidden input (target_input's, or the head's own h'),
        both [B, T, H]; returns (h', norm(h')), the next step's hidden input and the LM head's input.
        Masks and caches as EagleHead.forward."""
        b, t, _ = embeds.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=embeds.device).expand(b, t)
        layer = self.layers[0]
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)
        attn = layer.self_attn(x, position_embeddings=self.rotary_emb(features, position_ids),
                               attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, use_cache=past_key_values is not None)[0]
        h = features + attn
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, self.norm(h)

    def grow(self, n_layers: int) -> None:
        if n_layers != 1:
            raise SpecdecError("an EAGLE-3 head has one decoder layer: --layers does not apply")

    def with_variant(self, connector: str, pad: bool, sampler_size: int | None = None) -> EagleHead:
        raise SpecdecError("FSPAD's options (--connector sampler, --pad) do not apply to an EAGLE-3 head")
