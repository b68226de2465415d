"""The extraction set (`bench --dataset extraction`): 40 prompts built from the shipped files, each with its
JSON schema; constrained methods apply it and their answers fit it, `constrained=false` answers freely and
is audited only against a free vanilla; llama-server gets the schema in its request."""

import json

import jsonschema
import pytest

from specdec.bench import llamacpp
from specdec.bench.data import EXTRACTION, check_json, load_questions, read_jsonl, truncate
from specdec.bench.methods import parse_methods
from specdec.bench.runner import BenchConfig, run_bench
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.grammar import compile_grammar
from tests.helpers import ascii_tokenizer, tiny_model


@pytest.fixture(scope="module")
def ascii_models():
    tok = ascii_tokenizer()
    return tiny_model("llama", vocab_size=len(tok), max_position_embeddings=4096), tok


@pytest.fixture(scope="module")
def two_questions():
    """A news article and a GSM8K problem: their answers are bounded, a random model's end within 1,400 tokens."""
    qs = load_questions("extraction")
    return [next(q for q in qs if q.category == c) for c in ("news", "gsm8k")]


def test_the_extraction_set_is_forty_prompts_built_the_same_way_each_time():
    qs, again = load_questions("extraction"), load_questions("extraction")
    assert qs == again and len(qs) == 40 == sum(n for _, n, _ in EXTRACTION.values())
    assert [q.category for q in qs] == [c for c, (_, n, _) in EXTRACTION.items() for _ in range(n)]
    assert len({q.question_id for q in qs}) == 40 and len({q.json_schema for q in qs}) == 3
    for q in qs:
        schema = json.loads(q.json_schema)
        jsonschema.Draft202012Validator.check_schema(schema)
        compile_grammar("json_schema", q.json_schema)  # the grammar the constrained methods run
        (prompt,) = q.turns
        passage = prompt.split("\n\nText:\n", 1)[1]
        assert len(passage.split()) >= 10 and len(passage) <= 1210, q.question_id
        assert "x-guidance" not in prompt and json.dumps(schema["properties"]) in prompt  # the model sees the schema
    assert load_questions("extraction", categories=["gsm8k"], limit=2) == qs[32:34]


def test_truncate_cuts_at_a_word():
    assert truncate("a  b\nc", 100) == "a b c"
    assert truncate("alpha beta gamma", 12) == "alpha beta ..."


def test_a_record_may_carry_its_schema_and_a_bad_one_is_one_line(tmp_path):
    p = tmp_path / "q.jsonl"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    p.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Give a."], "json_schema": schema}) + "\n"
                 + json.dumps({"question_id": 2, "category": "x", "turns": ["Free."]}) + "\n")
    a, b = read_jsonl(p)
    assert json.loads(a.json_schema) == schema and b.json_schema is None
    p.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["?"], "json_schema": "{nope"}) + "\n")
    with pytest.raises(SpecdecError, match=r"q.jsonl:1: json_schema is not JSON") as e:
        read_jsonl(p)
    assert "\n" not in str(e.value)


def test_check_json_parses_and_validates():
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    assert check_json('{"n": 3}', schema) == {"parses": True, "valid": True}
    assert check_json('{"n": "3"}', schema) == {"parses": True, "valid": False}
    assert check_json('{"n": 3', schema) == {"parses": False, "valid": False}


@pytest.mark.slow  # 1,400-token answers
def test_constrained_answers_fit_their_schemas_and_a_free_method_is_audited_only_against_a_free_vanilla(
        ascii_models, two_questions, tmp_path):
    target, tok = ascii_models
    specs = parse_methods("vanilla,pld,pld:constrained=false", False)
    cfg = BenchConfig(specs, max_new_tokens=1400, warmup=0, progress=False, threads=1)
    res = run_bench(cfg, two_questions, target, tok, out_dir=tmp_path / "o")
    free = "pld:constrained=false"
    by = {(r["method"], r["question_id"]): r for r in res["records"]}
    for q in two_questions:
        for m in ("vanilla", "pld"):
            r = by[m, q.question_id]
            assert r["constrained"] and r["json"] == {"parses": True, "valid": True}, m
            assert r["stats"]["finish_reason"] != "length"
            answer = json.loads(tok.decode(r["tokens"], skip_special_tokens=True))
            jsonschema.validate(answer, json.loads(q.json_schema))
        for m in (free, "hf"):  # a random model without the grammar writes no JSON
            assert not by[m, q.question_id]["constrained"] and not by[m, q.question_id]["json"]["parses"]
    aud = res["audit"]
    assert aud["ok"] and aud["checked"] == 2 and aud["references"] == {"pld": "vanilla"}
    assert aud["not_audited"] == ["hf", free] and res["run"]["baseline"] == "vanilla"  # hf answers freely
    s = res["summary"]
    assert s["pld"]["overall"]["json_valid"] == 1.0 and s[free]["overall"]["json_parses"] == 0.0
    assert s["vanilla"]["overall"]["mask_ms_per_step"] > 0 and 0 < s["vanilla"]["overall"]["mask_frac"] < 1
    assert "mask_frac" not in s[free]["overall"]
    raw = [json.loads(x) for x in (tmp_path / "o" / "raw" / "pld.jsonl").read_text().splitlines()]
    assert [r["json"]["valid"] for r in raw] == [True, True]
    md = (tmp_path / "o" / "report.md").read_text()
    assert "## Structured output" in md and f"| `{free}` | free | 0% | 0% |" in md
    assert "| `pld` | applied | 100% | 100% |" in md

    # with a free vanilla the free method has its reference, and so do the HF peers
    specs = parse_methods("vanilla,vanilla:constrained=false,pld:constrained=false", False)
    res = run_bench(BenchConfig(specs, max_new_tokens=8, warmup=0, progress=False, threads=1), two_questions[1:],
                    target, tok)
    assert res["audit"]["ok"] and res["audit"]["references"] == {free: "vanilla:constrained=false",
                                                                 "hf": "vanilla:constrained=false"}
    assert res["audit"]["not_audited"] == []


def test_llama_server_gets_the_schema_unless_unconstrained():
    schema = json.dumps({"type": "object"})
    body = llamacpp.request_body([5, 6], 0.0, 3, 16, schema)
    assert body["json_schema"] == {"type": "object"} and body["prompt"] == [5, 6] and body["n_predict"] == 16
    assert "json_schema" not in llamacpp.request_body([5, 6], 0.0, 3, 16)
    assert llamacpp.LlamaServerOptions.parse({}).constrained is True


def test_llama_server_spec_says_whether_it_applies_the_schema(monkeypatch):
    monkeypatch.setattr(llamacpp, "installed", lambda name: True)
    on, off = parse_methods("llamacpp-server:gguf=q4_1,llamacpp-server:gguf=q4_1:constrained=false", False)[-2:]
    assert on.constrained and not off.constrained
    assert not parse_methods("hf", False)[1].constrained  # the HF peers never apply one
    with pytest.raises(SpecdecError, match="constrained"):
        parse_methods("llamacpp-server:constrained=maybe", False)
    with pytest.raises(SpecdecError, match="unknown option 'constrained'"):  # the binding's peers cannot
        parse_methods("llamacpp:constrained=true", False)


@pytest.mark.parametrize("argv, msg", [
    (["--dataset", "extraction", "--methods", "auto:constrained=maybe"],
     "option 'constrained' in method 'auto:constrained=maybe': must be true or false, got 'maybe'"),
    (["--methods", "pld:constrained=false"],
     "option 'constrained' in method 'pld:constrained=false': these questions carry no JSON schema"),
])
def test_cli_bad_constrained_option_is_one_line(tmp_path, capsys, argv, msg):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["x"]}) + "\n")
    args = ["bench", "--out", str(tmp_path / "o"), *argv]
    if "extraction" not in argv:
        args += ["--questions", str(q)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error:") and msg in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_cli_runs_the_extraction_set(ascii_models, tmp_path, monkeypatch, capsys):
    target, tok = ascii_models
    import specdec.bench.cli as bench_cli

    monkeypatch.setattr(bench_cli, "load_model", lambda spec, *a, **k: (target, tok, None))
    out = tmp_path / "res"
    rc = main(["bench", "--dataset", "extraction", "--categories", "gsm8k", "--limit", "1", "--demo", "--methods",
               "vanilla,pld:constrained=false", "--max-new-tokens", "6", "--threads", "1", "--no-progress",
               "--warmup", "0", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "losslessness audit: PASS" in text and "  vanilla: constrained, JSON 0%" in text  # 6 tokens: cut short
    assert "  pld:constrained=false: free, JSON 0%" in text and "free of the schema" in text
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["extra"]["dataset"] == "extraction" and run["questions"] == 2
    assert {m["label"]: m["constrained"] for m in run["methods"]} == {"vanilla": True, "pld:constrained=false": False}
    # the demo prompt carries no schema: no JSON check, and vanilla still counts as constrained
    recs = [json.loads(x) for x in (out / "raw" / "vanilla.jsonl").read_text().splitlines()]
    assert [("json" in r, r.get("constrained")) for r in recs] == [(False, None), (True, True)]
    assert json.loads((out / "summary.json").read_text())["vanilla"]["overall"]["constrained"] is True
