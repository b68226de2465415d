"""`specdec bench serve` on a tiny model: the load table's shape with every request completed, and the
soak (clients leaving mid-stream, malformed bodies) with every answer equal to the request alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.bench.load import soak_plan, with_long
from specdec.bench.load_report import Result, markdown, percentile, ratios
from specdec.cli import main
from specdec.cli.commands import build_parser
from specdec.errors import SpecdecError
from tests.helpers import tiny_model, word_tokenizer

WORDS = [f"w{i}" for i in range(95)]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", seed=2).save_pretrained(d)
    tok = word_tokenizer(WORDS)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(d)
    q = d / "questions.jsonl"  # repetitive prompts: prompt lookup's drafts get accepted
    q.write_text("".join(json.dumps({"question_id": i, "category": "writing",
                                     "turns": [" ".join(f"w{(i + k) % 7 + 3}" for k in range(4 + i))]}) + "\n"
                         for i in range(5)))
    long = d / "long.jsonl"  # a few prefill chunks each, joining while other answers stream
    long.write_text("".join(json.dumps({"question_id": i, "category": "long",
                                        "turns": [" ".join(f"w{(i * 5 + 3 * k) % 90}" for k in range(300))]}) + "\n"
                            for i in range(2)))
    return d


def bench(tiny_dir, out, capsys, *flags):
    """`specdec bench serve` through main() in this process (its servers are processes of their own):
    (exit code, stdout, stderr, the results it wrote)."""
    code = main(["bench", "serve", "--model", str(tiny_dir), "--questions", str(tiny_dir / "questions.jsonl"),
                 "--out", str(out), *flags])
    got = capsys.readouterr()
    results = json.loads((out / "load.json").read_text())["results"] if (out / "load.json").exists() else []
    return code, got.out, got.err, results


def test_percentiles_and_the_soak_plan():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)
    assert percentile([], 0.5) is None
    plan = soak_plan(400, 20, 7, left=0.1, malformed=0.05, seed=1)
    leavers = {i % 20 for i, (k, _) in enumerate(plan) if k == "left"}
    assert len(leavers) == 2  # 10% of the clients, each on every request it sends
    assert 0.02 < sum(k == "malformed" for k, _ in plan) / 400 < 0.09
    assert {p for _, p in plan} == set(range(7))
    mixed = with_long([("ok", i % 5) for i in range(64)], 5, 3, 8)
    at = [i for i, (_, p) in enumerate(mixed) if p >= 5]
    assert len(mixed) == 72 and [mixed[i][1] for i in at] == [5, 6, 7, 5, 6, 7, 5, 6]  # the long prompts in turn
    assert min(b - a for a, b in zip(at, at[1:])) >= 8 and at[0] >= 3 and at[-1] <= 68  # spread through the plan
    assert [x for x in mixed if x[1] < 5] == [("ok", i % 5) for i in range(64)]


def result(method, limit, tps, p50, rnd):
    return Result(method, limit, 8, 8, 0, tps, p50, p50, p50, float(limit), 1.0, 1.0, round=rnd)


def test_ratios_pair_each_method_with_the_first_in_the_same_round_and_limit():
    rs = [result("vanilla", 4, 100.0, 10.0, 1), result("auto", 4, 130.0, 8.0, 1),
          result("vanilla", 4, 50.0, 20.0, 2), result("auto", 4, 75.0, 12.0, 2),
          result("vanilla", 8, 200.0, 5.0, 1), result("auto", 8, 220.0, 5.0, 1)]
    got = ratios(rs)
    assert [(lim, m) for lim, m, _, _ in got] == [(4, "auto"), (8, "auto")]
    assert got[0][2] == pytest.approx([1.3, 1.5]) and got[0][3] == pytest.approx((0.8 + 0.6) / 2)
    assert got[1][2] == pytest.approx([1.1]) and got[1][3] == pytest.approx(1.0)
    md = markdown(rs).splitlines()
    assert md[0].startswith("| round | method |") and md[2].startswith("| 1 | vanilla | 4 |")
    assert "| 4 | auto | 1.30, 1.50 | 1.40 | 0.70 |" in md
    assert ratios(rs[:1]) == [] and len(markdown(rs[:1]).splitlines()) == 3  # no pair: no ratio table


@pytest.mark.slow
def test_load_bench_table_and_every_request_completed(tiny_dir, tmp_path, capsys):
    code, out, err, results = bench(tiny_dir, tmp_path / "out", capsys, "--methods", "vanilla,pld", "--limits", "1,3",
                                    "--clients", "4", "--requests", "8", "--max-tokens", "64", "--long", "2",
                                    "--long-questions", str(tiny_dir / "long.jsonl"))
    assert code == 0, err
    # at each limit the methods in turn, so each pair ran on the same machine
    assert [(x["method"], x["max_batch"]) for x in results] == [("vanilla", 1), ("pld", 1), ("vanilla", 3), ("pld", 3)]
    for x in results:
        assert x["completed"] == x["requests"] == 10 and x["long_requests"] == 2 and x["errors"] == 0
        assert x["tokens_per_s"] > 0 and x["p50_latency_s"] <= x["p99_latency_s"]
        assert 0 < x["p50_ttft_s"] <= x["p99_ttft_s"] and 0 < x["p50_itl_s"] <= x["p99_itl_s"] <= x["max_itl_s"]
        assert x["rss_before_mb"] > 0 and x["rss_after_mb"] > 0
        assert 1 <= x["mean_batch"] <= x["max_batch"]
        if x["method"] == "vanilla":  # no drafts: no acceptance to report
            assert x["mean_acceptance_length"] is None and x["acceptance_rate"] is None
        else:  # repetitive prompts: some of prompt lookup's drafts are accepted
            assert 0 < x["acceptance_rate"] <= 1 and x["mean_acceptance_length"] > 1
    lines = (tmp_path / "out" / "load.md").read_text().splitlines()
    assert lines[0].startswith("| method | max batch | requests | long | completed | errors | tok/s |")
    assert len(lines) == 11
    assert lines[9].startswith("| 1 | pld | ") and lines[10].startswith("| 3 | pld | ")  # pld over vanilla per limit
    assert out.splitlines() == lines
    assert markdown([Result(**x) for x in results]).splitlines() == lines


@pytest.mark.slow
def test_soak_every_answer_equals_the_request_alone(tiny_dir, tmp_path, capsys):
    code, _, err, results = bench(tiny_dir, tmp_path / "out", capsys, "--soak", "--methods", "pld", "--limits", "4",
                                  "--clients", "8", "--requests", "60", "--max-tokens", "16", "--malformed", "0.1",
                                  "--long", "3", "--long-questions", str(tiny_dir / "long.jsonl"))
    assert code == 0, err
    [x] = results
    s = x["soak"]
    assert s["server_alive"] and s["mismatched"] == 0 and x["errors"] == 0
    assert s["left"] > 0 and s["malformed_rejected"] > 0
    assert s["checked"] == x["completed"] == 63 - s["left"] - s["malformed_rejected"]
    assert "rss_growth_mb" in s


@pytest.mark.parametrize("flags,message", [
    (["--methods", "vanila"], "unknown method 'vanila'"),
    (["--methods", "auto:depth=0"], "depth"),
    (["--limits", "1,x"], "--limits expects a comma list of integers"),
    (["--server-args", "--threads '2"], "--server-args"),
    (["--long-questions", "/no/such/long.jsonl"], "/no/such/long.jsonl"),
])
def test_bad_input_is_one_line_before_any_server_starts(flags, message, tmp_path):
    args = build_parser().parse_args(["bench", "serve", "--out", str(tmp_path / "out"), *flags])
    with pytest.raises(SpecdecError, match=message):
        args.func(args)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_sigterm_finishes_the_stream_in_flight_and_exits_0(tiny_dir, tmp_path):
    """`specdec serve` decodes on its main thread and serves HTTP on another; SIGTERM stops accepting,
    lets the stream in flight end with [DONE], then the process exits 0."""
    import http.client
    import signal

    from specdec.bench.load import ServerProcess

    server = ServerProcess(str(tiny_dir), "vanilla", 2, [], tmp_path / "serve.log", timeout=120)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"model": str(tiny_dir), "messages": [{"role": "user", "content": "w3 w4 w5"}], "max_tokens": 400,
                "temperature": 0, "stream": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()
        assert first.startswith(b"data: ")
        server.proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        chunks = [json.loads(line[6:]) for line in [first.decode(), *rest.splitlines()]
                  if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_a_port_in_use_is_one_line_and_exit_2(tiny_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        r = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--model", str(tiny_dir), "--port",
                            str(port)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2
    assert f"specdec serve could not listen on 127.0.0.1:{port}" in r.stderr.splitlines()[-1]
