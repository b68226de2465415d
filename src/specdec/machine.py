"""What this machine is and what things cost on it: one place for the CPU description, the load other
processes put on it during a measurement, and timing a target forward. Used by `tune`, `bench` and the
scripts. Costs differ from one machine of the same kind to the next, so they are measured where the
code runs, never shipped as constants."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from specdec.target.base import chain_mask
from specdec.target.gguf import GGUFModel
from specdec.target.packed import onednn_available, weight_bytes


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def _cpu_busy_s() -> float | None:
    """Seconds of CPU time every process on the machine has used (user+nice+system+irq), from /proc/stat."""
    try:
        f = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return sum(int(x) for x in f[1:4] + f[6:9]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def free_cpus(window_s: float = 0.1) -> int:
    """The usable CPUs other processes leave free, measured over a short window (at least 1): a CPU counts
    as taken when others kept it at least 60% busy. Why: a 2-thread decode beside one busy process ran
    at 0.9 tok/s, against 46-51 tok/s with one thread (OpenMP's barriers wait for the preempted thread)."""
    meter = ContentionMeter()
    time.sleep(window_s)
    frac = meter.result().get("other_cpu_frac")
    n = usable_cpus()
    if frac is None:
        return n
    return max(1, n - int(frac * n + 0.4))


def _pid_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a live process has used, from /proc/<pid>/stat; 0 if unreadable."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class ContentionMeter:
    """Share of the usable CPUs that *other* processes used during a timed run: a benchmark that shared
    the cores with another job measures that job as much as the method. `helpers`: pids of the run's own
    subprocesses (a peer's llama-server), whose work is the run's, not contention."""

    def __init__(self, helpers: Sequence[int] = ()) -> None:
        self.helpers = list(helpers)
        self.help0 = sum(_pid_cpu_s(p) for p in self.helpers)
        self.busy0, self.own0, self.t0 = _cpu_busy_s(), time.process_time(), time.perf_counter()

    def result(self) -> dict:
        busy1, own1, wall = _cpu_busy_s(), time.process_time(), time.perf_counter() - self.t0
        own1 += sum(_pid_cpu_s(p) for p in self.helpers) - self.help0
        ncpu = usable_cpus()
        if self.busy0 is None or busy1 is None or wall <= 0:
            return {"other_cpu_frac": None}
        others = max(0.0, (busy1 - self.busy0) - (own1 - self.own0))
        return {"other_cpu_frac": others / (wall * ncpu), "own_cpu_frac": (own1 - self.own0) / (wall * ncpu),
                "loadavg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _interleaved_times(runner, ctx: int, calls: dict, reps: int, warmup: int) -> dict:
    """Seconds of each call's forward (key -> (tokens, mask)) after `ctx` random cached tokens, one list per
    key; calls are interleaved per repetition so drift on a busy machine hits all alike."""
    runner.reset()
    runner.forward(torch.randint(0, min(runner.vocab_size, 1000), (ctx,)), logits_rows=slice(-1, None))
    runner.commit(range(ctx))
    ts: dict = {k: [] for k in calls}
    for rep in range(reps + warmup):
        for k, (xs, mask) in calls.items():
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
