"""Any HF causal LM through its own forward: 4D float mask + explicit positions + DynamicCache.

Slower than LeanRunner on the CPU but works for every architecture transformers knows.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdec.runtime.base import ForwardOut, Runner, chain_mask
from specdec.runtime.kv import Rows
from specdec.runtime.packed import precision_name


class HFCache(Rows):
    """HF's DynamicCache behind the shared accounting: its tensors grow by concatenation, so dropped rows
    are sliced off rather than left to be overwritten."""

    def __init__(self, config, device: torch.device) -> None:
        super().__init__()
        self.config, self.device = config, device
        self.dynamic = DynamicCache(config=config)

    def reset(self) -> None:
        self.dynamic = DynamicCache(config=self.config)
        super().reset()

    def _layers(self):
        return [layer for layer in self.dynamic.layers if getattr(layer, "keys", None) is not None]

    def _drop(self, length: int) -> None:
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for layer in self._layers():
            layer.keys[:, :, dst] = layer.keys[:, :, src]
            layer.values[:, :, dst] = layer.values[:, :, src]


class HFRunner(Runner):
    def __init__(self, model) -> None:
        self.model = model.eval()
        self.config = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.weights = precision_name(p.dtype)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.hidden_size = model.config.hidden_size
        self.n_layers = model.config.num_hidden_layers
        self.max_length = model.config.max_position_embeddings
        self.cache = HFCache(model.config, self.device)

    @torch.inference_mode()
    def _forward(self, tokens, positions, mask, logits_rows, aux_layers=()) -> ForwardOut:
        n = tokens.numel()
        start = self.length + self.n_pending
        if mask is None:
            mask = chain_mask(start, n, self.device)
        float_mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        float_mask.masked_fill_(~mask.to(self.device), torch.finfo(self.dtype).min)
        out = self.decoder(
            input_ids=tokens[None],
            position_ids=positions[None],
            attention_mask=float_mask[None, None],
            past_key_values=self.cache.dynamic,
            use_cache=True,
            output_hidden_states=bool(aux_layers),
        )
        feats = out.last_hidden_state[0]
        rows = feats if logits_rows is None else feats[logits_rows]
        # hidden_states[i] is the input of layer i
        aux = torch.cat([out.hidden_states[i][0] for i in aux_layers], -1) if aux_layers else None
        return ForwardOut(self.lm_head(rows), feats, aux)
