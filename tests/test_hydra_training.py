"""Training Hydra heads with the Medusa trainer (`specdec train medusa --arch hydra`): the loss falls, the
result loads as Hydra heads with accuracies, beats its untrained start and drafts losslessly."""

import json

import pytest

from specdec.api import from_models
from specdec.cli import build_parser, main
from specdec.drafters.base import NoDrafter
from specdec.errors import SpecdecError
from specdec.heads.hydra import HydraHeads
from specdec.heads.medusa_io import load_medusa
from specdec.sampling import SamplingParams
from specdec.training.medusa import MedusaTrainConfig, head_accuracies, held_in, train_medusa
from specdec.training.shards import ShardData
from specdec.training.train_cli import config_of
from tests.helpers import PROMPTS, run


@pytest.fixture(scope="module")
def trained_hydra(tiny, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("hydra-run")
    cfg = MedusaTrainConfig(data=str(tiny_data), out=str(out), arch="hydra", num_heads=3, steps=40, batch_size=8,
                            lr=3e-2, warmup=5, save_every=1000, log_every=10)
    return train_medusa(cfg, tiny, progress=False), out


def test_training_lowers_the_loss_and_the_heads_load_and_draft(trained_hydra, tiny, tiny_data):
    r, out = trained_hydra
    first, last = r["history"][0], r["history"][-1]
    assert last["loss"] < first["loss"] - 0.3
    assert all(b < a for a, b in zip(first["ce_by_head"], last["ce_by_head"]))
    assert all(p.grad is None for p in tiny.parameters())  # the target stays frozen
    heads = load_medusa(out / "heads", 64, 97, target_lm_head=tiny.lm_head.weight, cls=HydraHeads)
    assert isinstance(heads, HydraHeads) and heads.meta["kind"] == "hydra" and heads.num_heads == 3
    acc = heads.meta["accuracies"]
    assert acc == r["accuracies"] and len(acc) == 3
    # better than the untrained heads (zero first layers: each head guesses x_{t+1} again)
    data, lm = ShardData(str(tiny_data)), tiny.lm_head.weight.detach()
    fresh = HydraHeads(64, 97, 3)
    fresh.init_lm_heads(lm)
    before, _ = head_accuracies(fresh, data, held_in(len(data), 0), lm, embed=tiny.get_input_embeddings().weight)
    assert acc[1][0] > before[1][0] + 0.03
    d = from_models(tiny, None, "hydra", heads=str(out / "heads"), tree_size=6)
    want, _ = run(d.runner, NoDrafter(), PROMPTS[3], SamplingParams(), 24)
    got, stats = run(d.runner, d.drafter, PROMPTS[3], SamplingParams(), 24)
    assert got == want and max(stats.tree_sizes) == 6
    with pytest.raises(SpecdecError, match="does not hold Medusa heads"):
        from_models(tiny, None, "medusa", heads=str(out / "heads"))


def test_hydra_flags(tiny, tiny_data, tmp_path, capsys):
    parse = build_parser().parse_args
    cfg = config_of(parse(["train", "medusa", "--data", "d", "--out", "o", "--arch", "hydra"]), MedusaTrainConfig)
    assert (cfg.arch, cfg.kind, cfg.prefix_attention) == ("hydra", "hydra", False)
    with pytest.raises(SpecdecError, match="--prefix-attention .* needs --arch hydra"):
        MedusaTrainConfig(data="d", out="o", prefix_attention=True).check()
    MedusaTrainConfig(data="d", out="o", arch="hydra", prefix_attention=True).check()
    with pytest.raises(SpecdecError, match="--joint .* --arch hydra"):
        MedusaTrainConfig(data="d", out="o", arch="hydra", joint=True).check()
    model_dir = tmp_path / "target"
    tiny.save_pretrained(model_dir)
    args = ["train", "medusa", "--arch", "hydra", "--model", str(model_dir), "--data", str(tiny_data), "--out",
            str(tmp_path / "run"), "--steps", "2", "--batch-size", "4", "--num-heads", "2"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("train medusa --arch hydra: step 2/2")
    raw = json.loads((tmp_path / "run" / "heads" / "config.json").read_text())
    assert raw["model_type"] == "hydra" and raw["architectures"] == ["HydraHeads"]


def test_a_prefix_layer_trains_with_the_heads(trained_hydra, tiny, tiny_data, tmp_path):
    """--prefix-attention: the layer starts as the identity and trains with the heads; the saved heads
    carry it and draft losslessly; warm starts must agree on it."""
    cfg = MedusaTrainConfig(data=str(tiny_data), out=str(tmp_path / "p"), arch="hydra", prefix_attention=True,
                            num_heads=3, steps=40, batch_size=8, lr=3e-2, warmup=5, save_every=1000, log_every=10)
    r = train_medusa(cfg, tiny, progress=False)
    assert r["history"][-1]["loss"] < r["history"][0]["loss"] - 0.3
    heads = load_medusa(tmp_path / "p" / "heads", 64, 97, target_lm_head=tiny.lm_head.weight, cls=HydraHeads)
    assert heads.prefix is not None and heads.prefix_config["num_key_value_heads"] == tiny.config.num_key_value_heads
    assert heads.prefix.self_attn.o_proj.weight.abs().max() > 0  # trained away from its zero start
    d = from_models(tiny, None, "hydra", heads=str(tmp_path / "p" / "heads"), tree_size=6)
    assert d.drafter.runner.prefix is not None
    for prompt in PROMPTS:
        want, _ = run(d.runner, NoDrafter(), prompt, SamplingParams(), 24)
        got, _ = run(d.runner, d.drafter, prompt, SamplingParams(), 24)
        assert got == want
    plain = cfg.model_copy(update={"out": str(tmp_path / "q"), "prefix_attention": False,
                                   "init_from": str(tmp_path / "p" / "heads")})
    with pytest.raises(SpecdecError, match="has prefix_attention=True: pass --prefix-attention"):
        train_medusa(plain, tiny, progress=False)
    more = cfg.model_copy(update={"out": str(tmp_path / "m"), "prefix_attention": True,
                                  "init_from": str(trained_hydra[1] / "heads")})
    with pytest.raises(SpecdecError, match="has prefix_attention=False: drop --prefix-attention"):
        train_medusa(more, tiny, progress=False)
