"""EAGLE head, EAGLE-1/2 drafting (lossless at T = 0 and T > 0), data generation and training."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.drafters.base import NoDrafter
from specdec.drafters.eagle import EagleDrafter, build_static_tree
from specdec.errors import SpecdecError
from specdec.heads.io import load_head, save_head
from specdec.heads.model import EagleHead, head_config
from specdec.heads.runner import HeadRunner
from specdec.sampling import SamplingParams
from specdec.target.lean import LeanRunner
from specdec.training.datagen import generate_answers, pack_shard, teacher_force, write_shard
from specdec.training.train import TrainConfig, build_draft_vocab, train_eagle
from tests.conftest import tiny_model
from tests.test_engine import PROMPTS, SMALL_V, exact_first3, run, sample_first3
from tests.test_verify import chi2_pvalue

ROOT = Path(__file__).resolve().parents[1]


def make_head(model, seed=0, draft_vocab=None, layers=1):
    torch.manual_seed(seed)
    head = EagleHead(head_config(model.config, num_hidden_layers=layers)).eval()
    if draft_vocab is not None:
        head.set_draft_vocab(torch.tensor(draft_vocab), model.lm_head.weight.detach())
    return head


def drafter_for(model, head, dynamic, **kw):
    emb, lm = model.get_input_embeddings().weight, model.lm_head.weight
    return EagleDrafter(HeadRunner(head, emb, lm), dynamic, **kw)


def make_data(model, out: Path, n_seq=96, answer_len=32, seed=0):
    """Self-distillation shards for a tiny model (no tokenizer: random token prompts)."""
    g = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    v = model.config.vocab_size
    for shard in range(2):
        prompts = [torch.randint(3, v, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n_seq // 2)]
        answers = generate_answers(model, prompts, answer_len, 1.0 if shard else 0.0, {model.config.vocab_size - 1}, 0)
        seqs = [p + a for p, a in zip(prompts, answers)]
        t = pack_shard(seqs, [len(p) for p in prompts], teacher_force(model, seqs))
        write_shard(out / f"shard-{shard:05d}.safetensors", t, {"source": "test"})


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tiny_data(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    make_data(tiny, d)
    return d


@pytest.fixture(scope="module")
def trained(tiny, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(data=str(tiny_data), out=str(out), steps=100, batch_size=8, lr=3e-2, warmup=5,
                      save_every=1000, log_every=10)
    r = train_eagle(cfg, tiny, progress=False)
    return r, out


# ---- the head ----

@pytest.mark.parametrize("layers", [1, 2])
def test_head_forward_shapes_and_lean_runner_matches(tiny, layers):
    head = make_head(tiny, layers=layers)
    emb, lm = tiny.get_input_embeddings().weight, tiny.lm_head.weight
    toks, f = torch.randint(0, 97, (2, 10)), torch.randn(2, 10, 64)
    with torch.no_grad():
        out = head(emb[toks], f)
        assert out.shape == (2, 10, 64)
        assert head.logits(out, lm).shape == (2, 10, 97)
    r = HeadRunner(head, emb, lm)
    h1 = r.forward(toks[0, :4], f[0, :4])
    r.commit(range(4))
    h2 = r.forward(toks[0, 4:], f[0, 4:])
    torch.testing.assert_close(torch.cat([h1, h2]), out[0], atol=1e-5, rtol=1e-5)
    # tree rows see only their ancestors: two siblings at the same position equal two separate chains
    r.rollback()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 5] = mask[1, 4] = False
    sib = r.forward(toks[1, :2], f[1, :2], torch.tensor([4, 4]), mask)
    for j in range(2):
        with torch.no_grad():
            ref = head(emb[torch.cat([toks[0, :4], toks[1, j:j + 1]])][None],
                       torch.cat([f[0, :4], f[1, j:j + 1]])[None])[0, -1]
        torch.testing.assert_close(sib[j], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_runner_keeps_only_the_accepted_tree_path_in_every_layer(tiny, layers):
    """After verification the drafter commits a path of tree rows (not contiguous): every layer's cache
    must then hold exactly what a plain forward over the accepted sequence would."""
    head = make_head(tiny, seed=2, layers=layers)
    emb, lm = tiny.get_input_embeddings().weight, tiny.lm_head.weight
    toks, f = torch.randint(0, 97, (12,)), torch.randn(12, 64)
    r = HeadRunner(head, emb, lm)
    r.forward(toks[:4], f[:4])
    r.commit(range(4))
    parents, depth = [-1, -1, 0, 1, 1, 2], [0, 0, 1, 1, 1, 2]  # the path 0 -> 2 -> 5 gets accepted
    mask = torch.zeros(6, 10, dtype=torch.bool)
    mask[:, :4] = True
    for i in range(6):
        j = i
        while j >= 0:
            mask[i, 4 + j] = True
            j = parents[j]
    tree_out = r.forward(toks[4:10], f[4:10], torch.tensor(depth) + 4, mask)
    r.commit([0, 2, 5])
    after = r.forward(toks[10:12], f[10:12])
    kept = torch.tensor([0, 1, 2, 3, 4, 6, 9, 10, 11])
    with torch.no_grad():
        ref = head(emb[toks[kept]][None], f[kept][None])[0]
    torch.testing.assert_close(tree_out[[0, 2, 5]], ref[4:7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, ref[7:], atol=1e-5, rtol=1e-5)


def test_reduced_vocab_maps_draft_ids_to_target_ids(tiny, tmp_path):
    ids = [90, 3, 17, 5, 60]
    head = make_head(tiny, draft_vocab=ids)
    assert head.d2t.tolist() == sorted(ids)
    r = HeadRunner(head, tiny.get_input_embeddings().weight)
    h = r.forward(torch.tensor([1, 2]), torch.randn(2, 64))
    logits = r.logits(h)
    assert logits.shape == (2, 5)
    # the reduced head starts as the target's rows: same scores for those tokens
    torch.testing.assert_close(logits, (h @ tiny.lm_head.weight.detach().T)[:, sorted(ids)], atol=1e-4, rtol=1e-4)
    assert r.to_target(torch.tensor([0, 4])).tolist() == [3, 90]
    save_head(head, tmp_path / "h")
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert (sd["d2t"] + torch.arange(5)).tolist() == sorted(ids)  # EAGLE-3 convention: offsets
    assert sd["t2d"].sum() == 5 and bool(sd["t2d"][90])
    assert "layers.0.input_layernorm.weight" not in sd and sd["fc.weight"].shape == (64, 128)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    back = load_head(tmp_path / "h", hidden_size=64, vocab_size=97)
    assert back.d2t.tolist() == sorted(ids)
    for k, t in head.state_dict().items():
        assert torch.equal(t, back.state_dict()[k]), k
    # shipped small: fp16, rows taken from the target through d2t (they are still the target's rows here)
    save_head(head, tmp_path / "small", dtype=torch.float16, lm_head=False)
    sd = load_file(str(tmp_path / "small" / "model.safetensors"))
    assert "lm_head.weight" not in sd and sd["fc.weight"].dtype == torch.float16
    with pytest.raises(SpecdecError, match="takes its LM head rows from the target"):
        load_head(tmp_path / "small", 64, 97)
    small = load_head(tmp_path / "small", 64, 97, target_lm_head=tiny.lm_head.weight)
    torch.testing.assert_close(small.lm_head.weight, head.lm_head.weight)
    torch.testing.assert_close(small.fc.weight, head.fc.weight, atol=1e-3, rtol=1e-3)
    assert build_draft_vocab(torch.tensor([5, 0, 9, 9, 1]), 3).tolist() == [0, 2, 3]
    assert build_draft_vocab(torch.tensor([5, 0, 9, 9, 1]), 3, always={1}).tolist() == [1, 2, 3]


def test_corrupt_or_mismatched_head_is_a_clear_error(tiny, tmp_path):
    from specdec.api import from_models

    save_head(make_head(tiny), tmp_path / "ok")
    with pytest.raises(SpecdecError, match="hidden size 64 but the target has 128"):
        load_head(tmp_path / "ok", hidden_size=128, vocab_size=97)
    with pytest.raises(SpecdecError, match="vocabulary of 97 tokens but the target has 200"):
        load_head(tmp_path / "ok", hidden_size=64, vocab_size=200)
    other = tiny_model("llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(SpecdecError, match="hidden size 64 but the target has 32"):
        from_models(other, None, "eagle2", head=str(tmp_path / "ok"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    data = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(SpecdecError, match="damaged"):
        load_head(bad, 64, 97)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(SpecdecError, match="not a valid LlamaConfig"):
        load_head(bad, 64, 97)
    with pytest.raises(SpecdecError, match="config.json is missing"):
        load_head(tmp_path / "nothing", 64, 97)
    with pytest.raises(SpecdecError, match="needs an EAGLE head"):
        from_models(tiny, None, "eagle")


# ---- tree construction ----

def test_static_tree_follows_choices_by_rank():
    table = torch.log_softmax(torch.randn(10, 10, generator=torch.Generator().manual_seed(0)), -1)
    calls = []

    def step(sel, tokens, parents):
        calls.append(sel.tolist())
        return torch.stack([table[int(tokens[i])] for i in sel])

    root = table[0]
    tree = build_static_tree(root, step, [[1], [0], [0, 0], [0, 2], [1, 0], [0, 0, 0]])
    top = lambda row, k: int(torch.topk(row, k + 1).indices[k])  # noqa: E731
    t = tree.tokens.tolist()
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert t[0] == top(root, 0) and t[1] == top(root, 1)
    assert t[2] == top(table[t[0]], 0) and t[3] == top(table[t[0]], 2) and t[4] == top(table[t[1]], 0)
    assert t[5] == top(table[t[2]], 0)
    assert calls == [[0, 1], [2]]  # one step per depth, only nodes with children
    with pytest.raises(SpecdecError, match="needs its parent"):
        build_static_tree(root, step, [[0], [1, 0]])


# ---- losslessness ----

@pytest.mark.parametrize("dynamic", [False, True], ids=["eagle", "eagle2"])
@pytest.mark.parametrize("which", ["untrained", "trained", "trained-reduced"])
def test_eagle_greedy_equals_vanilla(tiny, trained, dynamic, which):
    if which == "untrained":
        head = make_head(tiny)
    else:
        head = trained[0]["head"]
        if which == "trained-reduced":
            head = load_head(trained[1] / "head")  # a reduced copy of the trained head
            keep = torch.arange(0, 97, 2)
            head.set_draft_vocab(keep, tiny.lm_head.weight.detach())
    target = LeanRunner(tiny)
    drafter = drafter_for(tiny, head, dynamic, **({"depth": 4, "topk": 3, "total_tokens": 8} if dynamic else {}))
    taus = []
    for prompt in PROMPTS:
        want, _ = run(target, NoDrafter(), prompt, SamplingParams(), 40)
        got, stats = run(target, drafter, prompt, SamplingParams(), 40)
        assert got == want
        taus.append(stats.tau)
    if which == "trained":  # a trained head gets drafts accepted, so the accept paths really run
        assert np.mean(taus) > 1.5


def test_eagle2_ablations_and_api_are_lossless(tiny, trained):
    from specdec.api import from_models

    head_dir = str(trained[1] / "head")
    target = LeanRunner(tiny)
    want, _ = run(target, NoDrafter(), PROMPTS[1], SamplingParams(), 30)
    for opts in ({"rank_by": "confidence"}, {"rerank": False}, {"gamma": 3, "topk": 2, "tree_tokens": 5}):
        dec = from_models(tiny, None, "eagle2", head=head_dir, **opts)
        got, _ = run(dec.runner, dec.drafter, PROMPTS[1], SamplingParams(), 30)
        assert got == want, opts
    dec = from_models(tiny, None, "eagle", head=head_dir, choices=[[0], [0, 0], [0, 0, 0]])
    got, s = run(dec.runner, dec.drafter, PROMPTS[1], SamplingParams(), 30)
    assert got == want and max(s.tree_sizes) == 3
    with pytest.raises(SpecdecError, match="unknown option"):
        from_models(tiny, None, "eagle", head=head_dir, bogus=1)


def test_full_vocab_ablation_restores_the_whole_target_head(tiny, trained, tmp_path):
    from specdec.api import from_models

    head = load_head(trained[1] / "head")
    head.set_draft_vocab(torch.arange(0, 97, 3), tiny.lm_head.weight.detach())  # target rows, as shipped
    save_head(head, tmp_path / "reduced", lm_head=False)
    target = LeanRunner(tiny)
    want, _ = run(target, NoDrafter(), PROMPTS[2], SamplingParams(), 30)
    reduced = from_models(tiny, None, "eagle2", head=str(tmp_path / "reduced"))
    full = from_models(tiny, None, "eagle2", head=str(tmp_path / "reduced"), full_vocab=True)
    assert reduced.drafter.runner.d2t is not None and full.drafter.runner.d2t is None
    h = torch.randn(2, 64)
    assert full.drafter.runner.logits(h).shape == (2, 97)
    # the reduced head's logits are exactly the full head's logits at the kept ids
    torch.testing.assert_close(reduced.drafter.runner.logits(h), full.drafter.runner.logits(h)[:, ::3])
    for dec in (reduced, full):
        got, _ = run(dec.runner, dec.drafter, PROMPTS[2], SamplingParams(), 30)
        assert got == want
    save_head(head, tmp_path / "own")  # trained-in rows: "full vocabulary" would be another model
    with pytest.raises(SpecdecError, match="full_vocab needs"):
        from_models(tiny, None, "eagle2", head=str(tmp_path / "own"), full_vocab=True)


@pytest.mark.parametrize(
    "dynamic,params", [(True, SamplingParams(1.0)), (False, SamplingParams(0.8, top_k=3))],
    ids=["eagle2-T1", "eagle-T0.8-topk3"])
def test_eagle_sampling_matches_vanilla_distribution(dynamic, params):
    model = tiny_model("llama", vocab_size=SMALL_V, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    head = make_head(model, seed=3)
    kw = {"depth": 3, "topk": 2, "total_tokens": 5} if dynamic else {"choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}
    drafter = drafter_for(model, head, dynamic, **kw)
    target = LeanRunner(model)
    prompt = [1, 3, 0, 2]
    counts, sizes = sample_first3(target, drafter, prompt, params)
    assert max(sizes) >= 4
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3


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
    one = subprocess.run([sys.executable, "-m", "specdec.cli", "train", "eagle", "--out", str(tmp_path / "one")]
                         + common, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    rec2 = [json.loads(x) for x in (tmp_path / "two" / "log.jsonl").read_text().splitlines()]
    assert rec2[0]["processes"] == 2
    l2 = [r["loss"] for r in rec2]
    l1 = [json.loads(x)["loss"] for x in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    assert len(l2) == len(l1) == 4
    np.testing.assert_allclose(l2, l1, rtol=1e-3)  # same global batches, same token-mean loss
    assert (tmp_path / "two" / "head" / "config.json").is_file()


# ---- data generation ----

def test_datagen_shards_resume_and_benchmark_exclusion(tmp_path):
    from specdec.files import shared_data_dir as default_shared_data
    from specdec.target.loading import cache_dir
    from specdec.training.datagen import Plan, benchmark_prompts, is_benchmark, list_shards, run_datagen

    conv = sorted((cache_dir() / "converted").glob("SmolLM2-135M-Instruct*"))
    gsm = default_shared_data() / "gsm8k" / "train.jsonl"
    if not conv or not gsm.is_file():
        pytest.skip("needs the converted SmolLM2 tokenizer and ../shared/data")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(conv[0])
    model = tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    bench = benchmark_prompts(default_shared_data())
    assert len(bench) >= 480  # Spec-Bench turns (MT-bench included)
    q = json.loads((default_shared_data() / "mt_bench" / "question.jsonl").read_text().splitlines()[3])["turns"][0]
    assert is_benchmark(q, bench) and is_benchmark("  " + q.upper() + " ", bench)
    assert not is_benchmark("What is 2 + 2?", bench)
    plan = Plan(shard_size=4, sources=["gsm8k", "self", "gsm8k-gold"], temperatures=[0.0, 1.0], max_new_tokens=6,
                self_prompt_tokens=8)
    out = tmp_path / "d"
    t = run_datagen(model, tok, out, 2, plan, batch_size=4, progress=False)
    assert t["shards"] == 2 and [p.name for p in list_shards(out)] == ["shard-00000.safetensors",
                                                                      "shard-00001.safetensors"]
    from safetensors import safe_open

    with safe_open(str(out / "shard-00000.safetensors"), "pt") as f:
        meta = f.metadata()
        ids, feats, mask, off = (f.get_tensor(k) for k in ("input_ids", "features", "loss_mask", "offsets"))
    assert json.loads(meta["source"]) == "gsm8k" and json.loads(meta["sequences"]) == 4
    assert feats.shape == (ids.numel(), 64) and feats.dtype == torch.float16 and off[-1] == ids.numel()
    first = tok.decode(ids[off[0]:off[1]][mask[off[0]:off[1]] == 0])
    assert "<|im_start|>user" in first and first.rstrip().endswith("<|im_start|>assistant")
    assert 0 < int(mask.sum()) <= 4 * 6
    before = (out / "shard-00000.safetensors").stat().st_mtime_ns
    t = run_datagen(model, tok, out, 3, plan, batch_size=4, progress=False)  # resume: only shard 2 is new
    assert t["shards"] == 1 and (out / "shard-00000.safetensors").stat().st_mtime_ns == before
    with safe_open(str(out / "shard-00002.safetensors"), "pt") as f:  # GSM8K's own solutions, teacher-forced
        ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
        assert json.loads(f.metadata()["source"]) == "gsm8k-gold"
    assert "The answer is" in tok.decode(ids[mask == 1]) and "<<" not in tok.decode(ids[mask == 1])
    from specdec.training.train import ShardData

    both = ShardData(f"{out},{out}")  # several datagen dirs at once
    assert len(both) == 2 * len(ShardData(str(out))) and len(both.names) == 6
    with pytest.raises(SpecdecError, match="data directory not found: .*nowhere"):
        ShardData(f"{out},{out}/nowhere")  # a missing dir is an error, not silently less data
    with pytest.raises(SpecdecError, match="different target or plan"):
        run_datagen(model, tok, out, 3, Plan(shard_size=8), batch_size=4, progress=False)


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
    torch.testing.assert_close(HeadRunner(grown, emb, lm).forward(toks[0], f[0]), base(emb[toks], f)[0],
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

@pytest.mark.parametrize("layers", [1, 2])
def test_unrolled_steps_match_what_the_head_sees_when_drafting(tiny, layers):
    """Step k of `unrolled` must compute exactly draft depth k+1 of the inference runner: same inputs
    (its own previous prediction), same keys (target rows up to the accepted one plus its own path)."""
    from specdec.training.train import unrolled, unrolled_mask

    head = make_head(tiny, seed=3, layers=layers)
    emb, lm = tiny.get_input_embeddings().weight, tiny.lm_head.weight
    t, steps = 12, 3
    toks, f = torch.randint(0, 97, (1, t)), torch.randn(1, t, 64)
    with torch.no_grad():
        preds = list(unrolled(head, emb[toks], f, steps))
    assert len(preds) == steps and unrolled_mask(4, 2).sum(1).tolist() == [1, 2, 3, 4]
    for a in range(t - steps + 1):  # a = the last accepted row
        r = HeadRunner(head, emb, lm)
        out = r.forward(toks[0, : a + 1], f[0, : a + 1])
        torch.testing.assert_close(out[a], preds[0][0, a], atol=1e-4, rtol=1e-4)
        prev = out[a : a + 1]
        for k in range(1, steps):
            prev = r.forward(toks[0, a + k : a + k + 1], prev)
            torch.testing.assert_close(prev[0], preds[k][0, a + k], atol=1e-4, rtol=1e-4)


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


# ---- EAGLE + prompt lookup in one tree ----

def test_tree_union_merges_shared_prefixes_and_keeps_order():
    from specdec.tree import DraftTree

    a = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]), torch.tensor([-0.1, -2.0, -0.5]))
    b = DraftTree.chain(torch.tensor([5, 7, 9]))  # shares 5 -> 7 with a, then adds 9
    b.scores = torch.tensor([-0.3, -0.2, -0.9])
    u = a.union(b)
    assert u.tokens.tolist() == [5, 6, 7, 9] and u.parents.tolist() == [-1, -1, 0, 2]
    assert u.scores.tolist() == pytest.approx([-0.1, -2.0, -0.2, -0.9])  # shared node: the higher score
    c = DraftTree.chain(torch.tensor([8, 5]))  # 5 under 8 is a different node from the root's 5
    assert a.union(c).parents.tolist() == [-1, -1, 0, -1, 3] and a.union(c).scores is None
    assert a.union(DraftTree.chain(torch.tensor([5]))) is a
    with pytest.raises(ValueError, match="deterministic"):
        a.union(DraftTree.chain(torch.tensor([1]), torch.full((1, 4), 0.25)))


def test_eagle2_with_lookup_is_lossless_and_uses_both_drafts(tiny, trained):
    from specdec.api import from_models

    head_dir = str(trained[1] / "head")
    target = LeanRunner(tiny)
    prompt = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8]  # repeats: lookup has something to copy
    dec = from_models(tiny, None, "eagle2", head=head_dir, depth=2, topk=2, total_tokens=3, lookup=6)
    assert dec.drafter.name == "eagle2+pld"
    for p in PROMPTS + [prompt]:
        want, _ = run(target, NoDrafter(), p, SamplingParams(), 40)
        got, stats = run(dec.runner, dec.drafter, p, SamplingParams(), 40)
        assert got == want
    assert max(stats.tree_sizes) > 3  # the lookup chain went into the tree beside the head's 3 nodes
    for bad in (-1, "x", 2.5):
        with pytest.raises(SpecdecError, match="lookup"):
            from_models(tiny, None, "eagle2", head=head_dir, lookup=bad)


def test_eagle2_with_lookup_sampling_matches_vanilla_distribution():
    from specdec.drafters.prompt_lookup import PromptLookupDrafter
    from specdec.drafters.union import UnionDrafter

    model = tiny_model("llama", vocab_size=SMALL_V, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    drafter = UnionDrafter(drafter_for(model, make_head(model, seed=3), True, depth=2, topk=2, total_tokens=3),
                           PromptLookupDrafter(max_ngram=2, num_tokens=3))
    target = LeanRunner(model)
    prompt = [1, 3, 0, 2, 1, 3, 0]
    params = SamplingParams(1.0, top_p=0.9)
    counts, sizes = sample_first3(target, drafter, prompt, params)
    assert max(sizes) > 3  # lookup branches were verified too
    assert chi2_pvalue(counts, exact_first3(model, prompt, params)) > 1e-3
