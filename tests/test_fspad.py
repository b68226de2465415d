"""FSPAD (Feature Sampler + Partial Alignment Distillation) as options of the EAGLE head: the file format,
training, the `fspad` method, and losslessness with FS and PAD heads. The head/runner equivalence of all
four variants is in test_eagle_head.py, the unrolled-training check with PAD in test_eagle_training.py."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.drafters.base import DecodeContext, NoDrafter
from specdec.errors import SpecdecError
from specdec.heads.io import load_head, save_head
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.training.train import TrainConfig, train_eagle
from tests.helpers import (
    PROMPTS,
    ROOT,
    TRAIN_KW,
    VARIANTS,
    chi2_pvalue,
    drafter_for,
    exact_first3,
    flat_tiny,
    greedy_taus,
    make_head,
    run,
    sample_first3,
    tiny_model,
)

SHIPPED = ROOT / "src" / "specdec" / "heads" / "smollm2-135m-instruct-eagle"


@pytest.fixture(scope="module")
def trained_fspad(tiny, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("fspad-run")
    cfg = TrainConfig(data=str(tiny_data), out=str(out), **TRAIN_KW, connector="sampler", pad=True)
    return train_eagle(cfg, tiny, progress=False), out


# ---- the file format ----


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_load_round_trip_keeps_the_variant(tiny, tmp_path, variant):
    head = make_head(tiny, seed=1, variant=variant, sampler_size=96 if "fs" in variant else None)
    save_head(head, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert (cfg["connector"], cfg["pad"]) == VARIANTS[variant]
    assert cfg.get("sampler_intermediate_size") == (96 if cfg["connector"] == "sampler" else None)
    back = load_head(tmp_path / "h", 64, 97)
    assert (back.connector, back.pad, back.sampler_size) == (head.connector, head.pad, head.sampler_size)
    assert back.state_dict().keys() == head.state_dict().keys()
    for k, t in head.state_dict().items():
        assert torch.equal(t, back.state_dict()[k]), k
    emb = tiny.get_input_embeddings().weight
    toks, f = torch.randint(0, 97, (1, 6)), torch.randn(1, 6, 64)
    with torch.no_grad():
        torch.testing.assert_close(back(emb[toks], f), head(emb[toks], f))


def test_sampler_size_defaults_to_the_targets_intermediate_size(tiny):
    head = make_head(tiny, variant="fs")
    assert head.sampler_size == tiny.config.intermediate_size == 128
    assert head.sampler.up_proj.weight.shape == (128, 64) and head.fc is None


def test_heads_without_the_fields_load_as_eagle(tiny, tmp_path):
    """Every head written before FSPAD (the shipped one too) has no connector/pad fields: fc, no PAD."""
    save_head(make_head(tiny), tmp_path / "old")
    cfg = json.loads((tmp_path / "old" / "config.json").read_text())
    for k in ("connector", "pad"):
        del cfg[k]
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    old = load_head(tmp_path / "old", 64, 97)
    assert (old.connector, old.pad, old.sampler_size) == ("fc", False, None)
    raw = json.loads((SHIPPED / "config.json").read_text())
    assert "connector" not in raw and "pad" not in raw
    h, v = raw["hidden_size"], raw["vocab_size"]
    shipped = load_head(SHIPPED, h, v, target_lm_head=torch.zeros(v, h))
    assert (shipped.connector, shipped.pad) == ("fc", False) and shipped.fc.weight.shape == (h, 2 * h)


def _rewrite(src: Path, dst: Path, cfg_edit=None, tensors_from: Path | None = None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if cfg_edit:
        cfg_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").write_bytes(((tensors_from or src) / "model.safetensors").read_bytes())
    return dst


def test_a_file_whose_tensors_do_not_match_its_config_is_refused(tiny, tmp_path):
    for name in VARIANTS:
        save_head(make_head(tiny, variant=name), tmp_path / name)
    cases = [  # (config from, tensors from, config edit, the error)
        ("eagle", "pad", None, r"down_proj.weight is \[128, 128\], expected \[64, 128\] for pad=false"),
        ("pad", "eagle", None, r"down_proj.weight is \[64, 128\], expected \[128, 128\] for pad=true"),
        ("eagle", "fs", None, r"Feature Sampler tensors \(sampler.\*\) but config.json says connector=fc"),
        ("fs", "eagle", None, "holds fc.weight but config.json says connector=sampler"),
        (
            "fs",
            "fs",
            lambda c: c.update(sampler_intermediate_size=96),
            r"sampler.gate_proj.weight is \[128, 64\], "
            r"expected \[96, 64\]",
        ),
        ("fs", "fs", lambda c: c.pop("sampler_intermediate_size"), "without a valid sampler_intermediate_size"),
        ("eagle", "eagle", lambda c: c.update(connector="mlp"), "connector='mlp', expected fc or sampler"),
        ("pad", "pad", lambda c: c.update(pad="yes"), "pad='yes', expected true or false"),
    ]
    for i, (cfg_from, tensors_from, edit, err) in enumerate(cases):
        d = _rewrite(tmp_path / cfg_from, tmp_path / f"bad{i}", edit, tmp_path / tensors_from)
        with pytest.raises(SpecdecError, match=err) as e:
            load_head(d, 64, 97)
        assert "\n" not in str(e.value)


# ---- training ----


def test_fspad_training_loss_falls_and_logs_feature_loss_and_top1(trained_fspad):
    r, out = trained_fspad
    hist = r["history"]
    assert hist[-1]["loss"] < 0.8 * hist[0]["loss"] and hist[-1]["top1_acc"] > hist[0]["top1_acc"]
    assert hist[-1]["feature_loss"] < hist[0]["feature_loss"]
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == list(range(10, 101, 10))
    assert all({"feature_loss", "top1_acc", "ce", "loss"} <= x.keys() for x in log)
    head = load_head(out / "head", 64, 97)
    assert (head.connector, head.pad) == ("sampler", True)
    assert head.meta["training"]["config"]["connector"] == "sampler"


def test_fspad_resume_is_bitwise_the_uninterrupted_run(tiny, tiny_data, tmp_path):
    kw = dict(
        data=str(tiny_data),
        steps=8,
        batch_size=6,
        lr=2e-3,
        warmup=2,
        save_every=2,
        log_every=2,
        connector="sampler",
        pad=True,
        sampler_size=80,
    )
    full = train_eagle(TrainConfig(out=str(tmp_path / "a"), **kw), tiny, progress=False)
    # killed between checkpoints (2 and 4): the resume redoes step 3
    part = train_eagle(TrainConfig(out=str(tmp_path / "b"), stop_after=3, **kw), tiny, progress=False)
    assert part["steps"] == 3
    rest = train_eagle(TrainConfig(out=str(tmp_path / "b"), **kw), tiny, progress=False)
    assert rest["steps"] == 8 and rest["head"].sampler_size == 80
    a, b = full["head"].state_dict(), rest["head"].state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la, lb = ([json.loads(x) for x in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in "ab")
    for key in ("loss", "feature_loss", "top1_acc"):
        assert [x[key] for x in la] == [x[key] for x in lb], key
    # a resume (or a warm start) must keep the head's shape
    with pytest.raises(SpecdecError, match="pad="):
        train_eagle(TrainConfig(out=str(tmp_path / "b"), **(kw | {"pad": False})), tiny, progress=False)
    with pytest.raises(SpecdecError, match="connector=sampler, pad=True"):
        train_eagle(
            TrainConfig(
                out=str(tmp_path / "c"),
                init_from=str(tmp_path / "a" / "head"),
                **(kw | {"connector": "fc", "sampler_size": 0}),
            ),
            tiny,
            progress=False,
        )
    with pytest.raises(SpecdecError, match="--sampler-size needs --connector sampler"):
        TrainConfig(data="d", out="o", sampler_size=64).check()


def test_train_cli_fspad_is_eagle_with_sampler_and_pad(tiny, tiny_data, tmp_path, capsys):
    from specdec.cli import build_parser, main
    from specdec.training.train_cli import config_of

    parse = build_parser().parse_args
    a = parse(["train", "fspad", "--data", "d", "--out", "o"])
    b = parse(["train", "eagle", "--data", "d", "--out", "o", "--connector", "sampler", "--pad"])
    assert config_of(a, TrainConfig) == config_of(b, TrainConfig)
    assert config_of(a, TrainConfig).kind == "fspad"
    plain = config_of(parse(["train", "eagle", "--data", "d", "--out", "o", "--ce-weight", "0.02"]), TrainConfig)
    assert (plain.connector, plain.pad, plain.ce_weight) == ("fc", False, 0.02)
    with pytest.raises(SystemExit):
        parse(["train", "fspad", "--data", "d", "--out", "o", "--connector", "fc"])
    model_dir = tmp_path / "target"
    tiny.save_pretrained(model_dir)
    args = [
        "train",
        "fspad",
        "--model",
        str(model_dir),
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--log-every",
        "1",
        "--threads",
        "1",
    ]
    assert main(args) == 0
    assert "train fspad: step 2/2" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "run" / "head" / "config.json").read_text())
    assert (cfg["connector"], cfg["pad"], cfg["sampler_intermediate_size"]) == ("sampler", True, 128)


# ---- the `fspad` method: lossless ----


def test_fspad_takes_the_head_shipped_for_its_target(tiny, trained, trained_fspad, tmp_path, monkeypatch):
    """Without head=: an error before any model loads when no FSPAD head ships at all; else the FSPAD head
    shipped for the loaded target, while eagle2 and auto keep the plain EAGLE head shipped beside it."""
    import shutil

    import specdec.heads.shipped as shipped
    from specdec.api import from_models, load
    from specdec.drafters import registry

    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "empty")
    with pytest.raises(SpecdecError, match="head must be given.*pass head=<dir>"):
        registry.parse("fspad", {})
    with pytest.raises(SpecdecError, match="method 'fspad': head must be given"):
        load("/nonexistent/model", "fspad")  # the method's error, not the model's
    _, opts = registry.parse("auto", {})
    assert opts.head is None  # auto needs no head

    ship = tmp_path / "ship"
    shutil.copytree(trained[1] / "head", ship / "tiny-a-eagle")
    shutil.copytree(trained_fspad[1] / "head", ship / "tiny-b-fspad")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", ship)
    assert shipped.shipped_targets("fspad") == ["tiny-b-fspad"] and shipped.shipped_targets("eagle") == ["tiny-a-eagle"]
    registry.parse("fspad", {})  # one ships: the loaded target decides
    assert shipped.find_shipped_head(tiny, "fspad") == ship / "tiny-b-fspad"
    assert shipped.find_shipped_head(tiny, "eagle") == ship / "tiny-a-eagle"
    dec = from_models(tiny, None, "fspad", depth=4, topk=3, tree_size=8)
    assert dec.drafter.name == "fspad" and (dec.drafter.runner.connector, dec.drafter.runner.pad) == ("sampler", True)
    for prompt in PROMPTS:
        want, _ = run(LeanRunner(tiny), NoDrafter(), prompt, SamplingParams(), 24)
        got, _ = run(dec.runner, dec.drafter, prompt, SamplingParams(), 24)
        assert got == want
    assert from_models(tiny, None, "eagle2").drafter.runner.connector == "fc"  # the plain EAGLE head
    with pytest.raises(SpecdecError, match=r"needs an FSPAD head for this model: none ships for it \(shipped: "
                                           r"tiny-b-fspad\); pass head=<dir>"):
        from_models(tiny_model("llama", seed=5), None, "fspad")


@pytest.mark.parametrize("which", ["untrained-fs", "untrained-pad", "trained-fspad"])
def test_fspad_greedy_equals_vanilla(tiny, trained_fspad, which):
    from specdec.api import from_models

    target = LeanRunner(tiny)
    if which == "trained-fspad":
        dec = from_models(tiny, None, "fspad", head=str(trained_fspad[1] / "head"), depth=4, topk=3, tree_size=8)
        drafter, target = dec.drafter, dec.runner
        assert drafter.name == "fspad"
    else:
        drafter = drafter_for(tiny, make_head(tiny, variant=which.split("-")[1]), True, depth=4, topk=3, tree_size=8)
    taus = greedy_taus(target, drafter)
    if which == "trained-fspad":  # drafts really get accepted
        assert np.mean(taus) > 1.5


def test_fspad_refuses_a_head_without_fs_and_pad(tiny, trained):
    from specdec.api import from_models

    with pytest.raises(SpecdecError, match="needs an FSPAD head.*connector=fc, pad=false: run it with eagle2"):
        from_models(tiny, None, "fspad", head=str(trained[1] / "head"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,params",
    [("fs", SamplingParams(0.8, top_k=3, top_p=0.95)), ("pad", SamplingParams(1.2, top_k=4, top_p=0.85))],
    ids=["fs-T0.8-topk3-topp0.95", "pad-T1.2-topk4-topp0.85"],
)
def test_fs_and_pad_sampling_on_a_tree_matches_vanilla_distribution(variant, params):
    model = flat_tiny()
    drafter = drafter_for(model, make_head(model, seed=3, variant=variant), True, depth=3, topk=2, tree_size=5)
    target = LeanRunner(model)
    prompt = [1, 3, 0, 2]
    counts, sizes = sample_first3(target, drafter, prompt, params)
    assert max(sizes) >= 4
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


def test_pad_drafting_continues_with_f_and_scores_with_f_tilde(tiny):
    """PAD: the runner's first output f is what the next draft step reads; f̃ only feeds the LM head. The
    tree's last depth is never expanded, so that step computes f̃ alone (f's half of down_proj skipped)."""
    head = make_head(tiny, seed=4, variant="pad")
    drafter = drafter_for(tiny, head, True, depth=3, topk=2, tree_size=6)
    run_ = drafter.runner
    calls = []
    forward = run_.forward

    def spy(tokens, features, *a, **kw):
        f, g = forward(tokens, features, *a, **kw)
        calls.append((features.clone(), None if f is None else f.clone(), g.clone()))
        return f, g

    run_.forward = spy
    prompt = [5, 17, 33, 2, 9]  # + the root token 7; the prompt's target features: any will do here
    ctx = DecodeContext(prompt + [7], SamplingParams(), None, len(prompt), torch.randn(len(prompt), 64))
    drafter.begin(ctx)
    assert not calls  # the prompt's rows are queued
    drafter.sync(ctx)  # and read as propose() first would
    ((_, f0, g0),) = calls
    assert not torch.allclose(f0, g0)
    torch.testing.assert_close(drafter.last_hidden, f0[-1])
    torch.testing.assert_close(drafter.root_logits, run_.logits(g0[-1:])[0])
    drafter.propose(ctx)
    assert len(calls) == 3  # the root, then depths 1 and 2 (depth 3's children are never expanded)
    assert calls[1][1] is not None and calls[2][1] is None  # the last depth's f is skipped
    outs_f = torch.cat([f0[-1:], calls[1][1]])
    outs_g = torch.cat([g0[-1:]] + [c[2] for c in calls[1:]])
    for feats_in, _, _ in calls[1:]:
        for row in feats_in:  # every input feature is some earlier row's f, never an f̃
            assert (outs_f == row).all(-1).any() and not (outs_g == row).all(-1).any()


@pytest.mark.parametrize("variant", ["pad", "fspad"])
def test_a_step_without_its_feature_gives_the_same_logits_input(tiny, variant):
    """feature=False (a tree's last depth) computes f̃ from f̃'s half of PAD's down_proj alone: the same f̃."""
    head = make_head(tiny, seed=5, variant=variant, draft_vocab=list(range(0, 97, 2)))
    with torch.no_grad():  # a random PAD head starts with both halves alike: make them differ
        head.layers[-1].mlp.down_proj.weight[64:].normal_(0, 0.05)
    run_ = drafter_for(tiny, head, True).runner
    tokens, feats = torch.tensor([3, 8, 1, 40]), torch.randn(4, 64)
    f, g = run_.forward(tokens, feats, draft=True)
    run_.rollback()
    none, g2 = run_.forward(tokens, feats, draft=True, feature=False)
    run_.rollback()
    assert none is None and not torch.allclose(f, g)
    torch.testing.assert_close(g2, g, rtol=1e-5, atol=1e-5)


def test_fspad_warm_started_from_an_eagle_head_keeps_what_the_eagle_head_learned(tiny, tiny_data, trained, tmp_path):
    """--init-from an EAGLE head with --connector sampler --pad: the decoder layer and LM head come over
    unchanged; PAD's doubled down_proj writes the old MLP output twice (f = f̃ = the EAGLE output); the new
    sampler starts at η = f. Removing an option is refused."""
    eagle = load_head(trained[1] / "head", 64, 97)
    pad = eagle.with_variant("fc", True).eval()
    torch.manual_seed(0)
    e, f = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    with torch.no_grad():
        ref = eagle.eval()(e, f)[0]
        f_hat, f_tilde = pad(e, f)
    assert torch.equal(f_hat, ref) and torch.equal(f_tilde, ref)
    fspad = eagle.with_variant("sampler", True, 80)
    assert (fspad.connector, fspad.pad, fspad.sampler_size) == ("sampler", True, 80)
    with torch.no_grad():
        assert torch.equal(fspad.sampler(e, f), f)
    old, new = eagle.state_dict(), fspad.state_dict()
    for k, v in old.items():
        if k.startswith("layers.") and "mlp.down_proj" not in k:
            assert torch.equal(new[k], v), k
    assert not any(k.startswith("fc.") for k in new)
    with pytest.raises(SpecdecError, match="only FSPAD's options can be added"):
        fspad.with_variant("fc", False)

    # through the trainer: at zero learning rate the warm-started FSPAD head is exactly the converted one
    run = train_eagle(TrainConfig(data=str(tiny_data),
                                  out=str(tmp_path / "w"), steps=2, batch_size=4, lr=0.0, warmup=0,
                                  init_from=str(trained[1] / "head"), connector="sampler", pad=True,
                                  sampler_size=80, log_every=1), tiny, progress=False)
    got = run["head"].state_dict()
    for k, v in new.items():
        if "sampler" not in k or "down_proj" in k:  # gate/up are freshly initialised
            assert torch.equal(got[k], v), k
    assert load_head(tmp_path / "w" / "head", 64, 97).connector == "sampler"

