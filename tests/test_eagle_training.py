"""Training EAGLE heads: loss, exact resume, two processes, shipping, warm starts, growing, unrolling."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.heads.io import load_head, save_head
from specdec.heads.runner import HeadRunner
from specdec.training.train import TrainConfig, train_eagle
from tests.helpers import ROOT, make_head

# ---- training ----

def test_training_loss_decreases(trained):
    hist = trained[0]["history"]
    assert hist[-1]["loss"] < 0.8 * hist[0]["loss"]
    assert hist[-1]["top1_acc"] > hist[0]["top1_acc"]
    assert (trained[1] / "head" / "model.safetensors").is_file()


def test_resume_after_interruption_equals_uninterrupted_run(tiny, tiny_data, tmp_path):
    kw = dict(data=str(tiny_data), steps=12, batch_size=6, lr=2e-3, warmup=3, save_every=4, log_every=2,
              draft_vocab=40)
    full = train_eagle(TrainConfig(out=str(tmp_path / "a"), **kw), tiny, progress=False)
    part = train_eagle(TrainConfig(out=str(tmp_path / "b"), stop_after=4, **kw), tiny, progress=False)
    assert part["steps"] == 4 and not (tmp_path / "b" / "head").exists()
    part = train_eagle(TrainConfig(out=str(tmp_path / "b"), stop_after=4, **kw), tiny, progress=False)
    assert part["steps"] == 8
    rest = train_eagle(TrainConfig(out=str(tmp_path / "b"), **kw), tiny, progress=False)
    assert rest["steps"] == 12
    a, b = full["head"].state_dict(), rest["head"].state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la = (tmp_path / "a" / "log.jsonl").read_text().splitlines()
    lb = (tmp_path / "b" / "log.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in la] == [json.loads(x)["loss"] for x in lb]
    with pytest.raises(SpecdecError, match="lr="):
        train_eagle(TrainConfig(out=str(tmp_path / "b"), **(kw | {"lr": 1.0})), tiny, progress=False)


def test_a_kept_checkpoint_resumes_a_run_on_a_new_machine(tiny, tiny_data, tmp_path):
    """--keep-in: fp16 trained weights and the schedule, without the optimizer; a run whose --out is
    empty (a new machine) resumes from there at the kept step, close to the uninterrupted run."""
    kw = dict(data=str(tiny_data), steps=12, batch_size=6, lr=2e-3, warmup=3, save_every=4, log_every=2,
              draft_vocab=40, freeze_lm_head=True)
    full = train_eagle(TrainConfig(out=str(tmp_path / "a"), **kw), tiny, progress=False)
    kept = tmp_path / "repo" / "run"
    part = train_eagle(TrainConfig(out=str(tmp_path / "b"), stop_after=8, keep_in=str(kept), **kw), tiny,
                       progress=False)
    assert part["steps"] == 8
    state = json.loads((kept / "state.json").read_text())
    assert state["step"] == 8 and "optimizer" not in state
    kept_log = (kept / "log.jsonl").read_text().splitlines()
    assert kept_log == (tmp_path / "b" / "log.jsonl").read_text().splitlines()  # the curve so far, kept
    assert [json.loads(x)["step"] for x in kept_log] == [2, 4, 6, 8]
    files = sorted((kept / "weights").glob("*.safetensors"))
    assert files and all(f.stat().st_size <= 16 * 2**20 for f in files)
    from safetensors.torch import load_file
    saved = {k: v for f in files for k, v in load_file(f).items()}
    assert "lm_head.weight" not in saved  # frozen: the target's rows, rebuilt by the run
    assert all(v.dtype == torch.float16 for v in saved.values() if v.is_floating_point())
    # the kept head is a head as shipped: `--head` reads it
    lm = tiny.get_output_embeddings().weight
    head = load_head(kept / "weights", hidden_size=lm.shape[1], vocab_size=lm.shape[0], target_lm_head=lm)
    assert head.draft_vocab_size == 40
    # a new machine: no --out, the kept dir only
    rest = train_eagle(TrainConfig(out=str(tmp_path / "c"), keep_in=str(kept), **kw), tiny, progress=False)
    assert rest["steps"] == 12
    log = [json.loads(x) for x in (tmp_path / "c" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [2, 4, 6, 8, 10, 12]  # the kept curve, then the steps after 8
    assert log[:4] == [json.loads(x) for x in kept_log]
    assert len((kept / "log.jsonl").read_text().splitlines()) == 6  # kept again at step 12, whole
    a, c = full["head"].state_dict(), rest["head"].state_dict()
    assert torch.equal(a["lm_head.weight"], c["lm_head.weight"]) and torch.equal(a["d2t"], c["d2t"])
    moved = [k for k in a if a[k].is_floating_point() and not torch.equal(a[k], c[k])]
    assert moved  # a fresh optimizer takes other steps ...
    for k in moved:  # ... from nearly the same weights
        assert (a[k] - c[k]).norm() < 0.2 * a[k].norm() + 1e-3, k
    with pytest.raises(SpecdecError, match="lr="):
        train_eagle(TrainConfig(out=str(tmp_path / "d"), keep_in=str(kept), **(kw | {"lr": 1.0})), tiny,
                    progress=False)


def test_a_head_past_16_mib_is_written_in_shards_that_load_as_the_same_head(tiny, tmp_path, monkeypatch):
    import specdec.heads.io as io

    head = make_head(tiny)
    h, v = tiny.config.hidden_size, tiny.config.vocab_size
    monkeypatch.setattr(io, "SHARD_BYTES", 40_000)  # the tiny head's 16 MiB
    save_head(head, tmp_path / "h")
    files = sorted(p.name for p in (tmp_path / "h").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "h" / io.INDEX).is_file()
    assert all((tmp_path / "h" / f).stat().st_size <= 40_000 + 8192 for f in files)
    back = load_head(tmp_path / "h", hidden_size=h, vocab_size=v)
    for k, v in head.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def test_bf16_training_learns_like_fp32(tiny, tiny_data, tmp_path):
    kw = dict(data=str(tiny_data), steps=10, batch_size=6, lr=2e-3, warmup=2, log_every=1, draft_vocab=40)
    f32 = train_eagle(TrainConfig(out=str(tmp_path / "a"), **kw), tiny, progress=False)
    b16 = train_eagle(TrainConfig(out=str(tmp_path / "b"), precision="bf16", **kw), tiny, progress=False)
    la, lb = [h["loss"] for h in f32["history"]], [h["loss"] for h in b16["history"]]
    assert la != lb  # the matmuls did run in bf16
    assert lb[-1] < 0.95 * lb[0] and abs(lb[-1] - la[-1]) < 0.05 * la[-1]
    assert all(p.dtype == torch.float32 for p in b16["head"].parameters())


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes(tiny, tiny_data, tmp_path):
    model_dir = tmp_path / "target"
    tiny.save_pretrained(model_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    common = ["--model", str(model_dir), "--data", str(tiny_data), "--steps", "4", "--batch-size", "8",
              "--log-every", "1", "--save-every", "2", "--lr", "1e-3"]
    # `--cpu` would make accelerate's simple launcher start ONE process; the multi-process launcher
    # (torchrun) on a machine without GPUs gives MULTI_CPU with gloo
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "-m", "specdec.cli", "train", "eagle", "--out", str(tmp_path / "two")] + common
    p = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    # the one-process run through the same command, in this process (one thread, as OMP_NUM_THREADS=1 above)
    assert main(["train", "eagle", "--out", str(tmp_path / "one"), *common]) == 0
    rec2 = [json.loads(x) for x in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    assert rec2[0]["processes"] == 2
    l2 = [r["loss"] for r in rec2]
    l1 = [json.loads(x)["loss"] for x in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    assert len(l2) == len(l1) == 4
    np.testing.assert_allclose(l2, l1, rtol=1e-3)  # same global batches, same token-mean loss
    assert (tmp_path / "two" / "head" / "config.json").is_file()


def test_ship_to_writes_a_small_copy_that_loads_as_the_same_head(tiny, tiny_data, tmp_path):
    cfg = TrainConfig(data=str(tiny_data), out=str(tmp_path / "run"), steps=3, batch_size=4, warmup=1,
                      draft_vocab=40, freeze_lm_head=True, ship_to=str(tmp_path / "ship"), log_every=1)
    r = train_eagle(cfg, tiny, progress=False)
    full, small = tmp_path / "run" / "head" / "model.safetensors", tmp_path / "ship" / "model.safetensors"
    assert small.stat().st_size < 0.6 * full.stat().st_size  # fp16 and no LM head rows
    back = load_head(tmp_path / "ship", 64, 97, target_lm_head=tiny.lm_head.weight)
    torch.testing.assert_close(back.lm_head.weight, r["head"].lm_head.weight)  # frozen: still the target's rows
    for k, v in r["head"].state_dict().items():
        torch.testing.assert_close(back.state_dict()[k].float(), v.float(), atol=2e-3, rtol=2e-3)
    assert back.meta["target"]["vocab_size"] == 97 and back.meta["lm_head"] == "target"


def test_init_from_warm_starts_with_the_heads_weights_and_vocab(tiny, tiny_data, tmp_path):
    base = TrainConfig(data=str(tiny_data), out=str(tmp_path / "a"), steps=6, batch_size=4, lr=1e-2, warmup=1,
                       draft_vocab=40, freeze_lm_head=True, log_every=1)
    first = train_eagle(base, tiny, progress=False)
    # zero learning rate: the warm-started head must come out exactly as it went in
    frozen = TrainConfig(data=str(tiny_data), out=str(tmp_path / "b"), steps=2, batch_size=4, lr=0.0, warmup=0,
                         freeze_lm_head=True, init_from=str(tmp_path / "a" / "head"), log_every=1)
    again = train_eagle(frozen, tiny, progress=False)
    for k, v in first["head"].state_dict().items():
        assert torch.equal(again["head"].state_dict()[k], v), k
    # and it starts where the first run ended, not from scratch
    scratch = train_eagle(TrainConfig(**(vars(frozen) | {"out": str(tmp_path / "c"), "init_from": "",
                                                          "draft_vocab": 40})), tiny, progress=False)
    assert again["history"][0]["loss"] < scratch["history"][0]["loss"]
    with pytest.raises(SpecdecError, match="draft vocabulary of 40"):
        train_eagle(TrainConfig(**(vars(frozen) | {"out": str(tmp_path / "d"), "draft_vocab": 30})), tiny,
                    progress=False)
    with pytest.raises(SpecdecError, match="config.json is missing"):
        train_eagle(TrainConfig(**(vars(frozen) | {"out": str(tmp_path / "e"), "init_from": str(tmp_path)})), tiny,
                    progress=False)


def test_grown_head_starts_as_the_old_one_then_trains_saves_and_loads(tiny, tiny_data, tmp_path):
    """--layers 2 --init-from a 1-layer head: the new layer's residual branches start at zero, so the
    deeper head computes the old head's features exactly; training then moves it; the result round-trips."""
    base = make_head(tiny, seed=5)
    save_head(base, tmp_path / "one")
    grown = load_head(tmp_path / "one", 64, 97)
    grown.grow(2)
    assert len(grown.layers) == 2 and grown.config.num_hidden_layers == 2
    emb, lm = tiny.get_input_embeddings().weight, tiny.lm_head.weight
    toks, f = torch.randint(0, 97, (1, 9)), torch.randn(1, 9, 64)
    with torch.no_grad():
        torch.testing.assert_close(grown(emb[toks], f), base(emb[toks], f), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(HeadRunner(grown, emb, lm).forward(toks[0], f[0])[0], base(emb[toks], f)[0][0],
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(SpecdecError, match="cannot shrink"):
        grown.grow(1)
    cfg = TrainConfig(data=str(tiny_data), out=str(tmp_path / "run"), steps=8, batch_size=4, lr=1e-2, warmup=1,
                      init_from=str(tmp_path / "one"), layers=2, log_every=1)
    r = train_eagle(cfg, tiny, progress=False)
    trained = r["head"]
    assert len(trained.layers) == 2 and trained.layers[1].mlp.down_proj.weight.abs().sum() > 0
    back = load_head(tmp_path / "run" / "head", 64, 97)
    assert back.config.num_hidden_layers == 2
    with torch.no_grad():
        torch.testing.assert_close(back(emb[toks], f), trained.eval()(emb[toks], f), atol=1e-5, rtol=1e-5)
    # a 2-layer file that lost its second layer's weights is refused, not half-loaded
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "run" / "head" / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if not k.startswith("layers.1.mlp")},
              str(tmp_path / "run" / "head" / "model.safetensors"))
    with pytest.raises(SpecdecError, match=r"missing \['layers.1.mlp"):
        load_head(tmp_path / "run" / "head", 64, 97)
    with pytest.raises(SpecdecError, match="--layers"):
        train_eagle(TrainConfig(**(vars(cfg) | {"out": str(tmp_path / "neg"), "layers": -1})), tiny, progress=False)


# ---- unrolled (multi-step) training ----

@pytest.mark.parametrize("layers,variant", [(1, "eagle"), (2, "eagle"), (1, "fspad"), (2, "pad")])
def test_unrolled_steps_match_what_the_head_sees_when_drafting(tiny, layers, variant):
    """Step k of `unrolled` must compute exactly draft depth k+1 of the inference runner: same inputs
    (its own previous prediction; with PAD its f, not f̃), same keys (target rows up to the accepted one
    plus its own path)."""
    from specdec.training.train import unrolled, unrolled_mask

    head = make_head(tiny, seed=3, layers=layers, variant=variant)
    emb, lm = tiny.get_input_embeddings().weight, tiny.lm_head.weight
    t, steps = 12, 3
    toks, f = torch.randint(0, 97, (1, t)), torch.randn(1, t, 64)
    with torch.no_grad():
        preds = list(unrolled(head, emb[toks], f, steps))
    assert len(preds) == steps and unrolled_mask(4, 2).sum(1).tolist() == [1, 2, 3, 4]
    for a in range(t - steps + 1):  # a = the last accepted row
        r = HeadRunner(head, emb, lm)
        out, _ = r.forward(toks[0, : a + 1], f[0, : a + 1])
        torch.testing.assert_close(out[a], preds[0][0][0, a], atol=1e-4, rtol=1e-4)
        prev = out[a : a + 1]
        for k in range(1, steps):
            prev, _ = r.forward(toks[0, a + k : a + k + 1], prev)
            torch.testing.assert_close(prev[0], preds[k][0][0, a + k], atol=1e-4, rtol=1e-4)


def test_unrolled_training_learns_every_step_and_checks_its_option(tiny, tiny_data, tmp_path):
    kw = dict(data=str(tiny_data), steps=40, batch_size=8, lr=2e-2, warmup=5, save_every=1000, log_every=10)
    r = train_eagle(TrainConfig(out=str(tmp_path / "u3"), unroll=3, **kw), tiny, progress=False)
    first, last = r["history"][0], r["history"][-1]
    assert len(last["top1_acc_by_step"]) == 3
    assert last["loss"] < 0.9 * first["loss"]
    # the later steps learn too (they read the head's own, detached predictions)
    assert all(b > a for a, b in zip(first["top1_acc_by_step"], last["top1_acc_by_step"]))
    with pytest.raises(SpecdecError, match="unroll"):
        train_eagle(TrainConfig(out=str(tmp_path / "u0"), unroll=0, **kw), tiny, progress=False)


# ---- the total-variation term (sampled acceptance) ----

def test_tv_term_is_the_sampled_rejection_rate_and_trains_it(tiny, tiny_data, tmp_path):
    """stats[:, 4] is sum over rows of TV(p, q) = 1 - the T = 1 acceptance of a token drawn from q, computed
    here from the head's own logits; tv_weight adds exactly tv_weight * mean TV to the loss; and training
    with it raises the logged sampled acceptance (t1_accept) more than the same run without it."""
    from specdec.training.objective import Objective

    head = make_head(tiny, seed=1)
    emb, lm = tiny.get_input_embeddings().weight.detach(), tiny.lm_head.weight.detach()
    g = torch.Generator().manual_seed(0)
    ids, feats = torch.randint(0, 97, (2, 9), generator=g), torch.randn(2, 9, 64, generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False
    obj = Objective(head, emb, lm)
    with torch.no_grad():
        n = float(mask[:, 1:].sum())
        base, s = obj(ids, feats, mask, None, n, 0.1)
        with_tv, s2 = obj(ids, feats, mask, None, n, 0.1, tv_weight=0.7)
        p = torch.softmax(feats[:, 1:] @ lm.T, -1)
        q = torch.softmax(head.logits(head(emb[ids[:, 1:]], feats[:, :-1])[1], lm), -1)
    tv = 0.5 * (p - q).abs().sum(-1)
    assert torch.all((tv > 0) & (tv < 1))
    torch.testing.assert_close(s[0, 4], (tv * mask[:, 1:]).sum(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(with_tv - base, 0.7 * s[0, 4] / n, atol=1e-5, rtol=1e-4)
    assert torch.equal(s, s2)  # the statistics do not depend on the weights

    kw = dict(data=str(tiny_data), steps=60, batch_size=8, lr=1e-2, warmup=3, save_every=1000, log_every=10,
              ce_weight=0.0)
    plain = train_eagle(TrainConfig(out=str(tmp_path / "plain"), **kw), tiny, progress=False)["history"][-1]
    tvd = train_eagle(TrainConfig(out=str(tmp_path / "tv"), tv_weight=5.0, **kw), tiny, progress=False)["history"][-1]
    assert tvd["t1_accept"] > plain["t1_accept"] + 0.008  # measured: 0.655 vs 0.640 (steps 51-60)
    torch.testing.assert_close(tvd["loss"], tvd["feature_loss"] + 5.0 * (1 - tvd["t1_accept"]), atol=1e-4, rtol=1e-4)
    with pytest.raises(SpecdecError, match="tv.weight"):
        train_eagle(TrainConfig(out=str(tmp_path / "neg"), tv_weight=-1.0, **kw), tiny, progress=False)
