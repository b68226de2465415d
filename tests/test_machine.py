"""The memory floor a benchmark prints beside every figure, and its contention meter."""

import sys
import time
from types import SimpleNamespace

import pytest

from specdec.machine import memory_floor, weight_bytes_per_token
from specdec.runtime import cpus
from tests.helpers import tiny_model


def test_weight_bytes_count_tied_tensors_once_and_one_row_of_an_untied_embedding():
    untied = tiny_model("llama")  # 97 x 64 embedding, separate LM head
    params = sum(p.numel() for p in untied.parameters())
    assert weight_bytes_per_token(untied) == 4 * (params - 96 * 64)
    tied = tiny_model("llama", tie_word_embeddings=True)
    assert weight_bytes_per_token(tied) == 4 * sum(p.numel() for p in tied.parameters())
    assert weight_bytes_per_token(tied.half()) == 2 * sum(p.numel() for p in tied.parameters())


def test_the_floor_is_bytes_over_bandwidth():
    m = tiny_model("llama")
    fl = memory_floor(m, bandwidth=1e9)
    assert fl["ms_per_forward"] == 1e3 * weight_bytes_per_token(m) / 1e9
    assert fl["forwards_per_s"] * fl["ms_per_forward"] == 1e3
    measured = memory_floor(m)  # a real measurement: positive and finite
    assert 0.1 < measured["bandwidth_gb_s"] < 10_000


class ScriptedMachine:
    """Stands in for /proc and the clocks: the test says how much CPU each party used over a window."""

    def __init__(self, monkeypatch, ncpu=2):
        self.wall = self.busy = self.own = 0.0
        self.helpers: dict[int, float] = {}
        monkeypatch.setattr(cpus, "_cpu_busy_s", lambda: self.busy)
        monkeypatch.setattr(cpus, "_pid_cpu_s", lambda pid: self.helpers.get(pid, 0.0))
        monkeypatch.setattr(cpus, "usable_cpus", lambda: ncpu)
        monkeypatch.setattr(cpus, "time", SimpleNamespace(perf_counter=lambda: self.wall,
                                                             process_time=lambda: self.own,
                                                             sleep=lambda s: self.advance(s)))

    def advance(self, wall, own=0.0, others=0.0, helpers=None):
        """`wall` seconds pass; this process uses `own` CPU-s, others `others`, helper pids theirs."""
        self.wall += wall
        self.own += own
        for pid, s in (helpers or {}).items():
            self.helpers[pid] = self.helpers.get(pid, 0.0) + s
        self.busy += own + others + sum((helpers or {}).values())


def test_a_helper_process_counts_as_the_runs_own_work(monkeypatch):
    m = ScriptedMachine(monkeypatch, ncpu=2)
    alone, with_helper = cpus.ContentionMeter([]), cpus.ContentionMeter([4242])
    # 2 s on 2 CPUs: this process 1 CPU-s, a helper (say a peer's llama-server) 1.5, a stranger 0.5
    m.advance(2.0, own=1.0, others=0.5, helpers={4242: 1.5})
    assert alone.result()["other_cpu_frac"] == pytest.approx((1.5 + 0.5) / 4)
    r = with_helper.result()
    assert r["other_cpu_frac"] == pytest.approx(0.5 / 4)
    assert r["own_cpu_frac"] == pytest.approx((1.0 + 1.5) / 4)


def test_contention_never_goes_negative_and_is_unknown_without_proc(monkeypatch):
    m = ScriptedMachine(monkeypatch)
    meter = cpus.ContentionMeter()
    m.advance(1.0, own=0.5)
    m.busy -= 0.2  # /proc/stat ticks are coarser than process_time: own time can exceed the machine's
    assert meter.result()["other_cpu_frac"] == 0.0
    monkeypatch.setattr(cpus, "_cpu_busy_s", lambda: None)
    assert cpus.ContentionMeter().result() == {"other_cpu_frac": None}


@pytest.mark.parametrize("others, free", [(0.0, 4), (0.5, 4), (1.0, 3), (2.9, 1), (4.0, 1)])
def test_free_cpus_leaves_out_the_cpus_others_keep_busy(monkeypatch, others, free):
    m = ScriptedMachine(monkeypatch, ncpu=4)
    monkeypatch.setattr(cpus.time, "sleep", lambda s: m.advance(1.0, others=others))
    assert cpus.free_cpus() == free


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_live_process_cpu_time_is_read_from_proc():
    import os

    t = time.process_time()
    while time.process_time() - t < 0.05:  # a little CPU work of our own, so the tick count moves
        pass
    assert cpus._pid_cpu_s(os.getpid()) > 0
    assert cpus._pid_cpu_s(2**22 + 1) == 0.0  # no such process
