"""EAGLE-3: the head (module vs lean runner), the target's aux states, lossless drafting, training, files."""

import copy
import json

import numpy as np
import pytest
import torch

from specdec.drafters.eagle import EagleDrafter
from specdec.errors import SpecdecError
from specdec.heads.io import load_head, save_head
from specdec.heads.model import Eagle3Head
from specdec.heads.runner import Eagle3Runner, runner_for
from specdec.runtime.hf import HFRunner
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.training.datagen import eagle3_layers, generate_answers, pack_shard, teacher_force, write_shard
from specdec.tree import TreeBudget
from tests.helpers import (
    PROMPTS,
    chi2_pvalue,
    exact_first3,
    flat_tiny,
    greedy_taus,
    make_head3,
    sample_first3,
    tiny_model,
)


def runner3(model, head):
    return runner_for(head, model.get_input_embeddings().weight, model.lm_head.weight)


def drafter3(model, head, depth=4, topk=3, tree_size=8, **kw):
    return EagleDrafter(runner3(model, head), TreeBudget(depth, topk, tree_size), **kw)


def make_aux_data(model, out, n_seq=64, answer_len=24, seed=0, aux=True):
    """Self-distillation shards with the hidden states entering EAGLE-3's layers (datagen --aux-layers eagle3)."""
    g = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    v, h = model.config.vocab_size, model.config.hidden_size
    layers = eagle3_layers(model.config.num_hidden_layers) if aux else []
    for shard in range(2):
        prompts = [torch.randint(3, v, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n_seq // 2)]
        answers = generate_answers(model, prompts, answer_len, 1.0 if shard else 0.0, {v - 1}, 0)
        seqs = [p + a for p, a in zip(prompts, answers)]
        t = pack_shard(seqs, [len(p) for p in prompts], teacher_force(model, seqs, aux_layers=tuple(layers)),
                       hidden_size=h, n_aux=len(layers))
        write_shard(out / f"shard-{shard:05d}.safetensors", t, {"source": "test"})
    (out / "meta.json").write_text(json.dumps({"hidden_size": h, "aux_layers": layers}))
    return out


@pytest.fixture(scope="module")
def trained3(tiny, tmp_path_factory):
    from specdec.training.train import TrainConfig, train_eagle

    data = make_aux_data(tiny, tmp_path_factory.mktemp("aux-data"))
    out = tmp_path_factory.mktemp("run3")
    cfg = TrainConfig(data=str(data), out=str(out), steps=60, batch_size=8, lr=3e-2, warmup=5, save_every=1000,
                      log_every=10, arch="eagle3", unroll=2, draft_vocab=60, intermediate_size=96)
    return train_eagle(cfg, tiny, progress=False), out, data


# ---- the head: the lean runner computes what the module does ----

@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 97, 2))], ids=["full", "reduced"])
def test_runner_matches_module_on_chains_and_trees(tiny, draft_vocab):
    head = make_head3(tiny, draft_vocab=draft_vocab)
    emb = tiny.get_input_embeddings().weight.detach()
    h = tiny.config.hidden_size
    k = len(head.aux_layers)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (6,), generator=g)
    aux = torch.randn(6, k * h, generator=g)
    # 6 committed rows, then a tree of 4 draft rows: a (depth 1), b (depth 1), a's children c, d (depth 2)
    tree_tok = torch.tensor([4, 10, 20, 30]) if draft_vocab is None else torch.tensor([2, 5, 10, 15])
    tree_target = tree_tok if draft_vocab is None else head.d2t[tree_tok]
    runner = runner3(tiny, head)
    assert isinstance(runner, Eagle3Runner) and runner.aux_layers == head.aux_layers
    with torch.no_grad():
        ref_x = head.target_input(None, aux[None])
        ref_h, ref_g = head(emb[ids][None], ref_x)
    x = runner.target_input(None, aux)
    got_h, got_g = runner.forward(ids, x)
    torch.testing.assert_close(x, ref_x[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_h, ref_h[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_g, ref_g[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got_h, got_g)  # the head's own final norm sits before the LM head
    runner.commit(range(6))
    # tree rows read the head's own h': depth 1 from the last committed row, depth 2 from its parent
    depth1 = torch.stack([got_h[-1], got_h[-1]])
    pos = torch.tensor([6, 6, 7, 7])
    anc = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 6, dtype=torch.bool), anc], 1)
    r1_h, _ = runner.forward(tree_tok[:2], depth1, pos[:2], mask[:2, :8], draft=True)
    r2_h, r2_g = runner.forward(tree_tok[2:], torch.stack([r1_h[0], r1_h[0]]), pos[2:], mask[2:], draft=True)
    # the module on the whole sequence at once, with the same hidden inputs, positions and visibility
    full_mask = torch.zeros(10, 10, dtype=torch.bool)
    full_mask[:6, :6] = torch.ones(6, 6).tril().bool()
    full_mask[6:] = mask
    hidden = torch.cat([ref_x[0], depth1, r1_h[0:1].expand(2, -1)])
    with torch.no_grad():
        mh, mg = head(emb[torch.cat([ids, tree_target])][None], hidden[None],
                      torch.cat([torch.arange(6), pos])[None], full_mask[None, None])
    torch.testing.assert_close(r1_h, mh[0, 6:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r2_h, mh[0, 8:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runner.logits(r2_g), head.logits(mg[0, 8:], tiny.lm_head.weight), atol=1e-4,
                               rtol=1e-4)


# ---- the target's aux states ----

@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_aux_features_equal_hf_hidden_states(family, backend):
    model = tiny_model(family, num_hidden_layers=4)
    layers = tuple(eagle3_layers(4))
    runner = (LeanRunner if backend == "lean" else HFRunner)(model)
    ids = [5, 17, 33, 2, 9, 41, 60, 3]
    first = runner.forward(torch.tensor(ids[:6]), aux_layers=layers)
    runner.commit(range(6))
    rest = runner.forward(torch.tensor(ids[6:]), aux_layers=layers)
    assert runner.forward(torch.tensor([1])).aux is None  # only when asked
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0] for i in layers], -1)
    got = torch.cat([first.aux, rest.aux])
    assert got.shape == (8, len(layers) * model.config.hidden_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(SpecdecError, match="the target has 4 layers"):
        runner.check_aux_layers((1, 4), "a head")


# ---- lossless drafting ----

@pytest.mark.parametrize("which", ["random", "trained", "trained-api"])
def test_eagle3_greedy_equals_vanilla(tiny, trained3, which):
    from specdec.api import from_models

    target = LeanRunner(tiny)
    if which == "random":
        drafter = drafter3(tiny, make_head3(tiny, seed=2))
    elif which == "trained":
        drafter = drafter3(tiny, trained3[0]["head"])
    else:
        dec = from_models(tiny, None, "eagle3", head=str(trained3[1] / "head"), depth=4, topk=3, tree_size=8)
        target, drafter = dec.runner, dec.drafter
        assert drafter.name == "eagle3" and drafter.aux_layers == (0, 1)
    taus = greedy_taus(target, drafter, PROMPTS)
    if which != "random":  # drafts get accepted: the accept/sync paths with aux states really run
        assert np.mean(taus) > 1.3


@pytest.mark.slow
def test_eagle3_sampling_matches_vanilla_distribution():
    """Sampled children (each with its q) at T > 0 with top-k and top-p: the first 3 tokens follow the target."""
    model = flat_tiny()
    head = make_head3(model, seed=3, scale=0.1)
    drafter = drafter3(model, head, depth=3, topk=2, tree_size=5, children="sample")
    params = SamplingParams(0.9, top_k=4, top_p=0.9)
    counts, sizes = sample_first3(LeanRunner(model), drafter, [1, 3, 0, 2], params)
    assert max(sizes) >= 4
    assert chi2_pvalue(counts, exact_first3(model, [1, 3, 0, 2], params)) > 1e-3


def test_drafter_without_aux_states_says_so(tiny):
    from specdec.drafters.base import DecodeContext

    drafter = drafter3(tiny, make_head3(tiny))
    ctx = DecodeContext([1, 2, 3, 4], SamplingParams(), None, 3, torch.zeros(3, 64))
    with pytest.raises(SpecdecError, match=r"hidden states entering layers \[0, 1\]"):
        drafter.begin(ctx)


# ---- training ----

def test_training_lowers_the_loss_and_reads_aux_states(trained3):
    r, out, data = trained3
    hist = r["history"]
    # CE only: its floor is the entropy of the target's distribution, well above 0 on a random tiny model
    assert hist[-1]["loss"] < 0.9 * hist[0]["loss"]
    assert hist[-1]["top1_acc"] > hist[0]["top1_acc"]
    assert all(b > a for a, b in zip(hist[0]["top1_acc_by_step"], hist[-1]["top1_acc_by_step"]))
    assert all(h["feature_loss"] == 0 for h in hist)  # EAGLE-3 has no feature loss
    assert len(hist[-1]["top1_acc_by_step"]) == 2  # the training-time test's second step is trained too
    head = r["head"]
    assert head.kind == "eagle3" and head.aux_layers == (0, 1) and head.draft_vocab_size == 60
    # --intermediate-size narrows the MLP (the target's is 128), and the saved head keeps it
    assert head.config.intermediate_size == 96 and head.layers[0].mlp.down_proj.weight.shape == (64, 96)
    assert json.loads((out / "head" / "config.json").read_text())["intermediate_size"] == 96


def test_a_head_started_as_the_targets_last_layer_computes_that_layer(tiny):
    """--init-layer target: with the full MLP, the draft layer's output on a hidden input is the target's
    last layer's output on it (the tiny target has no biases), and fc passes the highest aux state."""
    from specdec.heads.model import head_config
    from specdec.training.train import TrainConfig

    cfg = tiny.config
    head = Eagle3Head(head_config(cfg), (0, 1)).eval()
    last = tiny.model.layers[-1]
    head.start_as({k: v.detach() for k, v in last.state_dict().items()}, tiny.model.norm.weight.detach())
    g = torch.Generator().manual_seed(0)
    t, h = 7, cfg.hidden_size
    x = torch.randn(1, t, h, generator=g)
    aux = torch.cat([torch.randn(1, t, h, generator=g), x], -1)
    with torch.no_grad():
        assert torch.equal(head.target_input(None, aux), x)
        out, normed = head(torch.randn(1, t, h, generator=g), x)
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        want = last(x, attention_mask=mask, position_ids=pos, position_embeddings=tiny.model.rotary_emb(x, pos))
        want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normed, tiny.model.norm(want), rtol=1e-5, atol=1e-5)
    # a narrower MLP keeps the strongest channels
    narrow = Eagle3Head(head_config(cfg, intermediate_size=96), (0, 1))
    narrow.start_as({k: v.detach() for k, v in last.state_dict().items()}, tiny.model.norm.weight.detach())
    up = last.mlp.up_proj.weight.detach()
    assert all(any(torch.equal(r, u) for u in up) for r in narrow.layers[0].mlp.up_proj.weight)
    with pytest.raises(SpecdecError, match="--init-layer"):
        TrainConfig(data="d", out="o", init_layer="target").check()


def test_training_from_the_targets_last_layer_runs_and_learns(tiny, tmp_path):
    from specdec.training.train import TrainConfig, train_eagle

    data = make_aux_data(tiny, tmp_path / "aux-data")
    cfg = TrainConfig(data=str(data), out=str(tmp_path / "run"), steps=20, batch_size=8, lr=3e-2, warmup=2,
                      save_every=1000, log_every=5, arch="eagle3", draft_vocab=60, init_layer="target")
    hist = train_eagle(cfg, tiny, progress=False)["history"]
    assert hist[-1]["loss"] < hist[0]["loss"]


def test_missing_aux_states_are_one_line(tiny, tiny_data, trained3, tmp_path):
    from specdec.training.train import TrainConfig, train_eagle

    def train(data):
        cfg = TrainConfig(data=str(data), out=str(tmp_path / "out"), steps=2, batch_size=4, arch="eagle3")
        train_eagle(cfg, tiny, progress=False)

    with pytest.raises(SpecdecError, match="re-run datagen with --aux-layers eagle3") as e:
        train(tiny_data)  # EAGLE-1 shards: no aux layers in meta.json
    assert "\n" not in str(e.value)
    no_aux = make_aux_data(tiny, tmp_path / "no-aux", n_seq=8, aux=False)
    (no_aux / "meta.json").write_text(json.dumps({"aux_layers": [0, 1]}))  # says aux, shards lack them
    with pytest.raises(SpecdecError, match="holds no aux_features: re-run datagen with --aux-layers eagle3"):
        train(no_aux)
    with pytest.raises(SpecdecError, match="--pad does not apply to an EAGLE-3 head"):
        TrainConfig(data="x", out="y", arch="eagle3", pad=True).check()
    with pytest.raises(SpecdecError, match="--init-from .* has an MLP width of 96: pass the same --intermediate-si"):
        cfg = TrainConfig(data=str(trained3[2]), out=str(tmp_path / "o3"), steps=2, batch_size=4, arch="eagle3",
                          init_from=str(trained3[1] / "head"), intermediate_size=64)
        train_eagle(cfg, tiny, progress=False)
    with pytest.raises(SpecdecError, match="--init-from .* is an eagle3 head"):
        cfg = TrainConfig(data=str(trained3[2]), out=str(tmp_path / "o2"), steps=2, batch_size=4,
                          init_from=str(trained3[1] / "head"))
        train_eagle(cfg, tiny, progress=False)


# ---- files ----

def test_save_load_round_trip(tiny, trained3, tmp_path):
    head = copy.deepcopy(trained3[0]["head"]).cpu().eval()
    lm = tiny.lm_head.weight.detach()
    save_head(head, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["specdec"]["kind"] == "eagle3" and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    assert cfg["draft_vocab_size"] == 60
    back = load_head(tmp_path / "h", 64, 97)
    assert isinstance(back, Eagle3Head) and back.aux_layers == (0, 1)
    for k, v in head.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)
    # shipped without its LM head rows (the target's, through d2t), as an official export lays it out
    head.lm_head.weight.data.copy_(lm[head.d2t])
    save_head(head, tmp_path / "small", lm_head=False)
    with pytest.raises(SpecdecError, match="pass the target"):
        load_head(tmp_path / "small", 64, 97)
    small = load_head(tmp_path / "small", 64, 97, target_lm_head=lm)
    torch.testing.assert_close(small.lm_head.weight, lm[head.d2t])
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    sd = {k.replace("layers.0.", "midlayer."): v for k, v in sd.items()}
    (tmp_path / "official").mkdir()
    save_file(sd, str(tmp_path / "official" / "model.safetensors"))
    cfg.pop("specdec")
    cfg.pop("eagle_config")  # then the layers are EAGLE-3's default for the target's depth
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    (tmp_path / "official" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecdecError, match="does not say which target layers"):
        load_head(tmp_path / "official", 64, 97)
    official = load_head(tmp_path / "official", 64, 97, target_layers=2)
    assert official.aux_layers == (0, 1)
    # the head's default is what datagen --aux-layers eagle3 stores
    assert all(Eagle3Head.default_layers(n) == eagle3_layers(n) for n in (2, 4, 16, 28, 32))
    torch.testing.assert_close(official.state_dict()["layers.0.hidden_norm.weight"],
                               head.state_dict()["layers.0.hidden_norm.weight"])


def test_method_and_head_kinds_must_match(tiny, trained, trained3):
    from specdec.api import from_models
    from specdec.drafters import registry

    with pytest.raises(SpecdecError, match="lookup"):
        registry.parse("eagle3", {"head": "x", "lookup": 4})
    with pytest.raises(SpecdecError, match="is an EAGLE-3 head: run it with eagle3 or auto"):
        from_models(tiny, None, "eagle2", head=str(trained3[1] / "head"))
    with pytest.raises(SpecdecError, match="is an EAGLE-1/2 head"):
        from_models(tiny, None, "eagle3", head=str(trained[1] / "head"))


def test_eagle3_takes_the_head_shipped_for_its_target(tiny, trained3, tmp_path, monkeypatch):
    """Without head=: an error before any model loads when no EAGLE-3 head ships at all; else the one whose
    fingerprint matches the loaded target, and a line naming the shipped ones when none does."""
    import shutil

    import specdec.heads.shipped as shipped
    from specdec.api import from_models
    from specdec.drafters import registry

    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "empty")
    with pytest.raises(SpecdecError, match="head.*must be given: no EAGLE-3 head ships for any target"):
        registry.parse("eagle3", {})
    shutil.copytree(trained3[1] / "head", tmp_path / "ship" / "tiny-eagle3")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "ship")
    registry.parse("eagle3", {})  # one ships: the loaded target decides
    dec = from_models(tiny, None, "eagle3", depth=4, topk=3, tree_size=8)
    assert dec.drafter.name == "eagle3" and dec.drafter.aux_layers == (0, 1)
    assert np.mean(greedy_taus(dec.runner, dec.drafter, PROMPTS)) > 1.3  # the trained head, accepting
    with pytest.raises(SpecdecError, match=r"needs an EAGLE-3 head for this model: none ships for it \(shipped: "
                                           r"tiny-eagle3\); pass head=<dir>"):
        from_models(tiny_model("llama", seed=5), None, "eagle3")


def test_auto_drafts_with_a_given_draft_model_over_a_shipped_head(tiny, trained3, tmp_path, monkeypatch):
    """A draft model passed to `auto` is used even where a head ships for the target (the user asked for
    it); head= names the head to run instead, use_draft=false leaves the shipped head in place, and
    head=none runs without one."""
    import shutil

    import specdec.heads.shipped as shipped
    from specdec.api import from_models
    from specdec.drafters import registry
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.eagle import EagleDrafter
    from tests.helpers import noisy_copy

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    shutil.copytree(trained3[1] / "head", tmp_path / "ship" / "tiny-eagle3")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "ship")
    draft = noisy_copy(tiny, 0.1)
    assert isinstance(from_models(tiny, None, "auto", draft_model=draft).drafter.model, DraftModelDrafter)
    assert isinstance(from_models(tiny, None, "auto", draft_model=draft, use_draft=False).drafter.model, EagleDrafter)
    head = from_models(tiny, None, "auto", draft_model=draft, head=str(trained3[1] / "head")).drafter.model
    assert isinstance(head, EagleDrafter) and head.aux_layers == (0, 1)
    assert isinstance(from_models(tiny, None, "auto").drafter.model, EagleDrafter)
    assert from_models(tiny, None, "auto", head="none").drafter.model is None  # n-gram drafts alone
    assert isinstance(from_models(tiny, None, "auto", head="none", draft_model=draft).drafter.model, DraftModelDrafter)
    with pytest.raises(SpecdecError, match="depth shape an EAGLE head's tree, and head=none"):
        registry.parse("auto", {"head": "none", "depth": 3})


def test_auto_runs_an_eagle3_head_adaptively(tiny, trained, trained3, tmp_path, monkeypatch):
    """`auto` takes an EAGLE-3 head as it takes an EAGLE-2 one: costs measured with the aux states, the
    tree + lookup choice every step, vanilla's text; tune's replay walks it too."""
    from specdec.api import from_models
    from specdec.drafters.adaptive import AdaptiveDrafter
    from specdec.drafters.base import NoDrafter
    from specdec.heads.io import is_eagle3_dir
    from specdec.tune.search import walk
    from tests.helpers import run

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    head_dir = trained3[1] / "head"
    assert is_eagle3_dir(head_dir) and not is_eagle3_dir(trained[1] / "head") and not is_eagle3_dir(tmp_path)
    dec = from_models(tiny, None, "auto", head=str(head_dir))
    d = dec.drafter
    assert isinstance(d, AdaptiveDrafter) and d.aux_layers == (0, 1) and d.costs.draft_s
    assert d.name == "eagle3+ngram adaptive"
    assert all(t > 0 for t in d.costs.draft_s.values())
    for prompt in PROMPTS:
        want, _ = run(LeanRunner(tiny), NoDrafter(), prompt, SamplingParams(), 30)
        got, _ = run(dec.runner, d, prompt, SamplingParams(), 30)
        assert got == want
    target = LeanRunner(tiny)
    cont, _ = run(target, NoDrafter(), PROMPTS[0], SamplingParams(), 16)
    w = walk(d.model, target, PROMPTS[0], cont, [TreeBudget(3, 2, 4)])
    assert max(w.accepted[TreeBudget(3, 2, 4)]) >= 1  # the trained head's drafts get accepted in the replay


def test_a_new_run_warm_starts_from_a_kept_head(tiny, trained3, tmp_path):
    """A second run (another epoch, new data) starts from a run's kept head as the repository holds it (fp16,
    the frozen LM-head rows left to the target): --init-from that weights/ folder."""
    from specdec.heads.io import load_head
    from specdec.training.train import TrainConfig, train_eagle

    kw = dict(data=str(trained3[2]), batch_size=4, warmup=0, arch="eagle3", unroll=2, draft_vocab=60,
              intermediate_size=96, freeze_lm_head=True, log_every=1, lr=3e-2)
    kept = tmp_path / "kept"
    train_eagle(TrainConfig(out=str(tmp_path / "a"), steps=24, save_every=12, keep_in=str(kept), **kw), tiny,
                progress=False)
    lm = tiny.lm_head.weight.detach()
    start = load_head(kept / "weights", hidden_size=lm.shape[1], vocab_size=lm.shape[0], target_lm_head=lm)
    b = train_eagle(TrainConfig(out=str(tmp_path / "b"), steps=0, epochs=1, init_from=str(kept / "weights"), **kw),
                    tiny, progress=False)
    scratch = train_eagle(TrainConfig(out=str(tmp_path / "c"), steps=1, **kw), tiny, progress=False)
    first = json.loads((tmp_path / "b" / "log.jsonl").read_text().splitlines()[0])
    # the same first batch (seed 0; ignoring --init-from would give the new head's loss exactly): lower
    assert first["step"] == 1 and first["loss"] < 0.9 * scratch["history"][0]["loss"]
    moved = b["head"].state_dict()
    assert torch.equal(moved["d2t"], start.state_dict()["d2t"].to(moved["d2t"].device))
