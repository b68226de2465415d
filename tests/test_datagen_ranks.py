"""datagen across processes (torchrun, 2 CPU processes): the same samples as one process, one manifest
written at the end, and a run killed midway resumes without redoing or duplicating a shard."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from specdec.errors import SpecdecError
from specdec.training.shards import RANK_MANIFESTS, list_shards, merge_manifests, read_manifest, resume_shards

ROOT = Path(__file__).resolve().parents[1]
N = 6


def torchrun(out: Path, tok: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{ROOT}", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", "0", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
                             str(ROOT / "tests" / "datagen_rank.py"), tok, str(out), str(N)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def samples(d: Path) -> dict[str, list[list[int]]]:
    out = {}
    for f in list_shards(d):
        t = load_file(str(f))
        ids, off = t["input_ids"].tolist(), t["offsets"].tolist()
        out[f.name] = [ids[a:b] for a, b in zip(off, off[1:])]
    return out


def test_a_rank_owns_every_world_th_shard_and_its_own_manifest(tmp_path):
    todo = [resume_shards(tmp_path, 7, rank=r, world=3)[0] for r in range(3)]
    assert todo == [[0, 3, 6], [1, 4], [2, 5]]
    (tmp_path / "manifest.rank-00001.json").write_text(json.dumps({"shards": {"shard-00001.safetensors": {"a": 1}}}))
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": {"shard-00000.safetensors": {"b": 2}}}))
    assert set(read_manifest(tmp_path)) == {"shard-00000.safetensors", "shard-00001.safetensors"}
    assert merge_manifests(tmp_path) == 2 and not list(tmp_path.glob(RANK_MANIFESTS))
    assert set(json.loads((tmp_path / "manifest.json").read_text())["shards"]) == {
        "shard-00000.safetensors", "shard-00001.safetensors"}


def test_rank_environment_is_checked(monkeypatch):
    from specdec.training.dist import init, rank_world

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(SpecdecError, match="RANK=2 is not in 0..WORLD_SIZE-1"):
        rank_world()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(SpecdecError, match="must be integers"):
        rank_world()
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(SpecdecError, match="torchrun"):
        init(2)


@pytest.mark.slow
def test_two_processes_make_the_same_samples_and_resume_after_a_kill(tmp_path, smollm2_tokenizer_dir):
    tok = str(smollm2_tokenizer_dir)
    sys.path.insert(0, str(ROOT))
    from tests.datagen_rank import main

    main(tok, str(tmp_path / "one"), N)  # one process, in this one
    one = samples(tmp_path / "one")
    assert len(one) == N

    p = torchrun(tmp_path / "two", tok)
    deadline = time.monotonic() + 600
    while not list_shards(tmp_path / "two") and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = p.poll() is None
    if killed:  # a worker dies midway: torchrun stops the other one
        workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(workers[-1]), signal.SIGKILL)
    p.wait(600)
    made = {f.name: f.stat().st_mtime_ns for f in list_shards(tmp_path / "two")}
    if killed:
        assert p.returncode != 0 and len(made) < N
    p = torchrun(tmp_path / "two", tok)
    log = p.communicate(timeout=900)[0].decode(errors="replace")
    assert p.returncode == 0, log[-2000:]
    two = samples(tmp_path / "two")
    assert two == one  # shard by shard: the same sequences
    for name, mtime in made.items():  # finished shards were kept, not made again
        assert (tmp_path / "two" / name).stat().st_mtime_ns == mtime
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())["shards"]
    assert sorted(manifest) == sorted(one) and not list((tmp_path / "two").glob(RANK_MANIFESTS))
