"""Medusa heads in foreign layouts: FasterDecoding's and vLLM's files written by hand (their key names and
config fields), imported with the same logits; exports re-imported, and checked against a re-implementation
of what vLLM / FasterDecoding compute from those files; one clear error per kind of bad input."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdec.api import from_models
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.heads.medusa_formats import detect_format, export_medusa, export_vllm, import_medusa
from specdec.heads.medusa_io import save_medusa
from tests.helpers import make_heads, word_tokenizer

H, V = 64, 97
F_IN = torch.randn(5, H, generator=torch.Generator().manual_seed(1))



def full_logits(heads, lm):
    """[K, N, V] over the target vocabulary, -inf outside a reduced draft vocabulary (vLLM's convention)."""
    with torch.no_grad():
        x = heads.logits(F_IN, lm)
    if heads.d2t is None:
        return x
    out = torch.full((*x.shape[:-1], V), -math.inf)
    out[..., heads.d2t] = x
    return out


def blocks_of(heads):
    return [[(lin.weight.detach().clone(), lin.bias.detach().clone()) for lin in blk.layers] for blk in heads.blocks]


def write_fasterdecoding(d, heads, lm=None, pt=False, prefix="", cfg_extra=None):
    """FasterDecoding/Medusa: medusa_head.state_dict(), a ModuleList of Sequential(ResBlock x L, Linear(H, V,
    bias=False))."""
    d.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, blk in enumerate(blocks_of(heads)):
        for i, (w, b) in enumerate(blk):
            sd[f"{prefix}{k}.{i}.linear.weight"], sd[f"{prefix}{k}.{i}.linear.bias"] = w, b
        rows = heads.lm_heads[k].weight if heads.lm_heads is not None else lm
        sd[f"{prefix}{k}.{len(blk)}.weight"] = rows.detach().clone()
    if pt:
        torch.save(sd, d / "medusa_lm_head.pt")
    else:
        save_file(sd, str(d / "medusa_lm_head.safetensors"))
    cfg = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
           "base_model_name_or_path": "tiny-llama", "transformers_version": "4.36.2", **(cfg_extra or {})}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def write_vllm(d, heads, lm=None, bias=True, shared=False, perm=None, full_rows=False, prefix=""):
    """vLLM: blocks.{k}.layers.{l}.weight/bias, lm_heads.{k}.weight, token_map; perm reorders the draft vocabulary."""
    d.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, blk in enumerate(blocks_of(heads)):
        for i, (w, b) in enumerate(blk):
            sd[f"{prefix}blocks.{k}.layers.{i}.weight"] = w
            if bias:
                sd[f"{prefix}blocks.{k}.layers.{i}.bias"] = b
    ids = heads.d2t
    rows = [lm.weight.detach().clone() for lm in heads.lm_heads] if heads.lm_heads is not None else \
        [(lm if ids is None else lm[ids]).clone()] * heads.num_heads
    if ids is not None:
        perm = torch.arange(ids.numel()) if perm is None else perm
        ids, rows = ids[perm], [r[perm] for r in rows]
        sd["token_map"] = ids.clone()
        if full_rows:  # [V, H] rows, sliced by vLLM with the token map
            rows = [torch.zeros(V, H).index_copy(0, ids, r) for r in rows]
    for k, r in enumerate(rows[:1] if shared else rows):
        sd[f"lm_heads.{k}.weight"] = r.contiguous().clone()
    save_file(sd, str(d / "model.safetensors"))
    cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H, "vocab_size": V,
           "num_heads": heads.num_heads, "num_hidden_layers": heads.num_layers,
           "truncated_vocab_size": heads.draft_vocab_size, "medusa_fc_bias": bias, "original_lm_head": shared}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# ---- reference readers: what vLLM and FasterDecoding compute from the files ----

def vllm_reference(d):
    cfg = json.loads((d / "config.json").read_text())
    sd = {k.replace("medusa_heads.", ""): t for k, t in load_file(str(d / "model.safetensors")).items()}
    tm = sd.get("token_map") if cfg.get("truncated_vocab_size", cfg["vocab_size"]) < cfg["vocab_size"] else None
    out = []
    for k in range(cfg["num_heads"]):
        x = F_IN
        for i in range(cfg["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, sd[f"blocks.{k}.layers.{i}.weight"],
                                    sd[f"blocks.{k}.layers.{i}.bias"] if cfg.get("medusa_fc_bias") else None))
        w = sd["lm_heads.0.weight"] if cfg.get("original_lm_head") else sd[f"lm_heads.{k}.weight"]
        if tm is not None and w.shape[0] > tm.numel():
            w = w[tm]
        y = F.linear(x, w) * cfg.get("logit_scale", 1.0)
        if tm is not None:
            y = torch.full((*y.shape[:-1], cfg["vocab_size"]), -math.inf).index_copy(-1, tm, y)
        out.append(y)
    return torch.stack(out)


def fasterdecoding_reference(d):
    cfg = json.loads((d / "config.json").read_text())
    sd = load_file(str(d / "medusa_lm_head.safetensors"))
    k_heads, n = cfg["medusa_num_heads"], cfg["medusa_num_layers"]
    out = []
    for k in range(k_heads):
        x = F_IN
        for i in range(n):
            x = x + F.silu(F.linear(x, sd[f"{k}.{i}.linear.weight"], sd[f"{k}.{i}.linear.bias"]))
        out.append(F.linear(x, sd[f"{k}.{n}.weight"]))
    return torch.stack(out)


# ---- import ----

@pytest.mark.parametrize("pt,prefix,layers", [(False, "", 1), (True, "", 2), (False, "medusa_head.", 2)])
def test_fasterdecoding_layout_imports_with_the_same_logits(tiny, tmp_path, pt, prefix, layers):
    lm = tiny.lm_head.weight.detach()
    heads = make_heads(tiny, 3, layers, "own")
    d = write_fasterdecoding(tmp_path / "fd", heads, pt=pt, prefix=prefix)
    assert detect_format(d) == "medusa"
    back = import_medusa(d, lm)
    assert (back.num_heads, back.num_layers, back.lm_head_kind, back.d2t) == (3, layers, "own", None)
    assert back.meta["imported_from"] == "medusa"
    assert torch.equal(full_logits(back, lm), full_logits(heads, lm))


def test_fasterdecoding_heads_still_equal_to_the_target_share_its_lm_head(tiny, tmp_path):
    """Medusa's init copies the target's LM head into every head: imported, they share the target's."""
    lm = tiny.lm_head.weight.detach()
    heads = make_heads(tiny, 2, 1, "target")
    d = write_fasterdecoding(tmp_path / "fd", heads, lm=lm)
    shared = import_medusa(d, lm)
    assert shared.lm_head_kind == "target" and shared.lm_heads is None
    assert torch.equal(full_logits(shared, lm), full_logits(heads, lm))
    own = import_medusa(d)  # no target to compare with: copies
    assert own.lm_head_kind == "own"
    assert torch.allclose(full_logits(own, None), full_logits(heads, lm), atol=1e-5)


@pytest.mark.parametrize("reduced,perm,full_rows,shared,prefix", [
    (False, False, False, False, ""),
    (False, False, False, True, "medusa_heads."),
    (True, False, False, False, ""),
    (True, True, False, False, ""),  # token_map in no particular order
    (True, True, True, True, ""),  # full-vocabulary rows sliced by the token map, one shared LM head
])
def test_vllm_layout_imports_with_the_same_logits(tiny, tmp_path, reduced, perm, full_rows, shared, prefix):
    lm = tiny.lm_head.weight.detach()
    vocab = torch.arange(1, V, 3) if reduced else None
    heads = make_heads(tiny, 3, 2, "target" if shared else "own", vocab)
    p = torch.randperm(vocab.numel(), generator=torch.Generator().manual_seed(2)) if perm else None
    d = write_vllm(tmp_path / "v", heads, lm, shared=shared, perm=p, full_rows=full_rows, prefix=prefix)
    assert detect_format(d) == "vllm"
    want = full_logits(heads, lm)
    assert torch.allclose(vllm_reference(d), want, atol=1e-5)  # the hand-written files mean these heads
    back = import_medusa(d, lm)
    assert back.lm_head_kind == ("target" if shared else "own")
    assert (back.d2t is None) == (not reduced) and (not reduced or torch.equal(back.d2t, vocab))
    assert torch.equal(full_logits(back, lm), want)


def test_vllm_heads_without_biases(tiny, tmp_path):
    """vLLM's default medusa_fc_bias is false: no bias tensors, zero biases here."""
    lm = tiny.lm_head.weight.detach()
    heads = make_heads(tiny, 2, 1, "own")
    with torch.no_grad():
        for blk in heads.blocks:
            blk.layers[0].bias.zero_()
    d = write_vllm(tmp_path / "v", heads, bias=False)
    assert torch.equal(full_logits(import_medusa(d, lm), lm), full_logits(heads, lm))


# ---- export and round trips ----

@pytest.mark.parametrize("lm_head,reduced", [("target", False), ("own", False), ("target", True), ("own", True)])
def test_vllm_export_means_the_same_heads_and_round_trips(tiny, tmp_path, lm_head, reduced):
    lm = tiny.lm_head.weight.detach()
    vocab = torch.arange(0, V, 2) if reduced else None
    heads = make_heads(tiny, 3, 2, lm_head, vocab)
    heads.meta = {"accuracies": [[0.5], [0.3], [0.2]]}
    want = full_logits(heads, lm)
    export_vllm(heads, tmp_path / "v", lm)
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    names = set(load_file(str(tmp_path / "v" / "model.safetensors")))
    assert cfg["model_type"] == "medusa" and cfg["medusa_fc_bias"] is True
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, 2, H, V)
    assert cfg["truncated_vocab_size"] == heads.draft_vocab_size
    assert cfg["original_lm_head"] == (lm_head == "target")
    assert ("token_map" in names) == reduced
    assert {f"lm_heads.{k}.weight" for k in range(3)} & names == (
        {"lm_heads.0.weight"} if lm_head == "target" else {f"lm_heads.{k}.weight" for k in range(3)})
    assert torch.allclose(vllm_reference(tmp_path / "v"), want, atol=1e-5)
    back = import_medusa(tmp_path / "v", lm)
    assert back.lm_head_kind == lm_head and back.meta["accuracies"] == heads.meta["accuracies"]
    assert torch.equal(full_logits(back, lm), want)
    # and through our layout and FasterDecoding's (full vocabulary only) back again
    save_medusa(back, tmp_path / "s")
    assert detect_format(tmp_path / "s") == "specdec"
    assert torch.equal(full_logits(import_medusa(tmp_path / "s", lm), lm), want)
    if not reduced:
        export_medusa(back, tmp_path / "m", lm, pt=True)
        assert torch.allclose(fasterdecoding_reference(tmp_path / "m"), want, atol=1e-5)
        m = import_medusa(tmp_path / "m", lm)
        assert m.lm_head_kind == lm_head and torch.equal(full_logits(m, lm), want)
        assert set(torch.load(tmp_path / "m" / "medusa_lm_head.pt", weights_only=True)) == set(
            load_file(str(tmp_path / "m" / "medusa_lm_head.safetensors")))


@pytest.mark.parametrize("lm_head,reduced,layers", [("target", False, 1), ("own", True, 2), ("target", True, 1)])
def test_our_layout_round_trips_through_import(tiny, tmp_path, lm_head, reduced, layers):
    lm = tiny.lm_head.weight.detach()
    heads = make_heads(tiny, 2, layers, lm_head, torch.arange(0, V, 5) if reduced else None)
    save_medusa(heads, tmp_path / "s")
    back = import_medusa(tmp_path / "s", lm)
    assert back.lm_head_kind == lm_head
    assert torch.equal(full_logits(back, lm), full_logits(heads, lm))


def test_the_drafter_loads_foreign_layouts(tiny, tmp_path):
    lm = tiny.lm_head.weight.detach()
    heads = make_heads(tiny, 3, 1, "own")
    for d in (write_vllm(tmp_path / "v", heads), write_fasterdecoding(tmp_path / "fd", heads)):
        dec = from_models(tiny, None, "medusa", heads=str(d), topk=2)
        # on the streaming kernel an fp32 target's heads run on Q8_0 blocks (Runner.head_weights): weights
        # and activations in 8 bits, so the logits agree to ~1% of their scale, not to the last bits
        q8 = dec.drafter.runner.first.precision == "q8_0"
        want = full_logits(heads, lm)
        got = torch.stack([dec.drafter.runner.logits(F_IN[r]) for r in range(len(F_IN))], 1)
        err = float((got - want).abs().max())
        assert err < (0.02 * float(want.abs().max()) if q8 else 1e-5)


def test_export_refuses_what_the_layout_cannot_hold(tiny, tmp_path):
    lm = tiny.lm_head.weight.detach()
    with pytest.raises(SpecdecError, match="no reduced vocabulary.*vllm"):
        export_medusa(make_heads(tiny, 2, 1, "own", torch.arange(10)), tmp_path / "m", lm)
    for export in (export_vllm, export_medusa):
        with pytest.raises(SpecdecError, match=r"share the target's LM head.*--model"):
            export(make_heads(tiny, 2, 1, "target"), tmp_path / "x")
        with pytest.raises(SpecdecError, match="a different model"):
            export(make_heads(tiny, 2, 1, "target"), tmp_path / "x", lm[:50])
    assert not (tmp_path / "x").exists() and not (tmp_path / "m").exists()


# ---- errors ----

def test_mismatched_target_is_one_clear_error(tiny, tmp_path):
    heads = make_heads(tiny, 2, 1, "own")
    for d in (write_fasterdecoding(tmp_path / "fd", heads), write_vllm(tmp_path / "v", heads)):
        with pytest.raises(SpecdecError, match="hidden size 64 but the target has 32"):
            import_medusa(d, hidden_size=32)
        with pytest.raises(SpecdecError, match="vocabulary of 97 tokens but the target has 50"):
            import_medusa(d, vocab_size=50)
        with pytest.raises(SpecdecError, match="vocabulary of 97 tokens but the target has 96"):
            import_medusa(d, tiny.lm_head.weight.detach()[:96])
    with pytest.raises(SpecdecError, match="config.json hidden_size is 32 but the tensors .* say 64"):
        import_medusa(write_fasterdecoding(tmp_path / "fd2", heads, cfg_extra={"hidden_size": 32}))


def _edit(f, fn):
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f))


@pytest.mark.parametrize("layout", ["medusa", "vllm"])
def test_damaged_heads_are_one_clear_error(tiny, tmp_path, layout):
    heads = make_heads(tiny, 2, 1, "own")
    fname, block, lm1 = (("medusa_lm_head.safetensors", "1.0.linear.weight", "1.1.weight") if layout == "medusa" else
                         ("model.safetensors", "blocks.1.layers.0.weight", "lm_heads.1.weight"))

    def fresh(name):
        d = tmp_path / name
        return write_fasterdecoding(d, heads) if layout == "medusa" else write_vllm(d, heads)

    d = fresh("missing")
    _edit(d / fname, lambda sd: sd.pop(lm1))
    with pytest.raises(SpecdecError, match=f"tensor {lm1} is missing"):
        import_medusa(d)
    d = fresh("shape")
    _edit(d / fname, lambda sd: sd.__setitem__(block, sd[block][:, :32].contiguous()))
    with pytest.raises(SpecdecError, match=rf"tensor {block} in {fname} is \(64, 32\), expected \(64, 64\)"):
        import_medusa(d)
    d = fresh("nan")
    _edit(d / fname, lambda sd: sd[lm1].__setitem__((3, 4), float("nan")))
    with pytest.raises(SpecdecError, match=f"{lm1} .*NaN/inf: the file is damaged"):
        import_medusa(d)
    d = fresh("garbage")
    (d / fname).write_bytes(b"\x00garbage")
    with pytest.raises(SpecdecError, match=f"cannot read {fname}, the file looks damaged"):
        import_medusa(d)


def test_layout_specific_errors(tiny, tmp_path):
    heads = make_heads(tiny, 2, 1, "own", torch.arange(0, V, 4))
    d = write_vllm(tmp_path / "v", heads)
    _edit(d / "model.safetensors", lambda sd: sd.pop("token_map"))
    with pytest.raises(SpecdecError, match="needs a token_map"):
        import_medusa(d)
    d = write_vllm(tmp_path / "b", make_heads(tiny, 2, 1, "own"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"medusa_fc_bias": False}))
    with pytest.raises(SpecdecError, match="medusa_fc_bias is not true, so vLLM would drop them"):
        import_medusa(d)
    (d / "config.json").write_text(json.dumps(cfg | {"num_heads": 1}))
    with pytest.raises(SpecdecError, match=r"do not match config.json .*unexpected \['blocks.1"):
        import_medusa(d)
    with pytest.raises(SpecdecError, match="not a directory"):
        import_medusa(tmp_path / "nope")
    save_medusa(make_heads(tiny, 2, 1, "own"), tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    (tmp_path / "s" / "config.json").write_text(json.dumps(cfg | {"lm_head": "shared"}))
    with pytest.raises(SpecdecError, match="lm_head must be one of target, own, got 'shared'"):
        import_medusa(tmp_path / "s")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdecError, match="config.json is missing"):
        import_medusa(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SpecdecError, match="not hold Medusa heads in a known layout"):
        detect_format(tmp_path / "empty")


# ---- CLI ----

def test_cli_converts_and_errors_in_one_line(tiny, tmp_path, capsys):
    tiny.save_pretrained(tmp_path / "target")
    word_tokenizer(["a", "b"]).save_pretrained(tmp_path / "target")
    lm = tiny.lm_head.weight.detach()
    heads = make_heads(tiny, 2, 1, "target")
    save_medusa(heads, tmp_path / "s")
    assert main(["medusa", "convert", str(tmp_path / "s"), str(tmp_path / "v"), "--to", "vllm"]) == 2
    assert "give the target (--model)" in capsys.readouterr().err
    assert main(["medusa", "convert", str(tmp_path / "s"), str(tmp_path / "v"), "--to", "vllm",
                 "--model", str(tmp_path / "target")]) == 0
    assert "(specdec) -> " in capsys.readouterr().err
    assert main(["medusa", "convert", str(tmp_path / "v"), str(tmp_path / "back")]) == 0
    back = import_medusa(tmp_path / "back", lm)
    assert torch.allclose(full_logits(back, lm), full_logits(heads, lm), atol=1e-5)
    assert main(["medusa", "convert", str(tmp_path / "s"), str(tmp_path / "target"), "--to", "vllm"]) == 2
    assert "does not hold Medusa heads: refusing to replace it" in capsys.readouterr().err
    assert (tmp_path / "target" / "config.json").is_file()
    with pytest.raises(SystemExit) as e:
        main(["medusa", "convert", str(tmp_path / "s"), str(tmp_path / "x"), "--to", "json"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--to" in err
