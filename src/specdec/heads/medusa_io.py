"""Medusa heads on disk: our HF-style dir, written atomically and checked against the target on load.

config.json: {"model_type": "medusa", "hidden_size", "vocab_size", "num_heads", "num_layers", "lm_head"
("target" | "own"), "draft_vocab_size", "specdec": {...}}; model.safetensors: blocks.{k}.layers.{l}.weight
[H, H] and .bias [H], lm_heads.{k}.weight [V', H] (lm_head "own" only) and, for a reduced vocabulary, d2t
(EAGLE-3's convention: offsets, target id = draft id + d2t[draft id]) + t2d (bool over the target vocab).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.files import atomic_dir
from specdec.heads import check_sizes
from specdec.heads.medusa import LM_HEADS, MedusaHeads

CONFIG_KEYS = ("hidden_size", "vocab_size", "num_heads", "num_layers", "lm_head")
# specdec.kind: "medusa" (Medusa-1, for the target they were trained on) or "medusa-2" (trained jointly with
# the backbone: for the new target named by specdec.lossless_relative_to / specdec.runtime) or "hydra" (HydraHeads)
KINDS = ("medusa", "medusa-2", "hydra")


def save_medusa(heads: MedusaHeads, path: str | os.PathLike, extra: dict | None = None,
                dtype: torch.dtype | None = None) -> None:
    from safetensors.torch import save_file

    sd = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items() if k != "d2t"}
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    if heads.d2t is not None:
        d2t = heads.d2t.cpu()
        sd["d2t"] = d2t - torch.arange(d2t.numel())
        t2d = torch.zeros(heads.vocab_size, dtype=torch.bool)
        t2d[d2t] = True
        sd["t2d"] = t2d
    meta = {**heads.meta, **(extra or {})}
    cfg = {"architectures": [type(heads).__name__], "model_type": heads.model_type, "hidden_size": heads.hidden_size,
           "vocab_size": heads.vocab_size, "num_heads": heads.num_heads, "num_layers": heads.num_layers,
           "lm_head": heads.lm_head_kind, "draft_vocab_size": heads.draft_vocab_size,
           **heads.config_extra(),
           "specdec": meta | {"kind": meta["kind"] if meta.get("kind") in KINDS else heads.model_type}}
    with atomic_dir(path) as tmp:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))


def read_config(path: Path, cls: type[MedusaHeads] = MedusaHeads) -> dict:
    f = path / "config.json"
    what = cls.label
    if not f.is_file():
        raise SpecdecError(f"no {what} heads at {path}: config.json is missing")
    try:
        raw = json.loads(f.read_text())
    except ValueError as e:
        raise SpecdecError(f"{what} heads {path}: config.json is not valid JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("model_type") != cls.model_type:
        raise SpecdecError(f"{path} does not hold {what} heads (config.json model_type is "
                           f"{raw.get('model_type') if isinstance(raw, dict) else None!r}, expected "
                           f"{cls.model_type!r})")
    for k in CONFIG_KEYS[:4]:
        v = raw.get(k)
        if type(v) is not int or v < 1:
            raise SpecdecError(f"{what} heads {path}: config.json {k} must be an integer >= 1, got {v!r}")
    if raw.get("lm_head") not in LM_HEADS:
        raise SpecdecError(f"{what} heads {path}: config.json lm_head must be one of {', '.join(LM_HEADS)}, "
                           f"got {raw.get('lm_head')!r}")
    return raw


def load_medusa(path: str | os.PathLike, hidden_size: int | None = None, vocab_size: int | None = None,
                target_lm_head: torch.Tensor | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, cls: type[MedusaHeads] = MedusaHeads) -> MedusaHeads:
    """Load and check against the target (hidden size, vocabulary). Every failure is a SpecdecError.
    Only our layout; medusa_formats.import_medusa also reads vLLM's and FasterDecoding's. `cls`: the
    heads' class (HydraHeads for Hydra's, which share the layout)."""
    path = Path(path)
    raw = read_config(path, cls)
    h, v, k_heads, n_layers = (raw[k] for k in CONFIG_KEYS[:4])
    check_target(path, h, v, hidden_size, vocab_size)
    sd = read_tensors(path)
    ids = None
    if "d2t" in sd:
        vd = sd["d2t"].numel()
        ids = sd["d2t"].long().reshape(-1) + torch.arange(vd)
    heads = build_heads(path, h, v, k_heads, n_layers, raw["lm_head"], {k: t for k, t in sd.items()
                                                                         if k not in ("d2t", "t2d")}, ids, cls,
                        cls.config_kwargs(raw, path))
    if raw["lm_head"] == "target" and target_lm_head is not None and tuple(target_lm_head.shape) != (v, h):
        raise SpecdecError(f"Medusa heads {path} share the target's LM head, which is {tuple(target_lm_head.shape)}, "
                           f"expected {(v, h)}")
    heads.meta = raw.get("specdec", {}) or {}
    return heads.to(device=device, dtype=dtype).eval()


def check_target(path: Path, h: int, v: int, hidden_size: int | None, vocab_size: int | None) -> None:
    check_sizes(f"Medusa heads {path}", h, v, hidden_size, vocab_size)


def build_heads(path: Path, h: int, v: int, k_heads: int, n_layers: int, lm_head: str,
                state: dict[str, torch.Tensor], ids: torch.Tensor | None,
                cls: type[MedusaHeads] = MedusaHeads, kwargs: dict | None = None) -> MedusaHeads:
    """MedusaHeads from tensors in our names (blocks.*, lm_heads.* for lm_head "own", a Hydra prefix
    layer's prefix.*) and the draft vocabulary `ids` (increasing target ids, None = all), checked: names,
    shapes, finite values. kwargs: the class's own constructor arguments (config_kwargs)."""
    heads = cls(h, v, k_heads, n_layers, lm_head, **(kwargs or {}))
    if ids is not None:
        vd = ids.numel()
        if vd == 0 or int(ids.min()) < 0 or int(ids.max()) >= v or bool((ids[1:] <= ids[:-1]).any()):
            raise SpecdecError(f"Medusa heads {path}: d2t must map to increasing ids inside the target vocabulary "
                               f"of {v}")
    vd = v if ids is None else ids.numel()
    if lm_head == "own":
        heads.init_lm_heads(torch.zeros(v, h), ids)  # shapes only: the file's rows are loaded below
    elif ids is not None:
        heads.d2t = ids
    want = {f"blocks.{k}.layers.{i}.{p}" for k in range(k_heads) for i in range(n_layers) for p in ("weight", "bias")}
    if lm_head == "own":
        want |= {f"lm_heads.{k}.weight" for k in range(k_heads)}
    want |= {k for k in heads.state_dict() if k.startswith("prefix.")}
    have = set(state)
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        why = "; ".join(x for x in (f"missing {missing[:4]}" if missing else "",
                                    f"unexpected {extra[:4]}" if extra else "") if x)
        raise SpecdecError(f"Medusa heads {path}: tensors do not match config.json "
                           f"(num_heads {k_heads}, num_layers {n_layers}, lm_head {lm_head}): {why}")
    state = dict(state)
    if ids is not None:
        state["d2t"] = ids
    try:
        heads.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise SpecdecError(f"Medusa heads {path}: weights do not fit config.json "
                           f"(hidden size {h}, vocab {vd}): {str(e).splitlines()[-1].strip()}") from None
    for name, t in heads.state_dict().items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise SpecdecError(f"Medusa heads {path}: tensor {name} holds NaN/inf: the file is damaged")
    return heads


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "model.safetensors"
    if not st.is_file():
        raise SpecdecError(f"no Medusa weights in {path} (model.safetensors)")
    try:
        from safetensors.torch import load_file

        return load_file(str(st))
    except Exception as e:
        raise SpecdecError(f"Medusa heads {path}: cannot read model.safetensors, the file looks damaged "
                           f"({type(e).__name__}: {e})") from None
