"""Any HF causal LM through its own forward: 4D float mask + explicit positions + DynamicCache.

Slower than LeanRunner on the CPU but works for every architecture transformers knows. Sliding windows are
ours to apply: HF takes a ready 4D mask as it is, so each window gets its own mask (one per layer type where
layers differ, as Gemma 3's forward takes them), and the cache keeps every row (HF's sliding cache layers
would drop rows a tree's compaction still moves).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdec.errors import SpecdecError
from specdec.runtime.base import ForwardOut, Runner, chain_mask, in_window, layer_windows, logit_cap, soft_capped
from specdec.runtime.kv import Rows
from specdec.runtime.packed import precision_name


class HFCache(Rows):
    """HF's DynamicCache behind the shared accounting: its tensors grow by concatenation, so dropped rows
    are sliced off rather than left to be overwritten."""

    def __init__(self, config, device: torch.device, full: bool = False) -> None:
        super().__init__()
        self.config, self.device = config, device
        self.full = full  # full-length layers only (no sliding layers that drop rows)
        self.pos = torch.empty(0, dtype=torch.long, device=device)  # each row's position (windows compare them)
        self.dynamic = self._new()

    def _new(self) -> DynamicCache:
        return DynamicCache() if self.full else DynamicCache(config=self.config)

    def reset(self) -> None:
        self.dynamic = self._new()
        super().reset()

    def _layers(self):
        return [layer for layer in self.dynamic.layers if getattr(layer, "keys", None) is not None]

    def _drop(self, length: int) -> None:
        self.pos = self.pos[:length]
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.pos[dst] = self.pos[src]
        for layer in self._layers():
            layer.keys[:, :, dst] = layer.keys[:, :, src]
            layer.values[:, :, dst] = layer.values[:, :, src]


class HFRunner(Runner):
    def __init__(self, model) -> None:
        self.model = model.eval()
        self.config = model.config
        self.softcap = logit_cap(model.config)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.weights = precision_name(p.dtype)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        self.hidden_size = model.config.hidden_size
        self.n_layers = model.config.num_hidden_layers
        self.max_length = model.config.max_position_embeddings
        windows = layer_windows(model.config, self.n_layers)
        self.windows = sorted(set(windows), key=lambda w: w or 0)
        types = getattr(model.config, "layer_types", None)
        if len(self.windows) > 1 and not types:
            raise SpecdecError(f"backend=hf: {model.config.model_type!r} mixes sliding windows without layer_types; "
                               "use backend=lean")
        # several windows: one mask per layer type, which the model's forward takes as a dict
        self.mask_keys = {t: w for t, w in zip(types, windows)} if len(self.windows) > 1 else None
        self.cache = HFCache(model.config, self.device, full=self.windows != [None])

    @torch.inference_mode()
    def _forward(self, tokens, positions, mask, logits_rows, aux_layers=()) -> ForwardOut:
        n = tokens.numel()
        start = self.length + self.n_pending
        if mask is None:
            mask = chain_mask(start, n, self.device)
        self.cache.pos = torch.cat([self.cache.pos[:start], positions])
        masks = {w: self._float(in_window(mask.to(self.device), positions, self.cache.pos, w))
                 for w in self.windows}
        out = self.decoder(
            input_ids=tokens[None],
            position_ids=positions[None],
            attention_mask=({t: masks[w] for t, w in self.mask_keys.items()} if self.mask_keys
                            else masks[self.windows[0]]),
            past_key_values=self.cache.dynamic,
            use_cache=True,
            output_hidden_states=bool(aux_layers),
        )
        feats = out.last_hidden_state[0]
        rows = feats if logits_rows is None else feats[logits_rows]
        # hidden_states[i] is the input of layer i
        aux = torch.cat([out.hidden_states[i][0] for i in aux_layers], -1) if aux_layers else None
        return ForwardOut(soft_capped(self.lm_head(rows), self.softcap), feats, aux)

    def _float(self, mask: torch.Tensor) -> torch.Tensor:
        """A bool mask [n, cols] as HF's additive float mask [1, 1, n, cols]."""
        out = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        return out.masked_fill_(~mask, torch.finfo(self.dtype).min)[None, None]
