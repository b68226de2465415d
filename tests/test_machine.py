"""The memory floor a benchmark prints beside every figure, and its contention meter."""

import subprocess
import sys
import time

import pytest

from specdec.machine import ContentionMeter, _pid_cpu_s, memory_floor, weight_bytes_per_token
from tests.conftest import tiny_model


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_helper_process_counts_as_the_runs_own_work():
    busy = [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"]
    results = {}
    for helper in (False, True):
        proc = subprocess.Popen(busy)
        try:
            meter = ContentionMeter([proc.pid] if helper else [])
            time.sleep(1.0)
            results[helper] = meter.result()["other_cpu_frac"]
            assert _pid_cpu_s(proc.pid) > 0.3
        finally:
            proc.wait()
    # one busy process on the machine's usable CPUs: as "other" it shows; as a helper it does not
    assert results[False] > results[True] + 0.15
