"""Self-distillation data: shards, resume, and the benchmark-prompt exclusion."""

import json

import pytest
import torch

from specdec.errors import SpecdecError
from tests.helpers import tiny_model

# ---- data generation ----

@pytest.mark.slow
def test_datagen_shards_resume_and_benchmark_exclusion(tmp_path, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    from specdec.files import packaged_data_dir
    from specdec.training.datagen import Plan, benchmark_prompts, is_benchmark, list_shards, run_datagen
    from specdec.training.prompts import BenchmarkMatcher

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    model = tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    bench = benchmark_prompts(packaged_data_dir())
    assert len(bench) >= 480 + 1319  # Spec-Bench turns (MT-bench included) and GSM8K test
    q = json.loads((packaged_data_dir() / "spec_bench" / "question.jsonl").read_text().splitlines()[3])["turns"][0]
    assert is_benchmark(q, bench) and is_benchmark("  " + q.upper() + " ", bench)
    assert not is_benchmark("What is 2 + 2?", bench)
    q = " ".join(q.split())  # copies either way of 40 characters or more: a benchmark prompt all the same
    matcher = BenchmarkMatcher(bench)  # datagen's, for many texts: the same answers
    for text, want in (("Answer this: " + q, True), (q[5:50], True), (q.upper(), True), ("What is 2 + 2?", False),
                       (q[5:35], False)):  # the last too short to be more than a coincidence
        assert is_benchmark(text, bench) == matcher(text) == want, text
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
    from specdec.training.shards import ShardData

    both = ShardData(f"{out},{out}")  # several datagen dirs at once
    assert len(both) == 2 * len(ShardData(str(out))) and len(both.names) == 6
    with pytest.raises(SpecdecError, match="data directory not found: .*nowhere"):
        ShardData(f"{out},{out}/nowhere")  # a missing dir is an error, not silently less data
    with pytest.raises(SpecdecError, match="different target, plan or --tokens-only"):
        run_datagen(model, tok, out, 3, Plan(shard_size=8), batch_size=4, progress=False)
    with pytest.raises(SpecdecError, match="different target, plan or --tokens-only"):
        run_datagen(model, tok, out, 3, plan, batch_size=4, progress=False, tokens_only=True)
    # EAGLE-3's features: the hidden states entering layers 2, L/2, L-3, stored beside f_t
    aux_dir = tmp_path / "aux"
    run_datagen(model, tok, aux_dir, 1, Plan(shard_size=2, sources=["gsm8k"], max_new_tokens=4,
                                            aux_layers="eagle3"), batch_size=2, progress=False)
    from specdec.training.datagen import eagle3_layers

    layers = json.loads((aux_dir / "meta.json").read_text())["aux_layers"]
    assert layers == eagle3_layers(model.config.num_hidden_layers)
    with safe_open(str(aux_dir / "shard-00000.safetensors"), "pt") as f:
        feats, aux = f.get_tensor("features"), f.get_tensor("aux_features")
    assert feats.shape[1] == 64 and aux.shape == (feats.shape[0], 64 * len(layers)) and aux.dtype == torch.float16


@pytest.mark.slow
def test_tokens_only_shards_train_on_the_features_the_stored_ones_hold(tmp_path, smollm2_tokenizer_dir):
    """datagen --tokens-only keeps token ids alone (a few bytes a token); training computes each batch's features
    from the target (online): the same tokens as a run that stores features, and bit for bit the same features."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from specdec.runtime.lean import LeanRunner
    from specdec.training.datagen import Plan, eagle3_layers, run_datagen
    from specdec.training.features import runner_features
    from specdec.training.shards import ShardData, tokens_only
    from specdec.training.train import TrainConfig, train_eagle

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    model = tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id).eval()
    plan = Plan(shard_size=4, sources=["gsm8k", "self"], temperatures=[1.0], max_new_tokens=8, self_prompt_tokens=8,
                aux_layers="eagle3")
    stored, ids_only = tmp_path / "stored", tmp_path / "ids"
    run_datagen(model, tok, stored, 2, plan, batch_size=3, progress=False, feature_dtype="float32")
    run_datagen(model, tok, ids_only, 2, plan, batch_size=3, progress=False, tokens_only=True)
    assert tokens_only(ids_only) and not tokens_only(stored) and tokens_only(f"{stored},{ids_only}")
    with safe_open(str(ids_only / "shard-00000.safetensors"), "pt") as f:
        assert set(f.keys()) == {"input_ids", "loss_mask", "offsets"}
    with pytest.raises(SpecdecError, match="token ids only"):
        ShardData(str(ids_only), aux=True)  # nothing to compute them with: one clear line
    aux = tuple(eagle3_layers(model.config.num_hidden_layers))
    runner = LeanRunner(model, exact=True)
    a = ShardData(str(stored), aux=True)
    b = ShardData(str(ids_only), aux=True, features=lambda seqs: runner_features(runner, seqs, aux))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and a.spans == b.spans  # sampled, seeded
    assert (a.hidden_size, a.aux_width, a.aux_layers) == (b.hidden_size, b.aux_width, b.aux_layers)
    idx = list(range(len(a)))
    for x, y in zip(a.batch(idx), b.batch(idx)):
        assert torch.equal(x, y)
    # the CLI on the token ids trains as the library does on the stored features (the target loaded from its dir)
    r = train_eagle(TrainConfig(data=str(stored), out=str(tmp_path / "run"), steps=3, batch_size=2, warmup=0,
                                arch="eagle3", log_every=1), model, progress=False)
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    from specdec.cli import main

    assert main(["train", "eagle3", "--model", str(tmp_path / "target"), "--data", str(ids_only), "--out",
                 str(tmp_path / "cli"), "--steps", "3", "--batch-size", "2", "--warmup", "0", "--log-every", "1"]) == 0
    cli = [json.loads(x)["loss"] for x in (tmp_path / "cli" / "log.jsonl").read_text().splitlines()]
    assert len(cli) == 3 and cli == pytest.approx([h["loss"] for h in r["history"]], rel=1e-5)


def test_feature_cache_computes_each_sequence_once_and_returns_its_bits(tmp_path):
    """FeatureCache: a sequence's features computed once, then read back bit for bit without the target; another
    target or other ids miss; a damaged file is computed again."""
    from specdec.runtime.lean import LeanRunner
    from specdec.training.features import FeatureCache, runner_features

    model = tiny_model("llama").eval()
    runner = LeanRunner(model, exact=True)
    calls = []

    def features(seqs):
        calls.append(len(seqs))
        return runner_features(runner, seqs, (1,))

    seqs = [[1, 2, 3, 4, 5], [7, 8, 9], [1, 2, 3, 4]]  # the third a prefix of the first: its own entry
    cache = FeatureCache(tmp_path / "c", {"target": "a"}, features)
    first = cache(seqs)
    assert calls == [3] and len(list((tmp_path / "c").rglob("*.safetensors"))) == 3
    again = cache([seqs[1], seqs[0]])
    assert calls == [3] and torch.equal(again[0], first[1]) and torch.equal(again[1], first[0])
    assert all(torch.equal(x, y) for x, y in zip(first, features(seqs)))  # as computed: fp32, bit for bit
    calls.clear()
    cache.path(seqs[1]).write_bytes(b"torn")
    assert torch.equal(cache([seqs[1]])[0], first[1]) and calls == [1]
    other = FeatureCache(tmp_path / "c", {"target": "b"}, features)
    other([seqs[0]])
    assert calls == [1, 1] and (cache.hits, cache.misses, other.misses) == (2, 4, 1)


def test_train_feature_cache_flag(tmp_path, smollm2_tokenizer_dir, monkeypatch, capsys):
    """train --feature-cache: the same losses as without it, and a second run computes no target features;
    on data that stores its features, one clear line before the target loads."""
    from transformers import AutoTokenizer

    from specdec.cli import main
    from specdec.training.datagen import Plan, run_datagen

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    model = tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id).eval()
    plan = Plan(shard_size=4, sources=["gsm8k"], temperatures=[0.0], max_new_tokens=8, aux_layers="eagle3")
    ids_only, stored = tmp_path / "ids", tmp_path / "stored"
    run_datagen(model, tok, ids_only, 1, plan, batch_size=2, progress=False, tokens_only=True)
    run_datagen(model, tok, stored, 1, plan, batch_size=2, progress=False)
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    base = ["train", "eagle3", "--model", str(tmp_path / "target"), "--steps", "2", "--batch-size", "2",
            "--warmup", "0", "--log-every", "1"]

    def losses(out: str, *extra: str) -> list[float]:
        assert main([*base, "--data", str(ids_only), "--out", str(tmp_path / out), *extra]) == 0
        return [json.loads(x)["loss"] for x in (tmp_path / out / "log.jsonl").read_text().splitlines()]

    plain = losses("plain")
    cache = tmp_path / "features"
    assert losses("cached", "--feature-cache", str(cache)) == plain
    kept = sorted(cache.rglob("*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in kept]
    assert kept and losses("again", "--feature-cache", str(cache)) == plain
    assert sorted(cache.rglob("*.safetensors")) == kept and [p.stat().st_mtime_ns for p in kept] == stamps
    import specdec.training.train_cli as cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the target loaded"))
    monkeypatch.setattr(cli, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    capsys.readouterr()
    assert main([*base, "--data", str(stored), "--out", str(tmp_path / "x"), "--feature-cache", str(cache)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--feature-cache" in err[0] and "hold their features already" in err[0]


def test_self_code_prompts_begin_with_a_programming_opening(smollm2_tokenizer_dir):
    """Source self-code: the target's own user turns, each begun with one of CODE_OPENINGS in turn (what it writes
    after the opening is the prompt's rest); a benchmark prompt is still dropped; source self stays unprompted."""
    from transformers import AutoTokenizer

    from specdec.training.datagen import Plan, source_list
    from specdec.training.prompts import CODE_OPENINGS, PromptSource

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    seen = []

    def maker(prefixes, max_new, temperature, eos, pad, top_p=1.0, seed=0, features=True):
        seen.append([tok.decode(p) for p in prefixes])
        outs = [tok(f" sorts a list of {len(seen)}-{j} numbers in place", add_special_tokens=False)["input_ids"]
                for j in range(len(prefixes))]
        outs[1] = tok(" x", add_special_tokens=False)["input_ids"]  # too short to be a request: dropped
        return outs, None

    plan = Plan(shard_size=10, sources=source_list("self-code,self"))
    src = PromptSource(maker, tok, plan, None, {"write a python function that sorts a list of 1-0 numbers in place"},
                       batch_size=4)
    got = src.self_prompts(0, {tok.eos_token_id}, 0, CODE_OPENINGS)
    assert len(got) == 10 and len(set(got)) == 10
    assert all(any(g.startswith(o.strip()) for o in CODE_OPENINGS) for g in got)
    assert {g.split(" sorts")[0].strip() for g in got} >= {o.strip() for o in CODE_OPENINGS[:4]}
    assert not any("1-0 " in g or "1-1 " in g for g in got)  # the benchmark prompt, and the short one
    assert all(p.startswith(src.user_prefix) for p in seen[0]) and len(set(seen[0])) > 1
    seen.clear()
    plain = src.self_prompts(0, {tok.eos_token_id}, 0)
    assert len(set(seen[0])) == 1 and plain[0].startswith("sorts a list")
