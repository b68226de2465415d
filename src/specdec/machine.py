"""What things cost on this machine: timing a target forward, the streaming bandwidth and a model's
memory floor, measurements cached per machine (`cached`), and the record a benchmark keeps of where it ran.
Costs differ from one machine of the same kind to the next, so they are measured where the code runs,
never shipped as constants."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from specdec.files import atomic_write_text, cache_dir
from specdec.runtime.base import Runner, chain_mask
from specdec.runtime.cpus import ContentionMeter, cpu_name, usable_cpus
from specdec.runtime.gguf import GGUFModel
from specdec.runtime.packed import onednn_available, weight_bytes


def peak_rss_mb(pid: int | str = "self") -> float | None:
    """A process's peak resident set (VmHWM, MB = 1e6 B; mmap'd GGUF pages it touched count), None if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Start this process's VmHWM afresh from its current RSS (Linux's clear_refs 5); False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def machine_info() -> dict:
    """Everything a benchmark record needs to say where it ran."""
    import transformers  # heavy, and only a benchmark record needs its version

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).parent).stdout.strip()
    except Exception:
        commit = ""
    return {
        "cpu": cpu_name(), "logical_cpus": os.cpu_count(), "usable_cpus": usable_cpus(),
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "specdec": _version(), "git_commit": commit,
        "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
        "onednn_packed_linears": onednn_available(),
    }


def _version() -> str:
    try:
        return importlib.metadata.version("specdec")
    except importlib.metadata.PackageNotFoundError:
        return ""


def machine_summary() -> dict:
    """The short form a tuning record carries."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__}



# a forward this long is timed twice at most: a disturbance is a small part of it, and on a slow CPU the
# widest forwards of a big model (1.1 s for 23 rows of Qwen-1.5B on a 2-GHz Zen 1) were most of a probe
LONG_S = 0.25


def _interleaved_times(runner, ctx: int, calls: dict, reps: int, warmup: int) -> dict:
    """Seconds of each call's forward (key -> (tokens, mask)) after `ctx` cached tokens, one list per
    key (of at most 2 if over LONG_S); calls are interleaved per repetition so drift on a busy machine hits
    all alike."""
    runner.reset()
    runner.pretend_cached(ctx)
    ts: dict = {k: [] for k in calls}
    for rep in range(reps + warmup):
        for k, (xs, mask) in calls.items():
            if len(ts[k]) >= 2 and min(ts[k]) > LONG_S:
                continue
            t = time.perf_counter()
            runner.forward(xs, None, mask)
            runner.rollback()
            if rep >= warmup:
                ts[k].append(time.perf_counter() - t)
    runner.reset()
    return ts


@torch.inference_mode()
def forward_costs(runner, sizes: Sequence[int], reps: int = 10, ctx: int = 200,
                  stat=statistics.median, warmup: int = 2) -> dict[int, float]:
    """Seconds (median, or `stat`) of a target forward over N new tokens (a chain mask, as a tree would use) after
    `ctx` cached tokens."""
    v = min(runner.vocab_size, 1000)
    calls = {n: (torch.randint(0, v, (n,)), chain_mask(ctx, n) if n > 1 else None) for n in sizes}
    return {n: stat(x) for n, x in _interleaved_times(runner, ctx, calls, reps, warmup).items()}


@torch.inference_mode()
def attention_slope(runner, rows: int, ctx: int, extra: int, reps: int = 3, warmup: int = 1) -> float:
    """Seconds each forward row adds per cached token it attends to: a forward of `rows` chained rows after
    ctx + extra cached tokens, timed against the same forward with the `extra` newest of them masked out
    (interleaved, the least disturbed of `reps` each): the difference is only attention."""
    full = chain_mask(ctx + extra, rows, runner.device)
    near = full.clone()
    near[:, ctx:ctx + extra] = False
    xs = torch.randint(0, min(runner.vocab_size, 1000), (rows,))
    ts = _interleaved_times(runner, ctx + extra, {"near": (xs, near), "full": (xs, full)}, reps, warmup)
    return max(0.0, (min(ts["full"]) - min(ts["near"])) / (rows * extra))


def stream_bandwidth(mb: int = 512, reps: int = 3) -> float:
    """Bytes per second this process reads from memory with the current torch threads: the best of a
    few sums over a buffer far larger than any cache (what a decode step does to the weights)."""
    x = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    x.sum()  # touch the pages once
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def weight_bytes_per_token(model, weights: str | None = None) -> int:
    """Bytes of weights one decode step must stream: every parameter once (tied tensors once), except an
    input embedding table that is not also the LM head (a step reads one row of it). weights (a
    precision name): the matrices as the lean runner stores them at that precision."""
    if isinstance(model, GGUFModel):  # its own blocks, whatever `weights` says
        return model.streamed_bytes()
    size = weight_bytes(weights) if weights and weights != "gguf" else None

    def nbytes(p):
        return p.numel() * (size if size and p.dim() == 2 else p.element_size())

    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    total = sum(nbytes(p) for p in model.parameters())
    if head is None or head.weight.data_ptr() != emb.data_ptr():
        total -= nbytes(emb) - emb.shape[1] * emb.element_size()
    return total


def memory_floor(model, bandwidth: float | None = None, weights: str | None = None) -> dict:
    """The physical limit of plain decoding here: weight bytes per token / streaming bandwidth."""
    bw = bandwidth or stream_bandwidth()
    nbytes = weight_bytes_per_token(model, weights)
    return {"bandwidth_gb_s": bw / 1e9, "weight_mb": nbytes / 1e6, "ms_per_forward": 1e3 * nbytes / bw,
            "forwards_per_s": bw / nbytes}


QUIET = 0.15  # at most this share of the CPUs used by other processes while a stored measurement ran
T = TypeVar("T")


def runner_identity(runner: Runner) -> list:
    """What a runner's timings depend on: the model, its dtype and its weights."""
    cfg = runner.config
    return [str(getattr(cfg, "_name_or_path", "")), getattr(cfg, "hidden_size", 0),
            getattr(cfg, "num_hidden_layers", 0), runner.vocab_size, str(runner.dtype), runner.weights,
            runner.requantized_to]


def machine_key(runner: Runner) -> dict:
    """What a cost measurement of this target depends on besides what it times."""
    return {"cpu": cpu_name(), "usable_cpus": usable_cpus(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "target": runner_identity(runner), "device": str(runner.device),
            "kernel": [runner.decode_kernel, runner.kernel_build]}


def cached(key: dict, measure: Callable[[], dict], parse: Callable[[dict], T], recalibrate: bool = False
           ) -> tuple[T, Path, str]:
    """(parse(measurement), cache file, origin): the cached measurement for exactly this key ("cached"),
    else a new one ("measured at load in 3.1 s"), stored unless others were busy meanwhile."""
    path = cache_dir() / "costs" / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    stored = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):  # damaged: measured again
        rec = json.loads(path.read_text())
        stored = parse(rec["costs"]) if rec["key"] == key else None
    if stored is not None and not recalibrate:
        return stored, path, "cached"
    meter, t0 = ContentionMeter(), time.perf_counter()
    data = measure()
    origin = f"measured at load in {time.perf_counter() - t0:.1f} s"
    busy = meter.result().get("other_cpu_frac")
    if stored is None or busy is None or busy <= QUIET:
        atomic_write_text(path, json.dumps({"key": key, "costs": data, "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
                                           indent=1) + "\n")
    else:
        origin += f" (not stored: other processes used {busy:.0%} of the CPUs)"
    return parse(data), path, origin
