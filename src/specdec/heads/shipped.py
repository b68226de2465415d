"""Heads shipped inside the package (src/specdec/heads/<name>/), found for a target by its fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED_DIR = Path(__file__).parent  # where the shipped heads' dirs (smollm2-135m-instruct-eagle/, ...) live


def target_fingerprint(model) -> dict:
    """Enough to tell which target a head was trained on, whatever path the target was loaded from."""
    cfg = model.config
    emb = model.get_input_embeddings().weight
    return {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers, "vocab_size": int(emb.shape[0]),
            "embed_abs_mean": round(float(emb.detach().double().abs().mean()), 8)}


def fingerprint_matches(a: dict, b: dict) -> bool:
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    if any(a.get(k) != b.get(k) for k in keys):
        return False
    x, y = a.get("embed_abs_mean"), b.get("embed_abs_mean")
    return x is not None and y is not None and abs(x - y) <= 1e-2 * max(abs(x), abs(y))


def head_kind(config: dict) -> str | None:
    """A head's kind from its config.json: its "specdec" kind, except that an EAGLE head with both of
    FSPAD's options is "fspad" (it runs as `fspad`, and `eagle2`/`auto` keep the plain EAGLE head)."""
    kind = config.get("specdec", {}).get("kind")
    if kind == "eagle" and config.get("connector") == "sampler" and config.get("pad"):
        return "fspad"
    return kind


def _shipped(kind: str) -> list[tuple[Path, dict]]:
    """(dir, the "specdec" block of its config.json) of every shipped head of this kind; no weights read."""
    out = []
    for cfg in sorted(SHIPPED_DIR.glob("*/config.json")):
        try:
            config = json.loads(cfg.read_text())
        except (OSError, ValueError):
            continue
        if head_kind(config) == kind:
            out.append((cfg.parent, config.get("specdec", {})))
    return out


def shipped_targets(kind: str) -> list[str]:
    """The names of the shipped head dirs of this kind."""
    return [d.name for d, _ in _shipped(kind)]


def find_shipped_head(model, kind: str = "eagle") -> Path | None:
    """The shipped head dir of this kind ("eagle", "fspad", "eagle3", "medusa" or "hydra") trained on this
    target, else None."""
    fp = None
    for head_dir, meta in _shipped(kind):
        if not _shape_matches(meta.get("target", {}), model):
            continue
        fp = fp or target_fingerprint(model)  # reads the whole embedding table: only for a candidate
        if fingerprint_matches(meta.get("target", {}), fp):
            return head_dir
    return None


def _shape_matches(target: dict, model) -> bool:
    cfg = model.config
    return (target.get("model_type"), target.get("hidden_size"), target.get("num_hidden_layers")) == (
        cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers)
