"""Heads in and out: published EAGLE-1/2, EAGLE-3 and Medusa checkpoints imported; vLLM and SGLang exports
laid out as those engines read them, and read back to the same tensors and the same drafts."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.cli import main
from specdec.drafters.eagle import EagleDrafter
from specdec.errors import SpecdecError
from specdec.heads.interop import detect, export_head, import_head
from specdec.heads.io import load_head, save_head
from specdec.heads.medusa_formats import export_medusa, import_medusa
from specdec.heads.medusa_io import load_medusa, save_medusa
from specdec.heads.model import EagleHead, head_config
from specdec.heads.runner import runner_for
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.tree import TreeBudget
from tests.helpers import PROMPTS, make_head, make_head3, make_heads, run, tiny_gguf, tiny_model


@pytest.fixture(scope="module")
def deep():
    """8 layers: EAGLE-3's default layers of it are three (2, 4, 5), as the engines require."""
    return tiny_model("llama", num_hidden_layers=8, seed=3)


def biased_head(model, seed=0):
    torch.manual_seed(seed)
    head = EagleHead(head_config(model.config), fc_bias=True).eval()
    with torch.no_grad():
        head.fc.bias.normal_(0, 0.5)
    return head


def drafts(model, head, prompts=PROMPTS[:2], n=24):
    """Tokens, per-forward accepted lengths and tree sizes of greedy decoding: equal iff the drafts are."""
    lm = model.lm_head.weight
    drafter = EagleDrafter(runner_for(head, model.get_input_embeddings().weight, lm), TreeBudget(4, 3, 8))
    out = []
    for p in prompts:
        toks, st = run(LeanRunner(model), drafter, p, SamplingParams(), n)
        out.append((toks, st.accept_lengths, st.tree_sizes))
    return out


def same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        if sa[k] is not None:
            torch.testing.assert_close(sb[k].to(sa[k].dtype), sa[k], rtol=0, atol=0, msg=k)


def write_eagle1(d, head, model, fmt="bin"):
    """SafeAILab's EAGLE-1/2 layout: a Llama config with "bias", fc.*, layers.0.* and the target's embeddings."""
    d.mkdir(parents=True)
    sd = {k: v.clone() for k, v in head.state_dict().items() if v is not None and k != "d2t"}
    sd["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    if fmt == "bin":
        torch.save(sd, d / "pytorch_model.bin")
    else:
        save_file(sd, str(d / "model.safetensors"))
    cfg = head.config.to_dict()
    cfg.update(architectures=["LlamaForCausalLM"], bias=head.fc.bias is not None)
    (d / "config.json").write_text(json.dumps(cfg))


def write_eagle3(d, head):
    """SafeAILab / SpecForge EAGLE-3: midlayer.*, d2t offsets, t2d, no eagle_config (default layers)."""
    d.mkdir(parents=True)
    sd = {k.replace("layers.0.", "midlayer."): v.clone() for k, v in head.state_dict().items() if k != "d2t"}
    sd["d2t"] = head.d2t - torch.arange(head.d2t.numel())
    sd["t2d"] = head.t2d()
    torch.save(sd, d / "pytorch_model.bin")
    cfg = head.config.to_dict()
    cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=head.draft_vocab_size)
    (d / "config.json").write_text(json.dumps(cfg))


# ---- import ----

@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_eagle1_checkpoint_imports_to_the_same_head_and_drafts(tiny, tmp_path, fmt):
    head = biased_head(tiny)
    write_eagle1(tmp_path / "official", head, tiny, fmt)
    assert detect(tmp_path / "official") == "eagle"
    kind, _ = import_head(tmp_path / "official", tmp_path / "ours", tiny.lm_head.weight.detach())
    assert kind == "eagle"
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["specdec"]["kind"] == "eagle" and cfg["specdec"]["imported_from"].endswith("official")
    back = load_head(tmp_path / "ours", 64, 97)
    assert back.fc.bias is not None
    same_tensors(head, back)
    assert drafts(tiny, back) == drafts(tiny, head)


def test_eagle3_checkpoint_imports_with_default_layers_and_drafts_the_same(deep, tmp_path):
    head = make_head3(deep, draft_vocab=list(range(0, 97, 2)))
    assert head.aux_layers == (2, 4, 5)
    write_eagle3(tmp_path / "official", head)
    assert detect(tmp_path / "official") == "eagle3"
    with pytest.raises(SpecdecError, match="which target layers"):
        import_head(tmp_path / "official", tmp_path / "ours")
    import_head(tmp_path / "official", tmp_path / "ours", deep.lm_head.weight.detach(), target_layers=8)
    back = load_head(tmp_path / "ours", 64, 97)
    assert back.kind == "eagle3" and back.aux_layers == (2, 4, 5) and back.draft_vocab_size == 49
    same_tensors(head, back)
    assert drafts(deep, back) == drafts(deep, head)
    other = make_head3(deep, seed=7, draft_vocab=list(range(0, 97, 2)))
    assert drafts(deep, other) != drafts(deep, head)  # the comparison sees a different head


def test_medusa_checkpoint_imports(tiny, tmp_path):
    heads = make_heads(tiny, k=3)
    export_medusa(heads, tmp_path / "fd", pt=True)
    (tmp_path / "fd" / "medusa_lm_head.safetensors").unlink()  # what FasterDecoding's own trainer writes
    assert detect(tmp_path / "fd") == "medusa"
    kind, _ = import_head(tmp_path / "fd", tmp_path / "ours", tiny.lm_head.weight.detach())
    back = load_medusa(tmp_path / "ours", 64, 97)
    assert kind == "medusa" and back.num_heads == 3
    same_tensors(heads, back)


class Planted:
    """Unpickling runs its __reduce__: a loader that executes pickles would create the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_a_pickle_with_a_non_tensor_object_is_refused_unexecuted(tiny, tmp_path):
    d = tmp_path / "evil"
    write_eagle1(d, biased_head(tiny), tiny)
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    marker = tmp_path / "marker"
    torch.save({**sd, "extra": Planted(marker)}, d / "pytorch_model.bin")
    with pytest.raises(SpecdecError, match="objects other than tensors.*refused without running it"):
        import_head(d, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()
    # plain values a weights-only pickle allows are no tensors either
    torch.save({**sd, "step": 3}, d / "pytorch_model.bin")
    with pytest.raises(SpecdecError, match="'step' is a int"):
        import_head(d, tmp_path / "out")


def test_shape_mismatches_name_the_tensor(tiny, tmp_path):
    head = biased_head(tiny)
    write_eagle1(tmp_path / "a", head, tiny, "safetensors")
    sd = load_file(str(tmp_path / "a" / "model.safetensors"))
    sd["layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(sd, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(SpecdecError, match=r"layers\.0\.mlp\.up_proj\.weight"):
        import_head(tmp_path / "a", tmp_path / "out")
    sd["layers.0.mlp.up_proj.weight"] = head.layers[0].mlp.up_proj.weight.detach()
    sd["fc.weight"] = torch.zeros(64, 100)
    save_file(sd, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(SpecdecError, match=r"fc\.weight is \[64, 100\], expected \[64, 128\]"):
        import_head(tmp_path / "a", tmp_path / "out")
    # a head for another target: its hidden size is refused against --model's
    write_eagle1(tmp_path / "b", head, tiny)
    other = tiny_model("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(SpecdecError, match="hidden size 64 but the target has 32"):
        import_head(tmp_path / "b", tmp_path / "out", other.lm_head.weight.detach())
    # EAGLE-3: a reduced LM head of the wrong width names lm_head.weight
    h3 = make_head3(tiny, draft_vocab=list(range(10)))
    write_eagle3(tmp_path / "c", h3)
    sd = torch.load(tmp_path / "c" / "pytorch_model.bin", weights_only=True)
    sd["lm_head.weight"] = torch.zeros(11, 64)
    torch.save(sd, tmp_path / "c" / "pytorch_model.bin")
    with pytest.raises(SpecdecError, match="lm_head.weight"):
        import_head(tmp_path / "c", tmp_path / "out", target_layers=2)


def test_unknown_format_is_one_line(tmp_path, capsys):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(d / "model.safetensors"))
    with pytest.raises(SpecdecError, match="no draft head in a known format"):
        detect(d)
    assert main(["import-head", str(d), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "known format" in err and not (tmp_path / "o").exists()
    assert main(["export-head", str(tmp_path / "missing"), "--to", "vllm", "--out", str(tmp_path / "o")]) == 2
    assert "not a directory" in capsys.readouterr().err


# ---- export ----

def test_a_gguf_target_supplies_its_lm_head_rows_to_an_export(tmp_path, monkeypatch):
    """--model a .gguf: the target keeps its blocks, and the export takes the LM head rows de-quantized."""
    from specdec.cli import interop as cli_interop
    from specdec.runtime.gguf import GGUFModel

    path, model = tiny_gguf(tmp_path / "t.gguf", "Q8_0", "llama", num_hidden_layers=8)  # no tokenizer: load stood in
    monkeypatch.setattr(cli_interop, "load_model", lambda spec, *a: (GGUFModel(spec, model.config), None, None))
    head3 = make_head3(model, draft_vocab=list(range(40)))
    save_head(head3, tmp_path / "h")
    assert main(["export-head", str(tmp_path / "h"), "--to", "vllm", "--model", str(path),
                 "--out", str(tmp_path / "v")]) == 0
    sd = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert sd["lm_head.weight"].shape == (40, 256) and sd["d2t"].shape == (40,)


def test_eagle1_for_vllm_drops_only_a_zero_bias(tiny, tmp_path):
    head = make_head(tiny, seed=1)  # no fc bias
    save_head(head, tmp_path / "h")
    assert main(["export-head", str(tmp_path / "h"), "--to", "vllm", "--out", str(tmp_path / "v")]) == 0
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["bias"] is False
    assert cfg["num_hidden_layers"] == 1 and "specdec" not in cfg and "connector" not in cfg
    sd = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert "fc.bias" not in sd and sd["fc.weight"].shape == (64, 128)
    assert not any("input_layernorm" in k or "lm_head" in k for k in sd)
    back = load_head(tmp_path / "v", 64, 97)
    same_tensors(head, back)
    assert drafts(tiny, back) == drafts(tiny, head)
    save_head(biased_head(tiny), tmp_path / "b")
    with pytest.raises(SpecdecError, match="vLLM's EAGLE-1 drops fc.bias"):
        export_head(tmp_path / "b", "vllm", tmp_path / "vb")
    assert not (tmp_path / "vb").exists()
    zero = biased_head(tiny)
    with torch.no_grad():
        zero.fc.bias.zero_()
    save_head(zero, tmp_path / "z")
    export_head(tmp_path / "z", "vllm", tmp_path / "vz")
    assert "fc.bias" not in load_file(str(tmp_path / "vz" / "model.safetensors"))


def test_eagle1_for_sglang_always_has_a_bias(tiny, tmp_path):
    head = make_head(tiny, seed=2)
    save_head(head, tmp_path / "h")
    assert export_head(tmp_path / "h", "sglang", tmp_path / "s") == "LlamaForCausalLMEagle"
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["bias"] is True
    sd = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert torch.equal(sd["fc.bias"], torch.zeros(64))
    back = load_head(tmp_path / "s", 64, 97)
    assert drafts(tiny, back) == drafts(tiny, head)
    biased = biased_head(tiny)
    save_head(biased, tmp_path / "b")
    export_head(tmp_path / "b", "sglang", tmp_path / "sb")
    torch.testing.assert_close(load_file(str(tmp_path / "sb" / "model.safetensors"))["fc.bias"], biased.fc.bias)


@pytest.mark.parametrize("to", ["vllm", "sglang"])
def test_eagle3_export_is_laid_out_for_the_engine_and_reads_back(deep, tmp_path, to):
    head = make_head3(deep, seed=4, draft_vocab=list(range(1, 97, 3)))
    save_head(head, tmp_path / "h")
    export_head(tmp_path / "h", to, tmp_path / "e")
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    sd = load_file(str(tmp_path / "e" / "model.safetensors"))
    arch = {"vllm": "Eagle3LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle3"}[to]
    assert cfg["architectures"] == [arch] and cfg["draft_vocab_size"] == 32 and cfg["bias"] is False
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    layer = "layers.0." if to == "vllm" else "midlayer."
    assert f"{layer}hidden_norm.weight" in sd and not any(k.startswith("midlayer." if to == "vllm" else "layers.")
                                                          for k in sd)
    # the file keeps the name d2t (vLLM renames it to draft_id_to_target_id on load): offsets
    assert "draft_id_to_target_id" not in sd
    assert torch.equal(sd["d2t"] + torch.arange(32), head.d2t) and int(sd["t2d"].sum()) == 32
    assert sd["lm_head.weight"].shape == (32, 64) and sd["fc.weight"].shape == (64, 192)
    back = load_head(tmp_path / "e", 64, 97)
    assert back.aux_layers == (2, 4, 5)
    same_tensors(head, back)
    assert drafts(deep, back) == drafts(deep, head)


def test_full_vocabulary_eagle3_export_needs_the_target(deep, tmp_path):
    head = make_head3(deep, seed=5)
    save_head(head, tmp_path / "h")
    with pytest.raises(SpecdecError, match="--model"):
        export_head(tmp_path / "h", "vllm", tmp_path / "e")
    lm = deep.lm_head.weight.detach()
    export_head(tmp_path / "h", "vllm", tmp_path / "e", lm)
    sd = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert torch.equal(sd["lm_head.weight"], lm) and not sd["d2t"].any()
    assert json.loads((tmp_path / "e" / "config.json").read_text())["draft_vocab_size"] == 97
    assert drafts(deep, load_head(tmp_path / "e", 64, 97)) == drafts(deep, head)


@pytest.mark.parametrize("variant,option", [("fs", "connector=sampler"), ("pad", "pad=true")])
def test_fspad_variants_are_refused_naming_the_option(tiny, tmp_path, variant, option):
    save_head(make_head(tiny, variant=variant), tmp_path / "h")
    for to in ("vllm", "sglang"):
        with pytest.raises(SpecdecError, match=option):
            export_head(tmp_path / "h", to, tmp_path / to)


def test_what_the_engines_cannot_represent_is_refused(tiny, tmp_path):
    save_head(make_head(tiny, draft_vocab=list(range(40))), tmp_path / "r")
    with pytest.raises(SpecdecError, match="draft_vocab_size=40"):
        export_head(tmp_path / "r", "sglang", tmp_path / "o")
    save_head(make_head(tiny, layers=2), tmp_path / "two")
    with pytest.raises(SpecdecError, match="--layers 2"):
        export_head(tmp_path / "two", "vllm", tmp_path / "o")
    save_head(make_head3(tiny), tmp_path / "e3")  # a 2-layer target: two aux layers
    with pytest.raises(SpecdecError, match="exactly 3 target layers"):
        export_head(tmp_path / "e3", "sglang", tmp_path / "o")
    save_medusa(make_heads(tiny), tmp_path / "m")
    with pytest.raises(SpecdecError, match="SGLang|sglang"):
        export_head(tmp_path / "m", "sglang", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_medusa_for_vllm(tiny, tmp_path):
    heads = make_heads(tiny, k=2)
    save_medusa(heads, tmp_path / "m")
    assert export_head(tmp_path / "m", "vllm", tmp_path / "v") == "MedusaModel"
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    sd = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert cfg["architectures"] == ["MedusaModel"] and cfg["num_heads"] == 2
    assert {"blocks.1.layers.0.weight", "lm_heads.1.weight"} <= set(sd)
    same_tensors(heads, import_medusa(tmp_path / "v"))
