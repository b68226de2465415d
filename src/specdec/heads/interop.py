"""Draft heads in and out: import published EAGLE-1/2, EAGLE-3 and Medusa checkpoints into our head dirs,
and export ours for vLLM, SGLang and llama.cpp (EAGLE-3 only: heads.llamacpp).

Published layouts (detected from the files; see heads.io and heads.medusa_formats for the tensors):
  EAGLE-1/2 (SafeAILab): a LlamaConfig with num_hidden_layers 1 (+ "bias"), fc.weight [H, 2H] (+ fc.bias),
    layers.0.* without input_layernorm, no lm_head (the target's is used).
  EAGLE-3 (SafeAILab, SpecForge): LlamaForCausalLMEagle3, midlayer.*, fc.weight [H, 3H], norm.weight,
    lm_head.weight [draft_vocab_size, H], d2t (offsets: target = draft + d2t[draft]), t2d.
  Medusa (FasterDecoding, vLLM): medusa_lm_head.safetensors / .pt, or a "medusa" config.

What the engines build (what an export must match, or be refused):
  vLLM EagleLlamaForCausalLM: fc without a bias (fc.bias in a file is dropped), one layer here (deeper
    heads refused), no reduced vocabulary. Eagle3LlamaForCausalLM: fc over 3 target layers, layers.0.*
    (it also maps midlayer.*), lm_head [draft_vocab_size, H]; the file keeps the name d2t, which its
    loader renames to draft_id_to_target_id (a tensor already named so would be prefixed "model." and
    skipped); target layers from eagle_aux_hidden_state_layer_ids. MedusaModel: heads.medusa_formats.
  SGLang LlamaForCausalLMEagle: fc always with a bias (zeros written when ours has none), the
    target's LM head. LlamaForCausalLMEagle3: midlayer.*, d2t read as its hot-token map, target
    layers from eagle_config.eagle_aux_hidden_state_layer_ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.files import atomic_dir, read_json_object
from specdec.heads import ENGINES
from specdec.heads.io import _is_eagle3, _read_tensors, load_head, save_head
from specdec.heads.llamacpp import TargetGGUF, export_llamacpp
from specdec.heads.medusa_formats import MEDUSA_FILES, export_vllm, import_medusa
from specdec.heads.medusa_io import save_medusa
from specdec.heads.model import EagleHead

ARCHITECTURES = {("eagle", "vllm"): "EagleLlamaForCausalLM", ("eagle", "sglang"): "LlamaForCausalLMEagle",
                 ("eagle3", "vllm"): "Eagle3LlamaForCausalLM", ("eagle3", "sglang"): "LlamaForCausalLMEagle3",
                 ("medusa", "vllm"): "MedusaModel", ("eagle3", "llamacpp"): "eagle3 GGUF (--spec-type draft-eagle3)"}
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_NOT_ENGINE = ("specdec", "connector", "pad", "sampler_intermediate_size", "_attn_implementation_autoset",
               "transformers_version")


def detect(path: str | os.PathLike) -> str:
    """"eagle" (EAGLE-1/2, ours with FSPAD's variants too), "eagle3" or "medusa", from the files; anything
    else is refused in one line, naming what each format holds."""
    path = Path(path)
    if not path.is_dir():
        raise SpecdecError(f"head {str(path)!r} is not a directory")
    cfg = _config(path)
    if any((path / f).is_file() for f in MEDUSA_FILES) or (
            cfg is not None and (cfg.get("model_type") == "medusa" or "medusa_num_heads" in cfg)):
        return "medusa"
    if cfg is not None and any((path / f).is_file() for f in _WEIGHTS):
        keys = _read_tensors(path)
        if _is_eagle3(cfg, keys):
            return "eagle3"
        if ("fc.weight" in keys or "sampler.gate_proj.weight" in keys) and any(k.startswith("layers.0.") for k in keys):
            return "eagle"
    raise SpecdecError(f"{path} holds no draft head in a known format (EAGLE-1/2: config.json + fc.weight and "
                       "layers.0.*; EAGLE-3: LlamaForCausalLMEagle3 or midlayer.*; Medusa: "
                       f"{' / '.join(MEDUSA_FILES)} or a 'medusa' config.json)")


def _config(path: Path) -> dict | None:
    f = path / "config.json"
    if not f.is_file():
        return None
    return read_json_object(f, f"head {path}")


def load_any(path: str | os.PathLike, target_lm_head: torch.Tensor | None = None, target_layers: int | None = None):
    """(kind, head): an EagleHead / Eagle3Head or MedusaHeads in any known layout, checked against the
    target when its LM head [V, H] is given (every tensor's shape; a mismatch names the tensor)."""
    kind = detect(path)
    h = v = None
    if target_lm_head is not None:
        v, h = target_lm_head.shape
    if kind == "medusa":
        return kind, import_medusa(path, target_lm_head, h, v)
    return kind, load_head(path, h, v, target_lm_head=target_lm_head, target_layers=target_layers)


def import_head(src: str | os.PathLike, out: str | os.PathLike, target_lm_head: torch.Tensor | None = None,
                target_layers: int | None = None) -> tuple[str, object]:
    """Read a published head (detected), write it in our format at `out` (atomically); returns (kind, head)."""
    if Path(out).resolve() == Path(src).resolve():
        raise SpecdecError("--out must differ from SRC (the import writes a new directory)")
    kind, head = load_any(src, target_lm_head, target_layers)
    if kind == "medusa":
        save_medusa(head, out)
        return kind, head
    keep = {k: v for k, v in head.meta.items() if k not in ("kind", "reduced_vocab", "lm_head")}
    save_head(head, out, extra={"imported_from": str(src), **keep})
    return kind, head


def export_head(src: str | os.PathLike, to: str, out: str | os.PathLike, target_lm_head: torch.Tensor | None = None,
                target_layers: int | None = None, target_gguf: str | os.PathLike | None = None) -> str:
    """Write the head at `src` (any known layout) for engine `to`; returns its architecture name. A head the
    engine would load but draft differently is refused, naming the option it cannot represent. `to` =
    llamacpp writes one .gguf file at `out` and needs the target's GGUF (`target_gguf`: its tokenizer)."""
    if to not in ENGINES:
        raise SpecdecError(f"--to must be one of {', '.join(ENGINES)}, got {to!r}")
    if Path(out).resolve() == Path(src).resolve():
        raise SpecdecError("--out must differ from the head's directory (the export writes a new directory)")
    if to == "llamacpp":
        return _export_llamacpp(src, out, target_gguf, target_lm_head)
    kind, head = load_any(src, target_lm_head, target_layers)
    if (kind, to) not in ARCHITECTURES:
        raise SpecdecError(f"{to} has no {kind} drafter: export these heads --to vllm")
    if kind == "medusa":
        export_vllm(head, out, target_lm_head)
    elif kind == "eagle3":
        _export_eagle3(head, to, out, target_lm_head)
    else:
        _export_eagle(head, to, out)
    return ARCHITECTURES[kind, to]


def _export_llamacpp(src, out, target_gguf, target_lm_head: torch.Tensor | None) -> str:
    """target_lm_head: the rows of a reduced-vocabulary head that left them to the target (--freeze-lm-head)."""
    if target_gguf is None:
        raise SpecdecError("--to llamacpp needs the target's .gguf file (--model FILE.gguf, or smollm2): "
                           "llama.cpp checks the draft's vocabulary against it, and its tokenizer is copied")
    kind = detect(src)
    if kind != "eagle3":
        why = "Medusa" if kind == "medusa" else "EAGLE-1/2"
        raise SpecdecError(f"llama.cpp has no {why} drafter (its --spec-type draft-eagle3 runs EAGLE-3 heads "
                           "only): export this head --to vllm" + (" or --to sglang" if kind == "eagle" else ""))
    target = TargetGGUF(target_gguf)
    _, head = load_any(src, target_lm_head, target.layers)
    export_llamacpp(head, out, target_gguf)
    return ARCHITECTURES["eagle3", "llamacpp"]


def _engine_config(head: EagleHead, arch: str) -> dict:
    cfg = {k: v for k, v in head.config.to_dict().items() if k not in _NOT_ENGINE}
    cfg["architectures"] = [arch]
    cfg["torch_dtype"] = str(head.layers[0].self_attn.q_proj.weight.dtype).removeprefix("torch.")
    return cfg


def _write(out, sd: dict[str, torch.Tensor], cfg: dict) -> None:
    from safetensors.torch import save_file

    with atomic_dir(out) as tmp:
        save_file({k: t.detach().contiguous().cpu() for k, t in sd.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))


def _export_eagle(head: EagleHead, to: str, out) -> None:
    name = {"vllm": "vLLM", "sglang": "SGLang"}[to]
    if head.connector != "fc":
        raise SpecdecError(f"{name}'s EAGLE has no Feature Sampler: this head has connector=sampler (FSPAD), "
                           "which no engine checkpoint can carry")
    if head.pad:
        raise SpecdecError(f"{name}'s EAGLE has no PAD output: this head has pad=true (FSPAD), which no engine "
                           "checkpoint can carry")
    if head.d2t is not None:
        raise SpecdecError(f"{name}'s EAGLE-1/2 checkpoint has no reduced vocabulary: this head drafts from "
                           f"draft_vocab_size={head.draft_vocab_size} of {head.vocab_size} tokens")
    if to == "vllm" and len(head.layers) > 1:
        raise SpecdecError(f"vLLM's EAGLE-1 is exported here with one decoder layer: this head has "
                           f"{len(head.layers)} (--layers {len(head.layers)}); use --to sglang")
    sd = {k: t for k, t in head.state_dict().items() if t is not None and k != "d2t"}
    bias = sd.pop("fc.bias", None)
    cfg = _engine_config(head, ARCHITECTURES["eagle", to])
    if to == "vllm":
        # vLLM builds fc without a bias and drops fc.bias: only a zero bias survives that
        if bias is not None and bool(bias.any()):
            raise SpecdecError("vLLM's EAGLE-1 drops fc.bias and this head's is not zero: it would draft "
                               "differently there; export it --to sglang, or use a head trained without the bias")
        cfg["bias"] = False
    else:
        # SGLang's fc always has a bias: zeros are the bias-free head
        sd["fc.bias"] = bias if bias is not None else torch.zeros(head.hidden_size, dtype=sd["fc.weight"].dtype)
        cfg["bias"] = True
    _write(out, sd, cfg)


def _export_eagle3(head: EagleHead, to: str, out, target_lm_head: torch.Tensor | None) -> None:
    name = {"vllm": "vLLM", "sglang": "SGLang"}[to]
    layers = list(head.aux_layers)
    if len(layers) != 3:
        raise SpecdecError(f"{name}'s EAGLE-3 fuses exactly 3 target layers and this head reads {len(layers)} "
                           f"({layers}): train it with 3 aux layers (datagen --aux-layers)")
    sd = {k: t for k, t in head.state_dict().items() if t is not None and k not in ("d2t", "lm_head.weight")}
    if head.lm_head is not None:
        rows, ids = head.lm_head.weight, head.d2t.cpu()
    else:  # a full-vocabulary head reads the target's LM head: the engines want rows in the file
        if target_lm_head is None:
            raise SpecdecError(f"this EAGLE-3 head uses the target's LM head, which {name} reads from the head's "
                               "file: give the target (--model) so its rows are written")
        rows, ids = target_lm_head, torch.arange(head.vocab_size)
    sd["lm_head.weight"] = rows.to(sd["fc.weight"].dtype)
    sd["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros(head.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    sd["t2d"] = t2d
    if to == "sglang":
        sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): t for k, t in sd.items()}
    cfg = _engine_config(head, ARCHITECTURES["eagle3", to])
    cfg.update(draft_vocab_size=ids.numel(), target_hidden_size=head.hidden_size, bias=False,
               eagle_config={"eagle_aux_hidden_state_layer_ids": layers}, eagle_aux_hidden_state_layer_ids=layers)
    _write(out, sd, cfg)
