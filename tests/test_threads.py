"""The thread count while decoding (runtime/threads.py): it follows the CPUs other processes leave free, with
hysteresis, only when the user fixed none; and a generation's tokens never depend on it, also when it
changes mid-generation."""

import pytest
import torch

from specdec.batch import Batch
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.runtime import cpus, stream, threads
from specdec.runtime.lean import LeanRunner
from specdec.runtime.loading import Runtime
from specdec.sampling import SamplingParams
from tests.helpers import gguf_runner, run, tiny_gguf, tiny_model
from tests.test_machine import ScriptedMachine

PROMPT = [(7 * i + 3) % 90 for i in range(90)]  # two prefill forwards


@pytest.fixture(autouse=True)
def restored():
    """Each test leaves the process's count and controller as it found them."""
    before, old = torch.get_num_threads(), threads.install(None)
    yield
    threads.install(old)
    torch.set_num_threads(before)


class Scripted:
    """A controller that sets the count its script gives for each step (the last one from then on)."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.seen = script, []

    def tick(self) -> None:
        torch.set_num_threads(self.script[min(len(self.seen), len(self.script) - 1)])
        self.seen.append(torch.get_num_threads())


SWITCHING = [2] * 4 + [1] * 6 + [2]  # 2 -> 1 -> 2 mid-generation


def runners(tmp_path):
    model = tiny_model("llama", seed=2, hidden_size=128, intermediate_size=512)
    out = {"lean": LeanRunner(model)}
    if stream.kernel() is not None:  # the GGUF blocks run on the native kernels only
        path, gmodel = tiny_gguf(tmp_path / "q4_0.gguf", "Q4_0")
        out["gguf"] = gguf_runner(path, gmodel)
    return out


def switched(runner, drafter, requests):
    """Each request's tokens, decoded alone and then together in a batch, while the count switches."""
    script = Scripted(SWITCHING)
    threads.install(script)
    alone = [run(runner, drafter, p, SamplingParams(), n)[0] for p, n in requests]
    assert script.seen[:len(SWITCHING)] == SWITCHING  # it did switch, between steps
    batch = Batch(runner, drafter, set(), prefill_chunk=32)
    seqs = {batch.join(p, SamplingParams(), n): [] for p, n in requests}
    while len(batch):
        for seq, new in batch.step():
            seqs[seq] += new
    threads.install(None)
    return alone, list(seqs.values())


@pytest.mark.skipif(cpus.usable_cpus() < 2, reason="needs two CPUs to switch between")
def test_tokens_do_not_depend_on_the_thread_count_switched_mid_generation(tmp_path):
    requests = [(PROMPT, 24), ([5, 17, 33, 2], 12)]
    for name, runner in runners(tmp_path).items():
        drafter = PromptLookupDrafter(chain_len=3)  # verify forwards of several rows, and of one
        with threads.pinned(2):
            fixed = [run(runner, drafter, p, SamplingParams(), n)[0] for p, n in requests]
        alone, batched = switched(runner, drafter, requests)
        assert alone == fixed and batched == fixed, name


def follower(m: ScriptedMachine, ceiling: int = 2) -> threads.Follower:
    torch.set_num_threads(ceiling)
    return threads.Follower(ceiling, ceiling, every_s=1.0, confirm=2, clock=lambda: m.wall)


def test_threads_drop_when_others_take_a_cpu_and_come_back_when_they_leave(monkeypatch):
    m = ScriptedMachine(monkeypatch, ncpu=2)
    f = follower(m)
    m.advance(0.5, own=1.0, others=0.5)
    f.tick()  # within the second: no reading
    assert f.readings == [] and torch.get_num_threads() == 2
    m.advance(0.5, own=0.5, others=0.5)  # another process kept one CPU busy over the second
    f.tick()
    assert f.readings == [1] and torch.get_num_threads() == 2  # one reading moves nothing
    m.advance(1.0, own=1.0, others=0.9)
    f.tick()
    assert torch.get_num_threads() == 1 and f.changes == 1  # two in a row: one thread
    m.advance(1.0, own=1.0, others=0.0)  # it left
    f.tick()
    assert torch.get_num_threads() == 1
    m.advance(1.0, own=1.0, others=0.0)
    f.tick()
    assert torch.get_num_threads() == 2 and f.changes == 2  # two quiet seconds: both threads again


def test_a_busy_second_between_quiet_ones_moves_nothing(monkeypatch):
    m = ScriptedMachine(monkeypatch, ncpu=2)
    f = follower(m)
    for others in (0.0, 1.0, 0.0, 1.0, 0.0, 0.1):  # alternating: never two busy readings in a row
        m.advance(1.0, own=1.5, others=others)
        f.tick()
        assert torch.get_num_threads() == 2
    assert f.changes == 0


def test_threads_never_exceed_the_usual_count(monkeypatch):
    """Four idle CPUs, a process that uses two threads as usual: it stays at two."""
    m = ScriptedMachine(monkeypatch, ncpu=4)
    f = follower(m, ceiling=2)
    for _ in range(3):
        m.advance(1.0, own=2.0)
        f.tick()
    assert torch.get_num_threads() == 2 and f.changes == 0
    m.advance(1.0, own=1.0, others=3.0)  # three CPUs taken: one left
    f.tick()
    m.advance(1.0, own=1.0, others=3.0)
    f.tick()
    assert torch.get_num_threads() == 1


def test_the_count_follows_only_when_the_user_fixed_none(monkeypatch):
    ScriptedMachine(monkeypatch, ncpu=2)
    monkeypatch.setattr(cpus, "free_cpus", lambda: 2)
    monkeypatch.setattr(threads, "_usual", 2)
    assert Runtime().apply() is None and isinstance(threads._controller, threads.Follower)
    assert Runtime(threads=1).apply() is None and threads._controller is None
    assert torch.get_num_threads() == 1
    threads.tick()  # nothing moves a fixed count
    assert torch.get_num_threads() == 1
    monkeypatch.setattr(cpus, "free_cpus", lambda: 1)
    note = Runtime().apply()
    assert torch.get_num_threads() == 1 and "another process is keeping 1 of 2 CPUs busy" in note


def test_a_pinned_run_holds_its_count_and_gives_the_controller_back():
    script = Scripted([1])
    threads.install(script)
    with threads.pinned(2):
        threads.tick()
        assert torch.get_num_threads() == 2 and script.seen == []
    threads.tick()
    assert script.seen == [1] and threads._controller is script


def test_a_bench_run_holds_its_count_whatever_the_machine_does(monkeypatch):
    """bench times every method at one count (the one it records): no controller moves it mid-run."""
    from specdec.bench import runner as bench

    seen = []

    def timed(*args):
        for _ in range(20):  # the run's decoding steps
            threads.tick()
            seen.append(torch.get_num_threads())
        return {}

    monkeypatch.setattr(bench, "_run", timed)
    script = Scripted([1, 2])
    threads.install(script)
    bench.run_bench(bench.BenchConfig(methods=[], threads=2, progress=False), [object()], None, None)
    assert seen == [2] * 20 and script.seen == [] and threads._controller is script


def test_a_process_loaded_on_one_thread_is_back_on_both_half_a_second_after_the_machine_is_quiet(monkeypatch):
    """The defaults: a load during a busy second starts on one thread; the first answer must not spend seconds
    there once the other process has gone (nor move on one reading)."""
    m = ScriptedMachine(monkeypatch, ncpu=2)
    torch.set_num_threads(1)
    f = threads.Follower(2, 1, clock=lambda: m.wall)
    m.advance(0.25, own=0.25)
    f.tick()
    assert torch.get_num_threads() == 1  # one quiet reading moves nothing
    m.advance(0.25, own=0.25)
    f.tick()
    assert torch.get_num_threads() == 2 and f.changes == 1
