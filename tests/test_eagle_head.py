"""The EAGLE head: module, save/load and validation, the lean runner and its KV cache."""

import json

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.heads.io import load_head, save_head
from specdec.heads.runner import HeadRunner
from specdec.vocab import frequent_ids
from tests.helpers import VARIANTS, make_head, tiny_model


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layers", [1, 2])
def test_head_forward_shapes_and_lean_runner_matches(tiny, layers, variant):
    head = make_head(tiny, layers=layers, variant=variant)
    emb, lm = tiny.get_input_embeddings().weight, tiny.lm_head.weight
    toks, f = torch.randint(0, 97, (2, 10)), torch.randn(2, 10, 64)
    with torch.no_grad():
        out, out_lm = head(emb[toks], f)
        assert out.shape == out_lm.shape == (2, 10, 64)
        assert (out_lm is out) == (not head.pad)  # PAD: two outputs on one residual, else one
        assert head.logits(out_lm, lm).shape == (2, 10, 97)
    r = HeadRunner(head, emb, lm)
    h1, g1 = r.forward(toks[0, :4], f[0, :4])
    r.commit(range(4))
    h2, g2 = r.forward(toks[0, 4:], f[0, 4:])
    torch.testing.assert_close(torch.cat([h1, h2]), out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([g1, g2]), out_lm[0], atol=1e-5, rtol=1e-5)
    # tree rows see only their ancestors: two siblings at the same position equal two separate chains
    r.rollback()
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 5] = mask[1, 4] = False
    sib, sib_lm = r.forward(toks[1, :2], f[1, :2], torch.tensor([4, 4]), mask)
    for j in range(2):
        with torch.no_grad():
            ref, ref_lm = head(emb[torch.cat([toks[0, :4], toks[1, j:j + 1]])][None],
                               torch.cat([f[0, :4], f[1, j:j + 1]])[None])
        torch.testing.assert_close(sib[j], ref[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sib_lm[j], ref_lm[0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layers", [1, 2])
def test_runner_keeps_only_the_accepted_tree_path_in_every_layer(tiny, layers, variant):
    """After verification the drafter commits a path of tree rows (not contiguous): every layer's cache
    must then hold exactly what a plain forward over the accepted sequence would."""
    head = make_head(tiny, seed=2, layers=layers, variant=variant)
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
    tree_out, _ = r.forward(toks[4:10], f[4:10], torch.tensor(depth) + 4, mask)
    r.commit([0, 2, 5])
    after, _ = r.forward(toks[10:12], f[10:12])
    kept = torch.tensor([0, 1, 2, 3, 4, 6, 9, 10, 11])
    with torch.no_grad():
        ref = head(emb[toks[kept]][None], f[kept][None])[0][0]
    torch.testing.assert_close(tree_out[[0, 2, 5]], ref[4:7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, ref[7:], atol=1e-5, rtol=1e-5)


def test_reduced_vocab_maps_draft_ids_to_target_ids(tiny, tmp_path):
    ids = [90, 3, 17, 5, 60]
    head = make_head(tiny, draft_vocab=ids)
    assert head.d2t.tolist() == sorted(ids)
    r = HeadRunner(head, tiny.get_input_embeddings().weight)
    h, _ = r.forward(torch.tensor([1, 2]), torch.randn(2, 64))
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
    assert frequent_ids(torch.tensor([5, 0, 9, 9, 1]), 3).tolist() == [0, 2, 3]
    assert frequent_ids(torch.tensor([5, 0, 9, 9, 1]), 3, always={1}).tolist() == [1, 2, 3]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_draft_rows_read_the_token_table_and_match_the_full_connector(tiny, variant):
    """Draft steps take the connector's token half from a table over the draft vocabulary; it must give
    the rows the full connector gives the same target tokens (the EAGLE table carries fc's bias too)."""
    ids = [90, 3, 17, 5, 60, 41]
    head = make_head(tiny, seed=3, draft_vocab=ids, variant=variant)
    if head.fc is not None:
        head.fc.bias = torch.nn.Parameter(torch.randn(64))
    emb = tiny.get_input_embeddings().weight
    r = HeadRunner(head, emb, pack=False)
    width = head.sampler_size if head.sampler is not None else 64
    assert r.token_table.shape == (len(ids), width)
    draft, f = torch.tensor([4, 0, 2, 2]), torch.randn(4, 64)
    via_table = r.forward(draft, f, draft=True)
    r.rollback()
    full = r.forward(r.to_target(draft), f)
    for a, b in zip(via_table, full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        ref = head(emb[r.to_target(draft)][None], f[None])
    torch.testing.assert_close(via_table[1], ref[1][0], atol=1e-5, rtol=1e-5)
    assert HeadRunner(make_head(tiny, variant=variant), emb, tiny.lm_head.weight).token_table is None


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
