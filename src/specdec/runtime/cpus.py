"""The CPUs this process may use, and how busy other processes keep them: the runtime picks its threads
from this, and a benchmark reports the contention it ran under."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path


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


def _cpu_busy_s() -> float | None:
    """Seconds of CPU time every process has used (user+nice+system+irq) on the CPUs this one may use, from
    /proc/stat's per-CPU lines: pinned to one CPU of two (taskset), the other's load is not contention."""
    try:
        mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        total = 0
        for line in Path("/proc/stat").read_text().splitlines():
            f = line.split()
            if f and f[0].startswith("cpu") and f[0] != "cpu" and (mine is None or int(f[0][3:]) in mine):
                total += sum(int(x) for x in f[1:4] + f[6:9])
        return total / os.sysconf("SC_CLK_TCK") if total else None
    except (OSError, ValueError, IndexError):
        return None


def free_cpus(window_s: float = 0.1) -> int:
    """The usable CPUs other processes leave free, measured over a short window (free_of)."""
    meter = ContentionMeter()
    time.sleep(window_s)
    return free_of(meter.result())


def free_of(contention: dict) -> int:
    """The usable CPUs other processes left free over a ContentionMeter's run (at least 1): a CPU counts as
    taken when others kept it at least 60% busy. Why: a 2-thread decode beside one busy process ran at
    0.9 tok/s, against 46-51 tok/s with one thread (OpenMP's barriers wait for the preempted thread)."""
    frac = contention.get("other_cpu_frac")
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
        # at most all of them: /proc/stat counts in ticks (10 ms), so a fully loaded short window can read above
        return {"other_cpu_frac": min(1.0, others / (wall * ncpu)), "own_cpu_frac": (own1 - self.own0) / (wall * ncpu),
                "loadavg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
