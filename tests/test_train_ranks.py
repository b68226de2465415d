"""`specdec train` across processes (torchrun, 2 CPU processes, DDP over gloo): the trained head is the
1-process run's with the same global batches, and a run stopped or killed midway resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.training.loop import load_data
from specdec.training.shards import ShardData, global_batch
from specdec.training.train import TrainConfig
from tests.helpers import ROOT, make_data

STEPS = 16  # the killed run has 12 steps left after its first checkpoint: the kill lands mid-run


def test_each_process_reads_its_slice_of_the_global_batch(tiny_data):
    data = ShardData(str(tiny_data))
    for step in (0, 5, 40):  # within the first epoch and later ones
        rows = global_batch(len(data), 8, 0, step)
        mine = [rows[r::2] for r in range(2)]
        assert sorted(mine[0] + mine[1]) == sorted(rows) and not set(mine[0]) & set(mine[1])
        # a process's batch holds exactly the rows the 1-process batch holds for those sequences
        one, part = data.batch(rows), data.batch(mine[1])
        for k, i in enumerate(mine[1]):
            r = rows.index(i)
            n = data.spans[i][1] - data.spans[i][0]
            for a, b in zip(one, part):
                assert torch.equal(a[r, :n], b[k, :n])


def test_fewer_sequences_than_processes_is_one_clear_error(tiny, tmp_path):
    make_data(tiny, tmp_path / "d", n_seq=2)  # one sequence per shard
    cfg = TrainConfig(data=str(tmp_path / "d"), out=str(tmp_path / "a"), batch_size=4)
    assert len(load_data(cfg, None, {}, 64, world=2, main=False)[0]) == 2
    with pytest.raises(SpecdecError, match="2 trainable sequences .* fewer than the 3 processes"):
        load_data(cfg, None, {}, 64, world=3, main=False)


def torchrun(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", "0", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
                             "-m", "specdec.cli", *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def log_lines(out) -> list[dict]:
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_train_the_one_process_head_and_resume_after_a_kill(tiny, tiny_data, tmp_path):
    model_dir = tmp_path / "target"
    tiny.save_pretrained(model_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    common = ["train", "eagle", "--model", str(model_dir), "--data", str(tiny_data), "--steps", str(STEPS),
              "--batch-size", "8", "--log-every", "1", "--save-every", "2", "--lr", "1e-3", "--warmup", "1",
              "--draft-vocab", "40"]
    # the one-process run through the same command, in this process (one thread, as OMP_NUM_THREADS=1 gives
    # the workers): the process boundary is the multi-process runs' point, not this one's
    assert main([*common, "--out", str(tmp_path / "one"), "--threads", "1"]) == 0

    two = tmp_path / "two"
    p = torchrun([*common, "--out", str(two), "--stop-after", "3"], env)
    log = p.communicate(timeout=600)[0].decode(errors="replace")
    assert p.returncode == 0 and f"stopped at step 3/{STEPS}" in log, log[-3000:]
    # the next invocation resumes at step 2 (the last checkpoint) and is killed once it saves another
    p = torchrun([*common, "--out", str(two)], env)
    deadline = time.monotonic() + 600
    while len(list((two / "checkpoints").glob("step-*"))) < 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    killed = p.poll() is None
    if killed:  # a worker dies: torchrun stops the other one
        workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(workers[-1]), signal.SIGKILL)
    try:
        p.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # torchrun once left the other worker waiting on the dead one: the job dies
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
    if killed:
        assert p.returncode != 0 and not (two / "head").exists()
    p = torchrun([*common, "--out", str(two)], env)
    log = p.communicate(timeout=600)[0].decode(errors="replace")
    assert p.returncode == 0, log[-3000:]

    l1, l2 = log_lines(tmp_path / "one"), log_lines(two)
    assert [r["step"] for r in l2] == list(range(1, STEPS + 1))  # every step logged once across the resumes
    assert {r["processes"] for r in l2} == {2} and {r["processes"] for r in l1} == {1}
    # the same global batches and token-mean loss: the curves agree up to the sum order of fp32 reductions
    for k in ("loss", "top1_acc"):
        torch.testing.assert_close(torch.tensor([r[k] for r in l2]), torch.tensor([r[k] for r in l1]),
                                   rtol=1e-4, atol=1e-5)
    a, b = (load_file(str(d / "head" / "model.safetensors")) for d in (tmp_path / "one", two))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-4, msg=k)
