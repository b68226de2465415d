"""EAGLE heads on disk: an HF-style dir, written atomically and checked against the target on load.

config.json is a LlamaConfig with num_hidden_layers L (1 for EAGLE; + our "specdec" block and EAGLE-3's
"draft_vocab_size"); model.safetensors (past 16 MiB HF's shards and index; or an official checkpoint's
pytorch_model.bin) holds fc.weight, layers.i.self_attn.*, layers.i.mlp.*, layers.i.post_attention_layernorm.weight
(layers.i.input_layernorm.weight for i > 0) and, for a reduced vocabulary, lm_head.weight + d2t
(EAGLE-3 convention: offsets, target_id = draft_id + d2t[draft_id]) + t2d (bool over the target vocab).

FSPAD's variants (heads.fspad) add top-level fields: "connector" ("fc" | "sampler": then
sampler.{gate,up,down}_proj.weight and "sampler_intermediate_size" I instead of fc.weight) and "pad"
(true: the last layer's mlp.down_proj.weight is [2H, intermediate]). A file without them is EAGLE's
(fc, no PAD), which every head written before FSPAD is.

An EAGLE-3 head (heads.model.Eagle3Head; "specdec": {"kind": "eagle3"}, or an official/SpecForge/vLLM export:
architectures LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM, or midlayer.* tensors) has fc.weight [H, kH],
layers.0.* (or midlayer.*) with q/k/v_proj [.., 2H], input_layernorm, hidden_norm, and norm.weight; its target layers
are eagle_config.eagle_aux_hidden_state_layer_ids (default: EAGLE-3's 2, L/2, L-3 of an L-layer target).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import LlamaConfig

from specdec.errors import SpecdecError
from specdec.files import atomic_dir
from specdec.heads import check_sizes
from specdec.heads.model import Eagle3Head, EagleHead

_LAYER_PARAMS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "post_attention_layernorm.weight")
# official EAGLE checkpoints sometimes carry a copy of the target's embeddings: we use the target's own
_IGNORED = {"embed_tokens.weight", "model.embed_tokens.weight"}
_SAMPLER = ("sampler.gate_proj.weight", "sampler.up_proj.weight", "sampler.down_proj.weight")
SHARD_BYTES = 16 * 2**20
INDEX = "model.safetensors.index.json"
_FSPAD_FIELDS = ("connector", "pad", "sampler_intermediate_size")
_EAGLE3_FIELDS = ("eagle_config", "target_hidden_size", "eagle_aux_hidden_state_layer_ids")
_EAGLE3_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")


def _check_target(config, kind: str, path, hidden_size: int | None, vocab_size: int | None) -> tuple[int, int]:
    """(hidden size, vocabulary) of the head, refused in one line if the target's differ."""
    h, v = config.hidden_size, config.vocab_size
    check_sizes(f"{kind} head {path}", h, v, hidden_size, vocab_size)
    return h, v


def _layer_keys(n_layers: int) -> set[str]:
    keys = {f"layers.{i}.{p}" for i in range(n_layers) for p in _LAYER_PARAMS}
    return keys | {f"layers.{i}.input_layernorm.weight" for i in range(1, n_layers)}


def save_head(head: EagleHead, path: str | os.PathLike, extra: dict | None = None, dtype: torch.dtype | None = None,
              lm_head: bool = True) -> None:
    """Atomic: written to a temporary dir, then renamed over `path`. extra: more of the "specdec" block;
    dtype: e.g. fp16 to ship small; lm_head=False leaves out a reduced head's rows (valid when they are
    the target's own rows, e.g. trained with the LM head frozen): the loader takes them from the target
    through d2t."""
    from huggingface_hub import save_torch_state_dict

    sd = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items() if k != "d2t"}
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    if not lm_head:
        sd.pop("lm_head.weight", None)
    if head.d2t is not None:
        d2t = head.d2t.cpu()
        sd["d2t"] = d2t - torch.arange(d2t.numel())
        sd["t2d"] = head.t2d().cpu()
    cfg = head.config.to_dict()
    cfg.pop("_attn_implementation_autoset", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["draft_vocab_size"] = head.draft_vocab_size or head.vocab_size
    if head.kind == "eagle3":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(head.aux_layers)}
    else:
        cfg["connector"], cfg["pad"] = head.connector, head.pad
    if head.sampler_size is not None:
        cfg["sampler_intermediate_size"] = head.sampler_size
    cfg["specdec"] = {"kind": head.kind, "reduced_vocab": head.d2t is not None,
                      "lm_head": "own" if "lm_head.weight" in sd else "target", **(extra or {})}
    with atomic_dir(path) as tmp:
        # files of <= 16 MiB (model.safetensors, or HF's shards and index past that): what git and a
        # package carry without large-file storage
        save_torch_state_dict(sd, tmp, max_shard_size=SHARD_BYTES, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))


def load_head(path: str | os.PathLike, hidden_size: int | None = None, vocab_size: int | None = None,
              device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              target_lm_head: torch.Tensor | None = None, target_layers: int | None = None) -> EagleHead:
    """Load and check against the target (hidden size, vocabulary). Every failure is a SpecdecError.
    target_lm_head: needed for a reduced head saved without its rows (lm_head=False); target_layers: the
    target's layer count, for an EAGLE-3 export that does not name its layers (EAGLE-3's default)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise SpecdecError(f"no EAGLE head at {path}: config.json is missing")
    try:
        raw = json.loads(cfg_file.read_text())
        skip = ("specdec", "transformers_version", *_FSPAD_FIELDS, *_EAGLE3_FIELDS)
        config = LlamaConfig(**{k: v for k, v in raw.items() if k not in skip})
    except Exception as e:
        raise SpecdecError(f"EAGLE head {path}: config.json is not a valid LlamaConfig ({e})") from None
    sd = _read_tensors(path)
    if _is_eagle3(raw, sd):
        head = _eagle3_head(path, raw, config, sd, hidden_size, vocab_size, target_lm_head, target_layers)
        return _finish(path, head, raw, device, dtype)
    n_layers = config.num_hidden_layers
    layer_keys = _layer_keys(n_layers) if isinstance(n_layers, int) and n_layers >= 1 else set()
    connector, pad, sampler_size = _fspad_fields(path, raw, sd)
    conn_keys = set(_SAMPLER) if connector == "sampler" else {"fc.weight"}
    extra = set(sd) - layer_keys - _IGNORED - conn_keys - {"fc.bias", "lm_head.weight", "d2t", "t2d"}
    missing = (layer_keys | conn_keys) - set(sd)
    if missing or extra or not layer_keys:
        why = [f"missing {sorted(missing)[:6]}" if missing else "",
               f"unexpected {sorted(extra)[:6]}" if extra else "",
               f"num_hidden_layers={n_layers}" if not layer_keys else ""]
        raise SpecdecError(f"{path} is not an EAGLE-1/2 head: " + "; ".join(w for w in why if w))
    h, v = _check_target(config, "EAGLE", path, hidden_size, vocab_size)
    i = config.intermediate_size
    if connector == "fc":
        want = {"fc.weight": (h, 2 * h)}
    else:
        want = dict(zip(_SAMPLER, ((sampler_size, h), (sampler_size, h), (h, sampler_size))))
    want[f"layers.{n_layers - 1}.mlp.down_proj.weight"] = (2 * h if pad else h, i)
    for k, shape in want.items():
        if tuple(sd[k].shape) != shape:
            why = f"pad={str(pad).lower()}, " if k.startswith("layers.") else ""
            raise SpecdecError(f"EAGLE head {path}: {k} is {list(sd[k].shape)}, expected {list(shape)} for "
                               f"{why}hidden size {h}, intermediate size {i}")
    state = {k: t for k, t in sd.items() if k in layer_keys or k in conn_keys or k == "fc.bias" and connector == "fc"}
    vd = None
    if "d2t" in sd:
        vd = sd["d2t"].shape[0]
        state["d2t"], state["lm_head.weight"] = _reduced_vocab(path, sd, v, h, target_lm_head)
    elif "lm_head.weight" in sd and tuple(sd["lm_head.weight"].shape) != (v, h):
        raise SpecdecError(f"EAGLE head {path}: lm_head.weight without d2t must be [{v}, {h}]")
    # a full-size lm_head.weight (some exports carry one) is dropped: the target's own head is used
    head = EagleHead(config, vd, fc_bias="fc.bias" in sd, connector=connector, pad=pad, sampler_size=sampler_size)
    _load_state(path, head, state)
    return _finish(path, head, raw, device, dtype)


def _load_state(path: Path, head: EagleHead, state: dict[str, torch.Tensor]) -> None:
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        why = str(e).splitlines()[-1]
        raise SpecdecError(f"EAGLE head {path}: weights do not fit its config ({why})") from None


def _tensor_names(path: Path) -> dict:
    """The names of a head dir's safetensors tensors, without reading them."""
    st, index = path / "model.safetensors", path / INDEX
    if st.is_file():
        from safetensors import safe_open

        with safe_open(str(st), "pt") as f:
            return dict.fromkeys(f.keys())
    return json.loads(index.read_text())["weight_map"] if index.is_file() else {}


def is_eagle3_dir(path: str | os.PathLike) -> bool:
    """Whether the head dir holds an EAGLE-3 head (its config says so, or its tensors are named like one),
    without loading its weights; a dir that is no readable head answers False (load_head says why)."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
        return isinstance(raw, dict) and _is_eagle3(raw, _tensor_names(path))
    except Exception:  # missing or damaged files (safetensors raises its own types): load_head says what
        return False


def takes_target_rows(path: str | os.PathLike) -> bool:
    """Whether a reduced-vocabulary head dir left its LM-head rows to the target (trained with them frozen),
    without loading its weights."""
    try:
        keys = _tensor_names(Path(path))
    except Exception:  # load_head says what is wrong
        return False
    return "d2t" in keys and "lm_head.weight" not in keys


def _finish(path: Path, head: EagleHead, raw: dict, device, dtype) -> EagleHead:
    for k, t in head.state_dict().items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise SpecdecError(f"EAGLE head {path}: tensor {k} holds NaN/inf: the file is damaged")
    head.meta = raw.get("specdec", {})
    return head.to(device=device, dtype=dtype).eval()


def _is_eagle3(raw: dict, sd: dict[str, torch.Tensor]) -> bool:
    kind = raw.get("specdec", {}).get("kind") if isinstance(raw.get("specdec"), dict) else None
    archs = raw.get("architectures") or []
    return (kind == "eagle3" or any(a in archs for a in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"))
            or any(k.startswith("midlayer.") for k in sd))


def _eagle3_head(path: Path, raw: dict, config: LlamaConfig, sd: dict[str, torch.Tensor], hidden_size: int | None,
                 vocab_size: int | None, target_lm_head: torch.Tensor | None,
                 target_layers: int | None) -> Eagle3Head:
    """An EAGLE-3 head (ours, or an official export: midlayer.* is our layers.0.*)."""
    sd = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): t for k, t in sd.items()}
    h, v = _check_target(config, "EAGLE-3", path, hidden_size, vocab_size)
    # eagle_config's (EAGLE-3, SGLang) or top-level (vLLM, speculators)
    layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids",
                                                  raw.get("eagle_aux_hidden_state_layer_ids"))
    if layers is None:
        if target_layers is None:
            raise SpecdecError(f"EAGLE-3 head {path} does not say which target layers it reads "
                               "(eagle_config.eagle_aux_hidden_state_layer_ids)")
        layers = Eagle3Head.default_layers(target_layers)
    if not (isinstance(layers, list) and layers and all(isinstance(i, int) and i >= 0 for i in layers)):
        raise SpecdecError(f"EAGLE-3 head {path}: eagle_aux_hidden_state_layer_ids is {layers!r}, expected "
                           "a list of layer indices")
    want = {"fc.weight", "norm.weight", *(f"layers.0.{p}" for p in _EAGLE3_LAYER)}
    missing = want - set(sd)
    extra = set(sd) - want - _IGNORED - {"lm_head.weight", "d2t", "t2d"}
    if missing or extra or config.num_hidden_layers != 1:
        why = [f"missing {sorted(missing)[:6]}" if missing else "", f"unexpected {sorted(extra)[:6]}" if extra else "",
               f"num_hidden_layers={config.num_hidden_layers}" if config.num_hidden_layers != 1 else ""]
        raise SpecdecError(f"{path} is not an EAGLE-3 head: " + "; ".join(w for w in why if w))
    if tuple(sd["fc.weight"].shape) != (h, len(layers) * h):
        raise SpecdecError(f"EAGLE-3 head {path}: fc.weight is {list(sd['fc.weight'].shape)}, expected "
                           f"{[h, len(layers) * h]} for {len(layers)} target layers of hidden size {h}")
    state = {k: sd[k] for k in want}
    vd = None
    if "d2t" in sd:
        vd = sd["d2t"].shape[0]
        state["d2t"], state["lm_head.weight"] = _reduced_vocab(path, sd, v, h, target_lm_head)
    head = Eagle3Head(config, layers, vd)
    _load_state(path, head, state)
    return head


def _fspad_fields(path: Path, raw: dict, sd: dict[str, torch.Tensor]) -> tuple[str, bool, int | None]:
    """(connector, pad, sampler intermediate size) from config.json, checked against the tensors."""
    connector, pad = raw.get("connector", "fc"), raw.get("pad", False)
    if connector not in ("fc", "sampler"):
        raise SpecdecError(f"EAGLE head {path}: config.json has connector={connector!r}, expected fc or sampler")
    if not isinstance(pad, bool):
        raise SpecdecError(f"EAGLE head {path}: config.json has pad={pad!r}, expected true or false")
    has_sampler = any(k.startswith("sampler.") for k in sd)
    if connector == "fc" and has_sampler:
        raise SpecdecError(f"EAGLE head {path} holds Feature Sampler tensors (sampler.*) but config.json says "
                           "connector=fc (or has no connector field)")
    if connector == "sampler" and "fc.weight" in sd:
        raise SpecdecError(f"EAGLE head {path} holds fc.weight but config.json says connector=sampler")
    size = raw.get("sampler_intermediate_size") if connector == "sampler" else None
    if connector == "sampler" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise SpecdecError(f"EAGLE head {path}: config.json says connector=sampler without a valid "
                           f"sampler_intermediate_size (got {size!r})")
    return connector, pad, size


def _reduced_vocab(path: Path, sd: dict[str, torch.Tensor], v: int, h: int,
                   target_lm_head: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(absolute target ids, LM head rows) of a reduced-vocabulary head; the rows come from the target
    when the file has none."""
    vd = sd["d2t"].shape[0]
    ids = sd["d2t"].long().reshape(-1) + torch.arange(vd)
    if vd == 0 or int(ids.min()) < 0 or int(ids.max()) >= v:
        raise SpecdecError(f"EAGLE head {path}: d2t maps outside the target vocabulary of {v}")
    rows = sd.get("lm_head.weight")
    if rows is None:
        if target_lm_head is None:
            raise SpecdecError(f"EAGLE head {path} takes its LM head rows from the target: pass the target")
        if tuple(target_lm_head.shape) != (v, h):
            raise SpecdecError(f"EAGLE head {path}: the target's LM head is {tuple(target_lm_head.shape)}, "
                               f"expected {(v, h)}")
        rows = target_lm_head.detach().cpu()[ids]
    if tuple(rows.shape) != (vd, h):
        raise SpecdecError(f"EAGLE head {path}: lm_head.weight is {tuple(rows.shape)}, "
                           f"expected {(vd, h)} for {vd} draft tokens")
    return ids, rows


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    import pickle

    try:
        if st.is_file() or (path / INDEX).is_file():
            from safetensors.torch import load_file

            files = [st.name] if st.is_file() else sorted(set(json.loads((path / INDEX).read_text())["weight_map"]
                                                               .values()))
            return {k: t for f in files for k, t in load_file(str(path / f)).items()}
        if pt.is_file():
            # weights_only: a pickle naming any other object is refused before anything in it runs
            sd = torch.load(str(pt), map_location="cpu", weights_only=True)
        else:
            raise SpecdecError(f"no EAGLE head weights in {path} (model.safetensors or pytorch_model.bin)")
    except pickle.UnpicklingError as e:
        raise SpecdecError(f"EAGLE head {path}: pytorch_model.bin holds objects other than tensors "
                           f"({str(e).splitlines()[0][:160]}); refused without running it") from None
    except SpecdecError:
        raise
    except Exception as e:
        raise SpecdecError(f"EAGLE head {path}: cannot read its weights, the file looks damaged "
                           f"({type(e).__name__}: {e})") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in sd.items()):
        bad = next((k for k, t in sd.items() if not isinstance(t, torch.Tensor)), None) if isinstance(sd, dict) \
            else None
        raise SpecdecError(f"EAGLE head {path}: pytorch_model.bin does not hold a state dict (name -> tensor)"
                           + (f": {bad!r} is a {type(sd[bad]).__name__}" if bad is not None else ""))
    return sd

