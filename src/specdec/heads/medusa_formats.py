"""Medusa heads in other projects' layouts: detect, import (exactly: same logits) and export.

"specdec": ours (medusa_io.py): config.json with model_type "medusa", num_layers and lm_head; model.safetensors.

"medusa": FasterDecoding/Medusa. medusa_lm_head.safetensors (its newer trainers, TGI, TensorRT-LLM) or
    medusa_lm_head.pt (torch.save of the state dict; what its own `MedusaModel.from_pretrained` reads), holding
    `medusa_head.state_dict()`: head k = nn.Sequential(ResBlock x L, nn.Linear(H, V, bias=False)), ResBlock
    x + SiLU(linear(x)) with a bias, so keys {k}.{l}.linear.weight [H, H], {k}.{l}.linear.bias [H] and
    {k}.{L}.weight [V, H] (whole-model checkpoints prefix them with "medusa_head."). config.json:
    medusa_num_heads, medusa_num_layers, base_model_name_or_path (Medusa-2 configs also carry the base model's
    hidden_size/vocab_size). Every head has its own full-vocabulary LM head; no reduced vocabulary.
    Quirks: published configs sometimes understate medusa_num_heads (its loader hard-codes 5 and loads with
    strict=False), so the tensors decide the counts; its MedusaModel repeats ONE ResBlock object L times, so
    with L > 1 its own runtime ties the layers (TGI and TensorRT-LLM read them separately).

"vllm": vLLM's Medusa (vllm/model_executor/models/medusa.py, vllm/transformers_utils/configs/medusa.py).
    config.json: model_type "medusa", hidden_size, vocab_size, num_heads, num_hidden_layers (its config renames
    any key holding "num"+"heads" / "num"+"layers" to these), truncated_vocab_size (default vocab_size),
    medusa_fc_bias (default false: the residual linears have NO bias and bias tensors in the file are
    silently dropped), original_lm_head (one LM head shared by all heads, read from lm_heads.0.weight or
    lm_head.weight), logit_scale (default 1). Weights (*.safetensors, names may carry "medusa_heads."):
    blocks.{k}.layers.{l}.weight [H, H] (+ .bias when medusa_fc_bias), lm_heads.{k}.weight, and when
    truncated_vocab_size < vocab_size a token_map [V'] of target ids (draft id -> target id; the logits of
    every other token are -inf); the LM head rows are then [V', H], or [V, H] and sliced by token_map.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.files import atomic_dir, read_json_object
from specdec.heads.medusa import MedusaHeads
from specdec.heads.medusa_io import build_heads, check_target, load_medusa

FORMATS = ("specdec", "vllm", "medusa")
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


# ---- detection ----

def _config(path: Path, required: bool = True) -> dict | None:
    f = path / "config.json"
    if not f.is_file():
        if required:
            raise SpecdecError(f"no Medusa heads at {path}: config.json is missing")
        return None
    return read_json_object(f, f"Medusa heads {path}")


def _is_ours(cfg: dict) -> bool:
    return cfg.get("model_type") == "medusa" and "lm_head" in cfg  # vLLM's config has no lm_head key


def detect_format(path: str | os.PathLike) -> str:
    """"specdec" | "medusa" (FasterDecoding) | "vllm", from the files and config.json; a SpecdecError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise SpecdecError(f"Medusa heads {str(path)!r} is not a directory")
    cfg = _config(path, required=not any((path / f).is_file() for f in MEDUSA_FILES))
    if cfg is not None and _is_ours(cfg):
        return "specdec"
    if any((path / f).is_file() for f in MEDUSA_FILES) or (cfg is not None and "medusa_num_heads" in cfg):
        return "medusa"
    if cfg.get("model_type") == "medusa":
        return "vllm"
    raise SpecdecError(f"{path} does not hold Medusa heads in a known layout (config.json model_type is "
                       f"{cfg.get('model_type')!r}; expected specdec's or vLLM's 'medusa' config, or FasterDecoding's "
                       f"{' / '.join(MEDUSA_FILES)})")


# ---- import ----

def import_medusa(path: str | os.PathLike, target_lm_head: torch.Tensor | None = None, hidden_size: int | None = None,
                  vocab_size: int | None = None, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """Heads in any of the three layouts, checked against the target (hidden size and vocabulary: given, or
    read off target_lm_head [V, H]). Foreign LM heads become lm_head "own", or "target" when every one of them
    equals the target's rows (given target_lm_head). Every failure is a one-line SpecdecError."""
    path = Path(path)
    if target_lm_head is not None:
        vocab_size = target_lm_head.shape[0] if vocab_size is None else vocab_size
        hidden_size = target_lm_head.shape[1] if hidden_size is None else hidden_size
    fmt = detect_format(path)
    if fmt == "specdec":
        return load_medusa(path, hidden_size, vocab_size, target_lm_head, device, dtype)
    read = _from_medusa if fmt == "medusa" else _from_vllm
    heads = read(path, target_lm_head, hidden_size, vocab_size)
    return heads.to(device=device, dtype=dtype).eval()


def _load_weights(path: Path, f: Path) -> dict[str, torch.Tensor]:
    try:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(f))
        else:
            sd = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SpecdecError(f"Medusa heads {path}: cannot read {f.name}, the file looks damaged "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in sd.items()):
        raise SpecdecError(f"Medusa heads {path}: {f.name} does not hold a state dict (name -> tensor)")
    return sd


def _take(path: Path, fname: str, sd: dict, key: str, shape: tuple) -> torch.Tensor:
    if key not in sd:
        raise SpecdecError(f"Medusa heads {path}: tensor {key} is missing from {fname}")
    t = sd[key]
    if tuple(t.shape) != shape:
        raise SpecdecError(f"Medusa heads {path}: tensor {key} in {fname} is {tuple(t.shape)}, expected {shape}")
    if not t.is_floating_point():
        raise SpecdecError(f"Medusa heads {path}: tensor {key} in {fname} is {t.dtype}, expected floating point")
    if not torch.isfinite(t).all():
        raise SpecdecError(f"Medusa heads {path}: tensor {key} in {fname} holds NaN/inf: the file is damaged")
    return t


def _int(path: Path, cfg: dict, key: str, default=None):
    v = cfg.get(key, default)
    if v is not None and (type(v) is not int or v < 1):
        raise SpecdecError(f"Medusa heads {path}: config.json {key} must be an integer >= 1, got {v!r}")
    return v


def _assemble(path: Path, fmt: str, cfg: dict, h: int, v: int, blocks: list[list[tuple]], rows: list[torch.Tensor],
              ids: torch.Tensor | None, target_lm_head: torch.Tensor | None) -> MedusaHeads:
    """blocks[k][l] = (weight, bias), rows[k] = head k's LM head over the draft vocabulary `ids`."""
    k_heads, n_layers = len(blocks), len(blocks[0])
    kind = "own"
    if target_lm_head is not None and tuple(target_lm_head.shape) == (v, h):
        t = target_lm_head.detach().cpu()
        t = t if ids is None else t[ids]
        # the target's head (cast to the file's precision): share it, no copies
        if all(torch.equal(r, t.to(r.dtype)) for r in rows):
            kind = "target"
    state = {}
    for k, blk in enumerate(blocks):
        for i, (w, b) in enumerate(blk):
            state[f"blocks.{k}.layers.{i}.weight"], state[f"blocks.{k}.layers.{i}.bias"] = w, b
        if kind == "own":
            state[f"lm_heads.{k}.weight"] = rows[k]
    heads = build_heads(path, h, v, k_heads, n_layers, kind, state, ids)
    meta = cfg.get("specdec")
    heads.meta = dict(meta) if isinstance(meta, dict) else {}
    heads.meta.setdefault("imported_from", fmt)
    return heads


def _from_medusa(path: Path, target_lm_head, hidden_size, vocab_size) -> MedusaHeads:
    cfg = _config(path, required=False) or {}
    f = next((path / n for n in MEDUSA_FILES if (path / n).is_file()), None)
    if f is None:
        raise SpecdecError(f"no Medusa weights in {path} ({' or '.join(MEDUSA_FILES)})")
    sd = _load_weights(path, f)
    if any(k.startswith("medusa_head.") for k in sd):  # a whole-model checkpoint: the heads only
        sd = {k[len("medusa_head."):]: t for k, t in sd.items() if k.startswith("medusa_head.")}
    pat = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")
    parsed = {}
    for key in sd:
        m = pat.fullmatch(key)
        if m is None:
            raise SpecdecError(f"Medusa heads {path}: unexpected tensor {key} in {f.name} (FasterDecoding's layout has "
                               "{head}.{layer}.linear.weight/bias and {head}.{layers}.weight)")
        parsed[key] = (int(m[1]), int(m[2]), m[3])
    if not parsed:
        raise SpecdecError(f"Medusa heads {path}: {f.name} holds no Medusa tensors")
    k_heads = 1 + max(k for k, _, _ in parsed.values())
    lm_at = sorted({i for k, i, p in parsed.values() if k == 0 and p == "weight"})
    if len(lm_at) != 1:
        raise SpecdecError(f"Medusa heads {path}: head 0 in {f.name} needs exactly one LM head (0.{{layers}}.weight), "
                           f"found {len(lm_at)}")
    n_layers = lm_at[0]
    if n_layers < 1:
        raise SpecdecError(f"Medusa heads {path}: head 0 in {f.name} has no residual block (0.0.linear.weight)")
    # the tensors decide the counts (published configs understate medusa_num_heads); only layers must agree
    if (cl := _int(path, cfg, "medusa_num_layers")) is not None and cl != n_layers:
        raise SpecdecError(f"Medusa heads {path}: config.json medusa_num_layers is {cl} but {f.name} holds {n_layers}")
    first, lm0 = sd.get("0.0.linear.weight"), sd.get(f"0.{n_layers}.weight")
    if first is None or first.dim() != 2 or lm0 is None or lm0.dim() != 2:
        raise SpecdecError(f"Medusa heads {path}: tensor 0.0.linear.weight or 0.{n_layers}.weight in {f.name} "
                           "is missing or not a matrix")
    h, v = first.shape[1], lm0.shape[0]
    for key, have in (("hidden_size", h), ("vocab_size", v)):
        if (want := _int(path, cfg, key)) is not None and want != have:
            raise SpecdecError(f"Medusa heads {path}: config.json {key} is {want} but the tensors in {f.name} "
                               f"say {have}")
    check_target(path, h, v, hidden_size, vocab_size)
    want = {f"{k}.{i}.linear.{p}" for k in range(k_heads) for i in range(n_layers) for p in ("weight", "bias")}
    want |= {f"{k}.{n_layers}.weight" for k in range(k_heads)}
    if extra := sorted(set(sd) - want):
        raise SpecdecError(f"Medusa heads {path}: unexpected tensors in {f.name} for {k_heads} heads of {n_layers} "
                           f"layers: {extra[:4]}")
    blocks = [[(_take(path, f.name, sd, f"{k}.{i}.linear.weight", (h, h)),
                _take(path, f.name, sd, f"{k}.{i}.linear.bias", (h,))) for i in range(n_layers)]
              for k in range(k_heads)]
    rows = [_take(path, f.name, sd, f"{k}.{n_layers}.weight", (v, h)) for k in range(k_heads)]
    return _assemble(path, "medusa", cfg, h, v, blocks, rows, None, target_lm_head)


def _vllm_count(cfg: dict, name: str, word: str):
    """vLLM's MedusaConfig.from_pretrained renames any key holding "num" and "heads"/"layers"."""
    if name in cfg:
        return name
    return next((k for k in cfg if "num" in k and word in k), None)


def _vllm_tensors(path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors")) or [p for p in (path / "pytorch_model.bin",) if p.is_file()]
    if not files:
        raise SpecdecError(f"no Medusa weights in {path} (*.safetensors or pytorch_model.bin)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update({k.replace("medusa_heads.", ""): t for k, t in _load_weights(path, f).items()})
    return (files[0].name if len(files) == 1 else "the weight files"), sd


def _from_vllm(path: Path, target_lm_head, hidden_size, vocab_size) -> MedusaHeads:
    cfg = _config(path)
    fname, sd = _vllm_tensors(path)
    hk, lk = _vllm_count(cfg, "num_heads", "heads"), _vllm_count(cfg, "num_hidden_layers", "layers")
    k_heads = _int(path, cfg, hk) if hk else 1 + max((int(m[1]) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))),
                                                      default=-1)
    n_layers = _int(path, cfg, lk) if lk else 1 + max(
        (int(m[1]) for k in sd if (m := re.match(r"blocks\.0\.layers\.(\d+)\.", k))), default=-1)
    if k_heads < 1 or n_layers < 1:
        raise SpecdecError(f"Medusa heads {path}: no blocks.{{head}}.layers.{{layer}}.weight tensors in {fname}")
    if "blocks.0.layers.0.weight" not in sd or sd["blocks.0.layers.0.weight"].dim() != 2:
        raise SpecdecError(f"Medusa heads {path}: tensor blocks.0.layers.0.weight is missing from {fname}")
    h = _int(path, cfg, "hidden_size") or sd["blocks.0.layers.0.weight"].shape[1]
    v = _int(path, cfg, "vocab_size")
    if v is None:
        raise SpecdecError(f"Medusa heads {path}: config.json vocab_size is missing (vLLM would assume 32001)")
    vd = _int(path, cfg, "truncated_vocab_size") or v
    if vd > v:
        raise SpecdecError(f"Medusa heads {path}: config.json truncated_vocab_size {vd} exceeds vocab_size {v}")
    check_target(path, h, v, hidden_size, vocab_size)
    bias = cfg.get("medusa_fc_bias", False)
    if type(bias) is not bool:
        raise SpecdecError(f"Medusa heads {path}: config.json medusa_fc_bias must be true or false, got {bias!r}")
    if not bias and any(k.startswith("blocks.") and k.endswith(".bias") for k in sd):
        raise SpecdecError(f"Medusa heads {path}: {fname} holds bias tensors but config.json medusa_fc_bias is not "
                           "true, so vLLM would drop them; set medusa_fc_bias to true if the heads use them, else "
                           "remove them")
    known = re.compile(r"(blocks\.\d+\.layers\.\d+\.(weight|bias)|lm_heads\.\d+\.weight)")
    want = {f"blocks.{k}.layers.{i}.{p}" for k in range(k_heads) for i in range(n_layers)
            for p in (("weight", "bias") if bias else ("weight",))}
    blocks = [[(_take(path, fname, sd, f"blocks.{k}.layers.{i}.weight", (h, h)),
                _take(path, fname, sd, f"blocks.{k}.layers.{i}.bias", (h,)) if bias else torch.zeros(h))
               for i in range(n_layers)] for k in range(k_heads)]
    ids = order = None
    if vd < v:
        if "token_map" not in sd:
            raise SpecdecError(f"Medusa heads {path}: truncated_vocab_size {vd} < vocab_size {v} needs a token_map "
                               f"tensor, none in {fname}")
        tm = sd["token_map"]
        if tm.is_floating_point() or tm.dim() != 1 or tm.numel() != vd:
            raise SpecdecError(f"Medusa heads {path}: token_map must be {vd} integer target ids, got "
                               f"{tuple(tm.shape)} {tm.dtype}")
        tm = tm.long()
        if int(tm.min()) < 0 or int(tm.max()) >= v or tm.unique().numel() != vd:
            raise SpecdecError(f"Medusa heads {path}: token_map must hold distinct ids inside the vocabulary of {v}")
        ids, order = tm.sort()  # our draft ids are in increasing target order: the same map, rows permuted
    if cfg.get("original_lm_head", False):
        key = "lm_head.weight" if "lm_head.weight" in sd else "lm_heads.0.weight"
        keys = [key] * k_heads
        want.add(key)
    else:
        keys = [f"lm_heads.{k}.weight" for k in range(k_heads)]
        want |= set(keys)
    if extra := sorted(k for k in set(sd) - want if known.fullmatch(k)):
        raise SpecdecError(f"Medusa heads {path}: tensors in {fname} do not match config.json ({k_heads} heads of "
                           f"{n_layers} layers, original_lm_head {bool(cfg.get('original_lm_head', False))}): "
                           f"unexpected {extra[:4]}")
    scale = cfg.get("logit_scale", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise SpecdecError(f"Medusa heads {path}: config.json logit_scale must be a finite number, got {scale!r}")
    rows, seen = [], {}
    for key in keys:
        if key not in seen:
            full = ids is not None and key in sd and sd[key].shape[0] == v  # vLLM also takes [V, H] rows
            r = _take(path, fname, sd, key, (v if full else vd, h))
            if full:
                r = r[tm]  # sliced by the token map, as vLLM does
            if order is not None:
                r = r[order]
            seen[key] = r if scale == 1 else r * scale  # vLLM multiplies the logits by logit_scale
        rows.append(seen[key])
    return _assemble(path, "vllm", cfg, h, v, blocks, rows, ids, target_lm_head)


# ---- export ----

def _lm_rows(heads: MedusaHeads, target_lm_head: torch.Tensor | None, to: str) -> list[torch.Tensor] | torch.Tensor:
    """Each head's LM rows over its draft vocabulary ([V', H]); for heads sharing the target's LM head, one
    tensor: the target's rows."""
    if heads.lm_heads is not None:
        return [lm.weight.detach().cpu() for lm in heads.lm_heads]
    if target_lm_head is None:
        raise SpecdecError(f"these Medusa heads share the target's LM head, which {to} has no way to reference: "
                           "give the target (--model) so its rows are written into the export")
    if tuple(target_lm_head.shape) != (heads.vocab_size, heads.hidden_size):
        raise SpecdecError(f"the target's LM head is {tuple(target_lm_head.shape)}, the Medusa heads expect "
                           f"{(heads.vocab_size, heads.hidden_size)}: a different model")
    t = target_lm_head.detach().cpu()
    return t if heads.d2t is None else t[heads.d2t.cpu()]


def _blocks(heads: MedusaHeads):
    for k, blk in enumerate(heads.blocks):
        for i, lin in enumerate(blk.layers):
            yield k, i, lin.weight.detach().cpu(), lin.bias.detach().cpu()


def _save(sd: dict[str, torch.Tensor], tmp: Path, name: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    sd = {k: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous() for k, t in sd.items()}
    save_file(sd, str(tmp / name), metadata={"format": "pt"})
    return sd


def _dtype_name(heads: MedusaHeads, dtype: torch.dtype | None) -> str:
    return str(dtype or heads.blocks[0].layers[0].weight.dtype).removeprefix("torch.")


def export_vllm(heads: MedusaHeads, path: str | os.PathLike, target_lm_head: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> None:
    """Write vLLM's layout (model.safetensors + config.json). Our residual linears have biases: medusa_fc_bias
    true. Heads sharing the target's LM head write its rows once with original_lm_head true (vLLM shares one
    lm_head); a reduced vocabulary becomes truncated_vocab_size + token_map (the draft ids' target ids)."""
    rows = _lm_rows(heads, target_lm_head, "vLLM")
    shared = isinstance(rows, torch.Tensor)
    sd = {}
    for k, i, w, b in _blocks(heads):
        sd[f"blocks.{k}.layers.{i}.weight"], sd[f"blocks.{k}.layers.{i}.bias"] = w, b
    for k, r in enumerate([rows] if shared else rows):
        sd[f"lm_heads.{k}.weight"] = r
    if heads.d2t is not None:
        sd["token_map"] = heads.d2t.detach().cpu().long()
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": heads.hidden_size,
           "vocab_size": heads.vocab_size, "num_heads": heads.num_heads, "num_hidden_layers": heads.num_layers,
           "truncated_vocab_size": heads.draft_vocab_size, "medusa_fc_bias": True, "original_lm_head": shared,
           "torch_dtype": _dtype_name(heads, dtype), "specdec": {**heads.meta, "kind": "medusa"}}
    with atomic_dir(path) as tmp:
        _save(sd, tmp, "model.safetensors", dtype)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))


def export_medusa(heads: MedusaHeads, path: str | os.PathLike, target_lm_head: torch.Tensor | None = None,
                  base_model: str | None = None, dtype: torch.dtype | None = None, pt: bool = False) -> None:
    """Write FasterDecoding's layout: medusa_lm_head.safetensors (+ medusa_lm_head.pt when pt, the only file
    its own loader reads) and config.json. Every head gets its own full-vocabulary LM head (the target's rows
    for heads sharing it); a reduced vocabulary has no equivalent there and is refused."""
    if heads.d2t is not None:
        raise SpecdecError(f"FasterDecoding's Medusa layout has no reduced vocabulary, and these heads draft from "
                           f"{heads.draft_vocab_size} of {heads.vocab_size} tokens: export them as specdec or vllm "
                           "(vLLM's token_map) instead")
    rows = _lm_rows(heads, target_lm_head, "FasterDecoding's layout")
    rows = [rows] * heads.num_heads if isinstance(rows, torch.Tensor) else rows
    sd = {}
    for k, i, w, b in _blocks(heads):
        sd[f"{k}.{i}.linear.weight"], sd[f"{k}.{i}.linear.bias"] = w, b
    for k, r in enumerate(rows):
        sd[f"{k}.{heads.num_layers}.weight"] = r.clone()  # safetensors refuses shared storage
    base = base_model or heads.meta.get("target")
    cfg = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
           **({"base_model_name_or_path": str(base)} if base else {}),
           "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size, "torch_dtype": _dtype_name(heads, dtype),
           "specdec": {**heads.meta, "kind": "medusa"}}
    with atomic_dir(path) as tmp:
        sd = _save(sd, tmp, MEDUSA_FILES[0], dtype)
        if pt:
            torch.save(sd, tmp / MEDUSA_FILES[1])
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
