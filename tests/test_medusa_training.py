"""Training Medusa heads (`specdec train medusa`): the loss and accuracies read the right offsets, the heads
learn, the accuracies are written for the drafter's sparse tree, exact resume, two processes, the CLI."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdec.cli import build_parser, main
from specdec.drafters.medusa import MAX_RANK, sparse_choices
from specdec.errors import SpecdecError
from specdec.heads.medusa import MedusaHeads
from specdec.heads.medusa_io import load_medusa
from specdec.heads.shipped import target_fingerprint
from specdec.training import medusa_objective, train_cli
from specdec.training.medusa import MedusaObjective, MedusaTrainConfig, head_accuracies, held_in, train_medusa
from specdec.training.shards import ShardData
from specdec.training.train_cli import config_of
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def trained_medusa(tiny, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa-run")
    cfg = MedusaTrainConfig(data=str(tiny_data), out=str(out), steps=60, batch_size=8, lr=3e-2, warmup=5,
                            save_every=1000, log_every=10)
    return train_medusa(cfg, tiny, progress=False), out


def random_heads(lm, k=3, layers=2, lm_head="own", draft_ids=None, seed=0):
    torch.manual_seed(seed)
    heads = MedusaHeads(64, 97, k, layers, lm_head)
    heads.init_lm_heads(lm, draft_ids)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.normal_(0, 0.2)
    return heads


# ---- the objective and the accuracies, against a row-by-row reading of their definitions ----

@pytest.mark.parametrize("lm_head", ["target", "own"])
def test_loss_and_accuracies_read_the_offsets_of_their_definitions(tiny, lm_head, monkeypatch):
    lm = tiny.lm_head.weight.detach()
    draft = torch.arange(0, 97, 2)  # a reduced vocabulary: the target's odd argmax tokens match no rank
    heads = random_heads(lm, lm_head=lm_head, draft_ids=draft)
    weights = [0.8 ** (k + 1) for k in range(3)]
    g = torch.Generator().manual_seed(1)
    feats, mask = torch.randn(2, 9, 64, generator=g), (torch.rand(2, 9, generator=g) > 0.3).float()
    mask[1, 7:] = 0  # a shorter sequence, right-padded
    counts = torch.stack([mask[:, k + 2:].sum() for k in range(3)])
    loss, stats = MedusaObjective(heads, lm, weights)(None, feats, mask, counts)

    lm_d = lm[draft]
    want, hits, rows = 0.0, torch.zeros(3, MAX_RANK), torch.zeros(3)
    for k in range(3):
        lm_k = lm_d if lm_head == "target" else heads.lm_heads[k].weight
        ce = 0.0
        for b in range(2):
            for t in range(9 - k - 2):
                if not mask[b, t + k + 2]:  # head k on f_t: the label x_{t+k+2} must be an answer token
                    continue
                p = torch.softmax(lm_d @ feats[b, t + k + 1], -1)  # the target's distribution for x_{t+k+2}
                logits = lm_k @ heads.hidden(feats[b, t])[k]
                ce = ce - (p * torch.log_softmax(logits, -1)).sum()
                best = int((lm @ feats[b, t + k + 1]).argmax())  # over the full vocabulary
                hits[k] += (draft[logits.topk(MAX_RANK).indices] == best).float()
                rows[k] += 1
        want = want + weights[k] * ce / counts[k]
    torch.testing.assert_close(loss, want)
    assert stats[:, 2].tolist() == counts.tolist() == rows.tolist()

    # the logits of a long sequence are recomputed in the backward pass: the same loss and gradients
    loss.backward()
    grads = [p.grad.clone() for p in heads.parameters()]
    heads.zero_grad()
    monkeypatch.setattr(medusa_objective, "RECOMPUTE_ABOVE", 0)
    again, stats2 = MedusaObjective(heads, lm, weights)(None, feats, mask, counts)
    again.backward()
    assert torch.equal(again, loss) and torch.equal(stats2, stats)
    for a, p in zip(grads, heads.parameters()):
        torch.testing.assert_close(p.grad, a)

    data = SimpleNamespace(batch=lambda idx: (torch.zeros(len(idx), 9, dtype=torch.long), feats[idx], mask[idx]))
    acc, n = head_accuracies(heads, data, [0, 1], lm, batch=1)
    assert n == rows.tolist()
    np.testing.assert_allclose(acc, (hits / rows[:, None]).numpy(), atol=1e-6)


# ---- training ----

def test_training_lowers_every_heads_loss_and_writes_the_accuracies(trained_medusa, tiny, tiny_data):
    r, out = trained_medusa
    hist = r["history"]
    first, last = hist[0], hist[-1]
    assert len(hist) == 6 and last["loss"] < first["loss"] - 0.3
    assert all(b < a for a, b in zip(first["ce_by_head"], last["ce_by_head"]))
    assert last["top1_acc_by_head"][0] > first["top1_acc_by_head"][0]
    assert all(p.grad is None for p in tiny.parameters())  # the backbone stays frozen
    heads = load_medusa(out / "heads", 64, 97, target_lm_head=tiny.lm_head.weight)
    acc = heads.meta["accuracies"]
    assert acc == r["accuracies"] and len(acc) == 4 and all(len(row) == MAX_RANK for row in acc)
    assert all(0 <= a <= 1 for row in acc for a in row) and all(sum(row) <= 1 + 1e-6 for row in acc)
    assert heads.meta["target"] == target_fingerprint(tiny) and heads.meta["kind"] == "medusa"
    training = heads.meta["training"]
    assert training["steps"] == 60 and training["data_tokens"] > 0 and training["seconds"] > 0
    assert training["config"]["lr"] == 3e-2 and all(n > 0 for n in heads.meta["accuracy_rows"])
    # better than the untrained heads (each block the identity: head k guesses x_{t+1} for x_{t+k+2})
    data = ShardData(str(tiny_data))
    lm = tiny.lm_head.weight.detach()
    fresh = MedusaHeads(64, 97)
    fresh.init_lm_heads(lm)
    before, _ = head_accuracies(fresh, data, held_in(len(data), 0), lm)
    assert acc[0][0] > before[0][0] + 0.03
    assert len(sparse_choices(acc, 10)) == 10  # what the medusa method builds its tree from


def test_a_kept_checkpoint_resumes_medusa_heads_on_a_new_machine(tiny, tiny_data, tmp_path):
    """--keep-in with the trainers' default form (fp16 trained weights, no optimizer): an empty --out
    resumes at the kept step from weights within fp16 rounding of the interrupted run's."""
    kw = dict(data=str(tiny_data), steps=8, batch_size=6, lr=2e-3, warmup=2, save_every=4, log_every=2,
              num_heads=3, num_layers=1, lm_head="own", draft_vocab=40)
    kept = tmp_path / "kept"
    part = train_medusa(MedusaTrainConfig(out=str(tmp_path / "a"), stop_after=4, keep_in=str(kept), **kw), tiny,
                        progress=False)
    assert part["steps"] == 4 and json.loads((kept / "state.json").read_text())["step"] == 4
    assert all(f.stat().st_size <= 16 * 2**20 for f in (kept / "weights").glob("*.safetensors"))
    rest = train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), keep_in=str(kept), **kw), tiny, progress=False)
    assert rest["steps"] == 8
    # the new machine's log: the kept curve (steps 2, 4), then the steps after 4
    assert [json.loads(x)["step"] for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()] == [2, 4, 6, 8]


def test_resume_after_interruption_equals_uninterrupted_run(tiny, tiny_data, tmp_path):
    kw = dict(data=str(tiny_data), steps=8, batch_size=6, lr=2e-3, warmup=2, save_every=2, log_every=2,
              num_heads=3, num_layers=2, lm_head="own", draft_vocab=40)
    full = train_medusa(MedusaTrainConfig(out=str(tmp_path / "a"), **kw), tiny, progress=False)
    # killed between checkpoints (2 and 4): the resume redoes step 3
    part = train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), stop_after=3, **kw), tiny, progress=False)
    assert part["steps"] == 3 and not (tmp_path / "b" / "heads").exists()
    rest = train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), ship_to=str(tmp_path / "ship"), **kw), tiny,
                        progress=False)
    assert rest["steps"] == 8
    a, b = full["heads"].state_dict(), rest["heads"].state_dict()
    assert a.keys() == b.keys() and "d2t" in a and "lm_heads.2.weight" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la, lb = ([json.loads(x) for x in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in "ab")
    assert [x["step"] for x in lb] == [2, 4, 6, 8]
    for key in ("loss", "ce_by_head", "top1_acc_by_head"):
        assert [x[key] for x in la] == [x[key] for x in lb], key
    assert full["accuracies"] == rest["accuracies"]
    ship = load_medusa(tmp_path / "ship", 64, 97)
    assert ship.meta["accuracies"] == rest["accuracies"] and ship.d2t.numel() == 40
    assert (tmp_path / "ship" / "model.safetensors").stat().st_size < 0.6 * (
        tmp_path / "b" / "heads" / "model.safetensors").stat().st_size  # fp16
    again = train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), **kw), tiny, progress=False)
    assert again["finished"] and again["accuracies"] == rest["accuracies"]
    # a resume with other settings, or on data of another target, is refused in one line
    with pytest.raises(SpecdecError, match=r"holds a run with decay=0.8, not 0.5") as e:
        train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), **(kw | {"decay": 0.5})), tiny, progress=False)
    assert "\n" not in str(e.value)
    with pytest.raises(SpecdecError, match="lm_head='own', not 'target'"):
        train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), **(kw | {"lm_head": "target"})), tiny,
                     progress=False)
    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)
    (other / "meta.json").write_text(json.dumps({"target": target_fingerprint(tiny) | {"embed_abs_mean": 1.0}}))
    with pytest.raises(SpecdecError, match="different target"):
        train_medusa(MedusaTrainConfig(out=str(tmp_path / "c"), **(kw | {"data": str(other)})), tiny,
                     progress=False)


@pytest.mark.parametrize("field,value,flag", [("num_heads", 0, "--num-heads"), ("num_layers", 0, "--num-layers"),
                                              ("lm_head", "mine", "--lm-head"), ("decay", 0.0, "--decay"),
                                              ("lr", -1.0, "--lr"), ("schedule", "cubic", "--schedule")])
def test_bad_settings_name_the_flag(field, value, flag):
    with pytest.raises(SpecdecError, match=flag):
        MedusaTrainConfig(data="d", out="o", **{field: value}).check()


# ---- processes and the CLI ----

@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes_follow_one(tiny, tiny_data, tmp_path):
    model_dir = tmp_path / "target"
    tiny.save_pretrained(model_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "-m", "specdec.cli", "train", "medusa", "--model", str(model_dir), "--data", str(tiny_data),
              "--out", str(tmp_path / "two"), "--steps", "3", "--batch-size", "8", "--log-every", "1",
              "--save-every", "2", "--num-heads", "2"]
    p = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    one = train_medusa(MedusaTrainConfig(data=str(tiny_data), out=str(tmp_path / "one"), steps=3, batch_size=8,
                                         log_every=1, save_every=2, num_heads=2), tiny, progress=False)
    rec2 = [json.loads(x) for x in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    assert [r["processes"] for r in rec2] == [2, 2, 2]
    np.testing.assert_allclose([r["loss"] for r in rec2], [r["loss"] for r in one["history"]], rtol=1e-4)
    np.testing.assert_allclose([r["ce_by_head"] for r in rec2], [r["ce_by_head"] for r in one["history"]],
                               rtol=1e-4)
    heads = load_medusa(tmp_path / "two" / "heads", 64, 97)
    np.testing.assert_allclose(heads.meta["accuracies"], one["accuracies"], atol=0.01)


def test_train_medusa_cli(tiny, tiny_data, tmp_path, capsys, monkeypatch):
    parse = build_parser().parse_args
    cfg = config_of(parse(["train", "medusa", "--data", "d", "--out", "o"]), MedusaTrainConfig)
    assert cfg == MedusaTrainConfig(data="d", out="o") and (cfg.lr, cfg.num_heads, cfg.decay) == (1e-3, 4, 0.8)
    cfg = config_of(parse(["train", "medusa", "--data", "d", "--out", "o", "--lm-head", "own",
                           "--num-heads", "5", "--draft-vocab", "64"]), MedusaTrainConfig)
    assert (cfg.lm_head, cfg.num_heads, cfg.draft_vocab) == ("own", 5, 64)
    for bad in (["--lm-head", "mine"], ["--num-heads", "0"], ["--decay", "2"]):
        with pytest.raises(SystemExit) as e:
            parse(["train", "medusa", "--data", "d", "--out", "o", *bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("specdec: error:") and err.count("\n") == 1, err
    cfg = config_of(parse(["train", "medusa", "--data", "d", "--out", "o", "--joint", "--full-finetune", "--lambda0",
                           "0.5", "--heads-warmup", "7"]), MedusaTrainConfig)
    assert (cfg.joint, cfg.full_finetune, cfg.lambda0, cfg.heads_warmup, cfg.kind) == (True, True, 0.5, 7, "medusa-2")
    model_dir = tmp_path / "target"
    tiny.save_pretrained(model_dir)
    args = ["train", "medusa", "--model", str(model_dir), "--data", str(tiny_data), "--out", str(tmp_path / "run"),
            "--steps", "2", "--batch-size", "4", "--log-every", "1", "--num-heads", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("train medusa: step 2/2") and "held-in top-1 accuracy by head" in printed
    assert printed.count("\n") == 1
    raw = json.loads((tmp_path / "run" / "heads" / "config.json").read_text())
    assert raw["model_type"] == "medusa" and raw["num_heads"] == 2 and len(raw["specdec"]["accuracies"]) == 2
    monkeypatch.setattr(train_cli, "materialize", lambda *a, **k: pytest.fail("the target was loaded"))
    assert main(args) == 0  # a finished run: reported before the target loads
    assert "already finished (step 2/2)" in capsys.readouterr().out


def test_init_from_starts_at_those_heads_and_refuses_other_shapes(trained_medusa, tiny, tiny_data, tmp_path):
    src = Path(trained_medusa[1]) / "heads"
    base = load_medusa(src)
    kw = dict(data=str(tiny_data), steps=1, batch_size=4, lr=0.0, warmup=0, init_from=str(src),
              num_heads=base.num_heads, num_layers=base.num_layers, lm_head=base.lm_head_kind,
              draft_vocab=0 if base.d2t is None else base.draft_vocab_size)
    r = train_medusa(MedusaTrainConfig(out=str(tmp_path / "w"), **kw), tiny, progress=False)
    after = load_medusa(tmp_path / "w" / "heads")
    for k, v in base.state_dict().items():  # lr 0: the run ends where it started, the given heads
        assert torch.equal(after.state_dict()[k], v), k
    assert r["accuracies"] == base.meta["accuracies"]  # same heads, same held-in rows
    with pytest.raises(SpecdecError, match="--init-from .* has num_heads="):
        train_medusa(MedusaTrainConfig(out=str(tmp_path / "x"), **(kw | {"num_heads": base.num_heads + 1})), tiny,
                     progress=False)
