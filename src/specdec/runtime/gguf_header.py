"""A GGUF file's header: its scalar metadata and its tensor table, read without parsing the metadata arrays."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

_STRING, _ARRAY = 8, 9
# the struct format of each fixed-size metadata value (gguf.GGUFValueType ids)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_header(path: Path) -> tuple[dict, list]:
    """The file's scalar metadata (arrays left out) and its tensors as gguf.GGUFReader lists them
    (ReaderTensor: name, type, dims innermost first, offset, bytes and a read-only view of the data), from
    the header alone. Why not GGUFReader itself: it parses every metadata value one numpy view at a time,
    and a tokenizer's vocabulary and merges are 100-300k strings: 6.9 s of SmolLM2's load and 20.5 s of
    Qwen2.5-0.5B's on a 2-GHz Zen, against 0.12 and 0.33 s here."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.gguf_reader import ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    buf = memoryview(data)
    at = 0

    def take(fmt: str):
        nonlocal at
        v = struct.unpack_from("<" + fmt, buf, at)
        at += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def text() -> str:
        nonlocal at
        n = take("Q")
        at += n
        return bytes(buf[at - n:at]).decode()

    def skip(kind: int) -> None:
        nonlocal at
        if kind == _STRING:
            n = take("Q")
            at += n
        elif kind == _ARRAY:
            item, n = take("IQ")
            if item in _SCALARS:
                at += n * struct.calcsize("<" + _SCALARS[item])
            else:
                for _ in range(n):
                    skip(item)
        else:
            at += struct.calcsize("<" + _SCALARS[kind])

    magic, version, n_tensors, n_kv = take("4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
    meta: dict = {}
    for _ in range(n_kv):
        key, kind = text(), take("I")
        if kind == _STRING:
            meta[key] = text()
        elif kind in _SCALARS:
            meta[key] = take(_SCALARS[kind])
        else:
            skip(kind)
    alignment = meta.get("general.alignment", 32)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = text(), take("I")
        dims = take(f"{n_dims}Q")
        dims = (dims,) if n_dims == 1 else tuple(dims)
        infos.append((name, dims, GGMLQuantizationType(take("I")), take("Q")))
    start = -(-at // alignment) * alignment
    floats = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
              "I32": np.int32, "I64": np.int64}
    out = []
    for name, dims, kind, offset in infos:
        n = int(np.prod(dims))
        block, size = GGML_QUANT_SIZES[kind]
        n_bytes, shape = n * size // block, tuple(reversed(dims))
        raw = data[start + offset:start + offset + n_bytes]
        view = (raw.view(floats[kind.name]).reshape(shape) if kind.name in floats
                else raw.reshape(quant_shape_to_byte_shape(shape, kind)))
        out.append(ReaderTensor(name, kind, np.array(dims, dtype=np.uint64), n, n_bytes, start + offset, view, None))
    return meta, out


# architectures whose config transformers' GGUF loader builds by key renames alone (no per-file fixes)
PLAIN_CONFIG_ARCHS = ("llama", "qwen2", "gemma3")


def hf_config(path: Path) -> dict | None:
    """The config dict transformers' GGUF loader (load_gguf_checkpoint) builds for this file, from its own
    header-only reader and its own key table; None for an architecture that needs more. Why: that loader
    walks the file with gguf.GGUFReader, 7.7 s for SmolLM2 on a 2-GHz Zen (0.04 s here), and a first run
    paid it twice (the config, then AutoTokenizer's)."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:  # a transformers without the header-only reader: its loader builds the config
        return None

    meta, names = read_gguf_metadata(str(path))
    arch = meta["general.architecture"]
    if arch not in PLAIN_CONFIG_ARCHS or meta.get("general.name") == "mistral":  # the loader renames those
        return None
    cfg = {"tie_word_embeddings": "output.weight" not in names, **GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {})}
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        name = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if name not in (None, -1):
            cfg[name] = value
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in meta:  # the reader counts a string array
        cfg["vocab_size"] = meta["tokenizer.ggml.tokens"]
    if cfg["model_type"] == "gemma3":  # the file holds the text model alone
        cfg["model_type"] = "gemma3_text"
    return cfg
