"""Medusa-2 (`specdec train medusa --joint`): the joint loss falls, the backbone trains only after the heads'
warm-up and slower than them, the merged new target and its heads load and decode losslessly, drift, exact
resume, --full-finetune, the CLI."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specdec.api import from_models
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.heads.medusa_io import load_medusa
from specdec.heads.shipped import target_fingerprint
from specdec.sampling import SamplingParams
from specdec.training.medusa import MedusaTrainConfig, train_medusa
from specdec.training.medusa_joint import NewFeatures, drift, trainable_backbone
from specdec.training.medusa_objective import head_accuracies, held_in
from specdec.training.shards import ShardData
from tests.helpers import PROMPTS, run, word_tokenizer

KW = dict(batch_size=8, lr=3e-2, warmup=2, backbone_lr=1e-3, num_heads=3, joint=True)


@pytest.fixture(scope="module")
def joint_run(tiny, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa2")
    cfg = MedusaTrainConfig(data=str(tiny_data), out=str(out), steps=40, heads_warmup=10, save_every=1000,
                            log_every=5, **KW)
    return train_medusa(cfg, tiny, progress=False), out


def load_new(out):
    return AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()


def ckpt(out, step):
    return torch.load(out / "checkpoints" / f"step-{step:07d}" / "state.pt", weights_only=False)


def test_joint_loss_falls_and_the_backbone_moves_only_after_the_heads_warmup(joint_run, tiny):
    r, out = joint_run
    hist = r["history"]
    assert [h["step"] for h in hist] == list(range(5, 45, 5))
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.05
    assert hist[-1]["top1_acc_by_head"][0] > hist[0]["top1_acc_by_head"][0]
    assert [h["kl"] for h in hist[:2]] == [0.0, 0.0] and all(h["kl"] > 0 for h in hist[2:])  # warm-up: 10 steps
    assert all(h["lm_top1_agreement"] < 1 for h in hist[2:])
    # the original target is untouched: no adapters, no gradients
    assert not any("lora" in n for n, _ in tiny.named_parameters()) and all(p.grad is None for p in tiny.parameters())


def test_the_saved_target_is_merged_and_loads_with_its_heads(joint_run, tiny, tiny_data):
    r, out = joint_run
    new = load_new(out)
    keys = set(load_file(str(out / "target" / "model.safetensors")))
    assert keys == set(tiny.state_dict()) and not any("lora" in k for k in keys)  # LoRA merged
    assert not (out / "target" / "adapter_config.json").exists()
    orig, got = tiny.state_dict(), new.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(orig[q], got[q])
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):  # LoRA leaves these alone
        assert torch.equal(orig[k], got[k]), k
    for k in orig:  # the merged weights are what was trained: the in-memory model's
        assert torch.equal(got[k], r["model"].state_dict()[k]), k
    heads = load_medusa(out / "heads", 64, 97, target_lm_head=new.lm_head.weight)
    meta = heads.meta
    assert meta["kind"] == "medusa-2" and meta["lossless_relative_to"] == str((out / "target").resolve())
    assert meta["target"] == target_fingerprint(new) and meta["original_target"] == target_fingerprint(tiny)
    assert meta["training"]["heads_warmup"] == 10 and meta["training"]["backbone"].startswith("lora r=16")
    # the accuracies are the heads' against the NEW target, on its own features
    data = ShardData(str(tiny_data))
    want, _ = head_accuracies(heads, NewFeatures(data, new), held_in(len(data), 0), new.lm_head.weight.detach())
    assert meta["accuracies"] == r["accuracies"] == want and len(want) == 3
    d = meta["drift"]
    assert d == r["drift"] and d["tokens"] == 16 * 32 and 0 < d["greedy_agreement"] < 1 and d["kl_per_token"] > 0


def test_decoding_with_the_new_target_and_its_heads_is_lossless(joint_run):
    _, out = joint_run
    new = load_new(out)
    medusa = from_models(new, None, "medusa", heads=str(out / "heads"), tree_size=6)
    vanilla = from_models(new, None, "vanilla")
    for prompt in PROMPTS:
        want, _ = run(vanilla.runner, vanilla.drafter, prompt, SamplingParams(), 24)
        got, stats = run(medusa.runner, medusa.drafter, prompt, SamplingParams(), 24)
        assert got == want and stats.acceptance == "lossless"


def test_drift_of_an_unchanged_model_is_full_agreement_and_zero_kl(tiny):
    prompts = [[5, 17, 33], [88, 2], list(range(10, 30))]
    same = drift(tiny, copy.deepcopy(tiny), prompts, 8)
    assert same == {"greedy_agreement": 1.0, "kl_per_token": 0.0, "prompts": 3, "tokens": 24}
    other = copy.deepcopy(tiny)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    moved = drift(tiny, other, prompts, 8)
    assert moved["kl_per_token"] > 0 and moved["greedy_agreement"] <= 1
    with pytest.raises(SpecdecError):
        drift(tiny, other, [[]], 8)


def test_warmup_freezes_the_backbone_and_its_lr_is_below_the_heads(tiny, tiny_data, tmp_path):
    cfg = MedusaTrainConfig(data=str(tiny_data), out=str(tmp_path), steps=4, heads_warmup=2, save_every=1,
                            keep_checkpoints=10, **(KW | {"warmup": 0}))
    train_medusa(cfg, tiny, progress=False)
    init = {f"backbone.{n}": p.detach() for n, p in trainable_backbone(tiny, cfg)[0].named_parameters()
            if p.requires_grad}
    states = [ckpt(tmp_path, s) for s in range(1, 5)]
    for st in states:
        assert {k for k in st["model"] if k.startswith("backbone.")} == set(init)
        assert all("lora_" in k for k in init)
    for st in states[:2]:  # heads' warm-up: the heads learn, the backbone does not move
        assert all(torch.equal(st["model"][k], v) for k, v in init.items())
        assert st["model"]["heads.blocks.0.layers.0.weight"].abs().sum() > 0
    assert any(not torch.equal(states[2]["model"][k], v) for k, v in init.items())
    heads_g, bb_g = (st["optimizer"]["param_groups"] for st in (states[0], states[3]))
    assert heads_g[0]["initial_lr"] == 3e-2 and heads_g[1]["initial_lr"] == 1e-3
    assert heads_g[1]["lr"] == 0.0 < heads_g[0]["lr"]  # during the warm-up
    assert 0 < bb_g[1]["lr"] < bb_g[0]["lr"]
    default = MedusaTrainConfig(data="d", out="o", joint=True)
    assert default.backbone_lr == 0 and (default.lambda0, default.heads_warmup) == (0.2, -1)  # 0: lr / 4
    with pytest.raises(SpecdecError, match="--heads-warmup 4 leaves none of the run's 4 steps"):
        train_medusa(MedusaTrainConfig(data=str(tiny_data), out=str(tmp_path / "w"), steps=4, heads_warmup=4, **KW),
                     tiny, progress=False)
    with pytest.raises(SpecdecError, match="--full-finetune .* needs --joint"):
        MedusaTrainConfig(data="d", out="o", full_finetune=True).check()


def test_resume_after_interruption_equals_uninterrupted_run(tiny, tiny_data, tmp_path):
    kw = dict(data=str(tiny_data), steps=6, heads_warmup=2, save_every=2, log_every=2, draft_vocab=40,
              lm_head="own", **KW)
    full = train_medusa(MedusaTrainConfig(out=str(tmp_path / "a"), **kw), tiny, progress=False)
    part = train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), stop_after=3, **kw), tiny, progress=False)
    assert part["steps"] == 3 and part["target"] is None and not (tmp_path / "b" / "target").exists()
    rest = train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), **kw), tiny, progress=False)
    assert rest["steps"] == 6
    a, b = full["heads"].state_dict(), rest["heads"].state_dict()
    assert a.keys() == b.keys() and "d2t" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ta, tb = (load_file(str(tmp_path / d / "target" / "model.safetensors")) for d in "ab")
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    la, lb = ([json.loads(x) for x in (tmp_path / d / "log.jsonl").read_text().splitlines()] for d in "ab")
    assert [x["step"] for x in lb] == [2, 4, 6]
    for key in ("loss", "kl", "ce_by_head"):
        assert [x[key] for x in la] == [x[key] for x in lb], key
    assert full["accuracies"] == rest["accuracies"] and full["drift"] == rest["drift"]
    again = train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), **kw), tiny, progress=False)
    assert again["finished"] and again["drift"] == rest["drift"] and again["target"] == str(tmp_path / "b" / "target")
    # other settings, or a Medusa-1 run over a Medusa-2 one, are refused in one line
    for change, msg in (({"lora_rank": 8}, "lora_rank=16, not 8"), ({"joint": False}, "joint=True, not False"),
                        ({"lambda0": 0.5}, "lambda0=0.2, not 0.5")):
        with pytest.raises(SpecdecError, match=msg) as e:
            train_medusa(MedusaTrainConfig(out=str(tmp_path / "b"), **(kw | change)), tiny, progress=False)
        assert "\n" not in str(e.value)


def test_recomputed_activations_change_nothing(tiny, tiny_data, tmp_path):
    runs = [train_medusa(MedusaTrainConfig(data=str(tiny_data), out=str(tmp_path / str(keep)), steps=3, heads_warmup=1,
                                           log_every=1, keep_activations=keep, **KW), tiny, progress=False)
            for keep in (False, True)]
    a, b = ([h["loss"] for h in r["history"]] for r in runs)
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    ta, tb = (load_file(str(tmp_path / d / "target" / "model.safetensors")) for d in ("False", "True"))
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k])


def test_full_finetune(tiny, tiny_data, tmp_path):
    cfg = MedusaTrainConfig(data=str(tiny_data), out=str(tmp_path), steps=4, heads_warmup=1, full_finetune=True,
                            save_every=1, keep_checkpoints=4, **KW)
    r = train_medusa(cfg, tiny, progress=False)
    orig = tiny.state_dict()
    st = ckpt(tmp_path, 4)["model"]
    assert {k.removeprefix("backbone.") for k in st if k.startswith("backbone.")} == set(orig)
    warm = ckpt(tmp_path, 1)["model"]  # the heads' warm-up: not even the LM head they share moves
    assert all(torch.equal(warm[f"backbone.{k}"], v) for k, v in orig.items())
    new = load_new(tmp_path)
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
        assert not torch.equal(orig[k], new.state_dict()[k]), k  # every weight trains
    heads = load_medusa(tmp_path / "heads", 64, 97)
    assert heads.meta["training"]["backbone"] == "full" and heads.meta["kind"] == "medusa-2"
    assert heads.meta["target"] == target_fingerprint(new) != heads.meta["original_target"]
    assert r["drift"]["kl_per_token"] > 0


def test_cli_joint(tiny, tiny_data, tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny.save_pretrained(model_dir)
    word_tokenizer(["a", "b"]).save_pretrained(model_dir)
    args = ["train", "medusa", "--joint", "--model", str(model_dir), "--data", str(tiny_data), "--out",
            str(tmp_path / "run"), "--steps", "3", "--batch-size", "4", "--num-heads", "2", "--lora-rank", "4"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("train medusa --joint: step 3/3")
    assert "drift from the original: greedy agreement" in printed
    assert printed.count("\n") == 1 and str(tmp_path / "run" / "target") in printed
    target = tmp_path / "run" / "target"
    assert (target / "tokenizer.json").is_file() and (target / "config.json").is_file()
    raw = json.loads((tmp_path / "run" / "heads" / "config.json").read_text())["specdec"]
    assert raw["kind"] == "medusa-2" and raw["training"]["backbone"] == "lora r=4 alpha=32.0"
    assert raw["training"]["heads_warmup"] == 0  # a quarter of 3 steps
    assert main(args) == 0
    assert "already finished (step 3/3)" in capsys.readouterr().out


def test_lora_on_the_last_layers_leaves_the_ones_below_as_they_were(tiny, tiny_data, tmp_path):
    """--lora-layers N: adapters on the last N decoder layers only; the layers below run without a graph
    (nothing of theirs trains) and the merged target keeps their weights bit for bit."""
    cfg = MedusaTrainConfig(data=str(tiny_data), out=str(tmp_path / "r"), steps=6, heads_warmup=2, lora_layers=1,
                            save_every=1000, **KW)
    model, _ = trainable_backbone(tiny, cfg)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("model.layers.1.") and "lora_" in n for n in trained)
    r = train_medusa(cfg, tiny, progress=False)
    got, orig = load_new(tmp_path / "r").state_dict(), tiny.state_dict()
    for k in orig:
        assert torch.equal(got[k], orig[k]) == (not k.startswith("model.layers.1.") or "norm" in k), k
    assert r["drift"]["kl_per_token"] > 0
    meta = json.loads((tmp_path / "r" / "heads" / "config.json").read_text())["specdec"]
    assert meta["training"]["backbone"] == "lora r=16 alpha=32.0 last 1 layers"
    for bad, msg in (({"lora_layers": 3}, "--lora-layers 3: the target has 2 decoder layers"),
                     ({"lora_layers": 1, "full_finetune": True}, "--lora-layers limits")):
        with pytest.raises(SpecdecError, match=msg):
            train_medusa(MedusaTrainConfig(data=str(tiny_data), out=str(tmp_path / "b"), steps=4, **(KW | bad)),
                         tiny, progress=False)
