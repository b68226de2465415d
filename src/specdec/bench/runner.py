"""Timing: every method in one process, warmed up, interleaved per prompt, wall time per generation.

Fairness rules (docs/design.md, "Terms"): same prompts, same max_new_tokens, same EOS set for every method; per
prompt and repeat the methods run back to back in a rotated order, so drift (thermal, another
process) spreads over all of them instead of biasing whichever runs last.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.api import from_models
from specdec.bench import metrics, report
from specdec.bench.audit import TIE_TOL, audit_groups, runner_logits
from specdec.bench.data import Question, json_record
from specdec.bench.methods import MethodSpec
from specdec.bench.ours import OurMethod, lockstep
from specdec.bench.outdir import check_out_dir, clear_out_dir
from specdec.bench.peers import build_peer
from specdec.bench.specbench import write_answers
from specdec.errors import SpecdecError
from specdec.machine import machine_info, memory_floor, peak_rss_mb, reset_peak_rss
from specdec.runtime import threads
from specdec.runtime.cpus import ContentionMeter, usable_cpus
from specdec.runtime.gguf import GGUFModel
from specdec.runtime.loading import load_like, model_for, own_precision


@dataclass
class BenchConfig:
    methods: list[MethodSpec]
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    repeats: int = 1
    timing: str = "mean"  # per prompt over repeats: "mean" (each repeat a sample) or "best" (the fastest one)
    interleave: str = "generation"  # our methods take turns per "generation", or per decoding "step" (lockstep)
    warmup: int = 1  # untimed generations per method before the first timed one
    warmup_tokens: int = 32
    threads: int | None = None  # None: all cores the process may use
    backend: str = "auto"
    weights: str | None = None  # our methods' target linear precision (None: the model's dtype)
    audit_questions: int = 3  # at T>0: greedy prompts replayed for the audit
    tie_tol: float = TIE_TOL
    progress: bool = True
    command: str = ""
    extra: dict = field(default_factory=dict)  # recorded as-is (dataset, model name, ...)


# ---------------------------------------------------------------------------------------------- methods


def build_methods(cfg: BenchConfig, model, tokenizer, draft_model=None, draft_tokenizer=None,
                  closers: contextlib.ExitStack | None = None) -> dict:
    built, targets = {}, {}
    vanilla = None
    for spec in cfg.methods:
        if spec.is_peer:
            continue
        weights = spec.weights or cfg.weights
        if spec.target is not None and spec.target not in targets:
            targets[spec.target] = load_like(spec.target, model, tokenizer)
        m = targets[spec.target] if spec.target is not None else model_for(model, weights)
        dec = from_models(m, tokenizer, spec.name, draft_model, draft_tokenizer, cfg.backend, weights=weights,
                          **spec.decoder_opts)
        built[spec.label] = OurMethod(spec, dec, dec.weights, spec.target)
        if spec.label == "vanilla":
            vanilla = dec
    if vanilla is None:
        raise SpecdecError("the benchmark needs our 'vanilla' method (the reference of the audit)")
    for spec in cfg.methods:  # the bench skips prompts longer than the target's context less max_new_tokens
        if spec.is_peer:
            built[spec.label] = build_peer(spec, model, vanilla.eos_ids, draft_model, threads=torch.get_num_threads(),
                                           n_ctx=vanilla.runner.max_length, closers=closers)
    return {s.label: built[s.label] for s in cfg.methods}


def _peak_rss(records: list[dict], label: str) -> dict:
    """Our method's peak RSS over its generations (the whole process: every loaded model counts), where read
    (a peer's records hold none: its server reports its own)."""
    peaks = [r["peak_rss_mb"] for r in records if r["method"] == label and r.get("peak_rss_mb") is not None]
    return {"peak_rss_mb": max(peaks)} if peaks else {}


def safe_name(label: str) -> str:
    return re.sub(r"[^\w.=-]+", "_", label)


# ---------------------------------------------------------------------------------------------- the run


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="gen", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def run_bench(cfg: BenchConfig, questions: list[Question], model, tokenizer, draft_model=None,
              draft_tokenizer=None, out_dir: str | os.PathLike | None = None, overwrite: bool = False) -> dict:
    """Runs everything and writes out_dir/{run.json, summary.json, audit.json, raw/*.jsonl, report.md,
    plots/*.png}. Returns {"run", "summary", "audit", "records", "prompts"}. A non-empty out_dir is
    refused unless overwrite, which clears it once the methods are built (every option checked)."""

    if not questions:
        raise SpecdecError("no questions to run")
    if cfg.repeats < 1 or cfg.max_new_tokens < 1:
        raise SpecdecError("--repeats and --max-new-tokens must be >= 1")
    if cfg.warmup < 0:
        raise SpecdecError("--warmup must be >= 0")
    if cfg.temperature < 0:
        raise SpecdecError("--temperature must be >= 0")
    if cfg.timing not in ("mean", "best") or cfg.interleave not in ("generation", "step"):
        raise SpecdecError(f"timing must be 'mean' or 'best' and interleave 'generation' or 'step', got "
                           f"timing={cfg.timing!r}, interleave={cfg.interleave!r}")
    if out_dir is not None:
        check_out_dir(Path(out_dir), overwrite)
    # threads pinned for the run: a count that followed the machine would time methods at different counts;
    # closers stop what peers started (llama-server), whatever happens
    with threads.pinned(cfg.threads or usable_cpus()), contextlib.ExitStack() as closers:
        return _run(cfg, questions, model, tokenizer, draft_model, draft_tokenizer, out_dir, overwrite, closers)


def _run(cfg, questions, model, tokenizer, draft_model, draft_tokenizer, out_dir, overwrite, closers) -> dict:
    methods = build_methods(cfg, model, tokenizer, draft_model, draft_tokenizer, closers)
    vanilla = methods["vanilla"].dec
    max_len = vanilla.runner.max_length
    out = Path(out_dir) if out_dir is not None else None
    labels = list(methods)
    started = time.time()

    def gen_seed(qi: int, turn: int) -> int:
        return cfg.seed * 1_000_003 + qi * 16 + turn

    def schema(lab: str, q: Question) -> str | None:  # what a method's answer to q must fit
        return q.json_schema if methods[lab].spec.constrained else None

    # warm-up: first calls pay for allocator growth, oneDNN primitive creation, HF's generate setup, and a
    # constrained method's grammar vocabulary (built on its first schema)
    warm = vanilla.encode([{"role": "user", "content": questions[0].turns[0]}])
    if len(warm) + cfg.warmup_tokens < max_len:
        for _ in range(cfg.warmup):
            for lab in labels:
                try:
                    _run_one(methods[lab], warm, cfg.temperature, cfg.seed,
                             min(cfg.warmup_tokens, cfg.max_new_tokens), learn=False,
                             json_schema=schema(lab, questions[0]))
                except PeerFailed as e:  # a peer that fails before anything is timed would fail every prompt
                    raise SpecdecError(f"{e} in the warm-up, before any timing: leave it out of --methods") from None

    # the physical limit beside every figure: weights streamed per target forward / this machine's bandwidth
    precisions = {lab: m.precision for lab, m in methods.items() if isinstance(m, OurMethod)}
    floors = {w: memory_floor(model_for(model, w), weights=w) for w in dict.fromkeys(precisions.values())}
    floor = floors[precisions["vanilla"]]
    n_runs = sum(len(q.turns) for q in questions) * cfg.repeats * len(labels)
    helpers = [m.proc.pid for m in methods.values() if getattr(m, "proc", None) is not None]
    meter = ContentionMeter(helpers)
    # per method too: methods take turns, so a load that came and went disturbs some of them only
    other_s, wall_s = dict.fromkeys(labels, 0.0), dict.fromkeys(labels, 0.0)
    records: list[dict] = []
    prompts: dict = {}
    asked: dict = {}  # (question_id, turn) -> its Question
    skipped: list[dict] = []
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(_progress(n_runs, cfg.progress))
        raw_files = {}
        if out is not None:
            if overwrite:
                clear_out_dir(out)
            (out / "raw").mkdir(parents=True, exist_ok=True)
            raw_files = {lab: stack.enter_context(open(out / "raw" / f"{safe_name(lab)}.jsonl", "w"))
                         for lab in labels}
        for qi, q in enumerate(questions):
            history: list[dict] = []
            for turn, text in enumerate(q.turns):
                msgs = history + [{"role": "user", "content": text}]
                ids = vanilla.encode(msgs)
                if len(ids) + cfg.max_new_tokens > max_len:
                    skipped.append({"question_id": q.question_id, "turn": turn, "prompt_tokens": len(ids),
                                    "reason": f"prompt + max_new_tokens exceeds the context ({max_len})"})
                    bar.update((len(q.turns) - turn) * cfg.repeats * len(labels))
                    break
                prompts[(q.question_id, turn)] = ids
                asked[(q.question_id, turn)] = q
                batch: list[dict] = []
                try:
                    for rep in range(cfg.repeats):
                        k = (qi + turn + rep) % len(labels)
                        order = labels[k:] + labels[:k]
                        # only the last repeat teaches a drafter that learns across requests: every
                        # repeat sees what the earlier prompts taught, none sees this prompt's answer
                        learn, seed = rep == cfg.repeats - 1, gen_seed(qi, turn)
                        ours = [lab for lab in order if isinstance(methods[lab], OurMethod)] \
                            if cfg.interleave == "step" else []
                        for group in ([ours] if ours else []) + [[lab] for lab in order if lab not in ours]:
                            bar.set_postfix_str(f"q={q.question_id} turn={turn} {'+'.join(group)}", refresh=False)
                            # our method's own peak: VmHWM restarted before its clock starts (the reset walks the
                            # page tables), read after it stops
                            alone = len(group) == 1 and isinstance(methods[group[0]], OurMethod)
                            ours_alone = alone and reset_peak_rss()
                            one, t0 = ContentionMeter(helpers), time.perf_counter()
                            if len(group) > 1:  # one step each in turn
                                got = lockstep({lab: methods[lab].start(ids, cfg.temperature, seed, cfg.max_new_tokens,
                                                                        learn, schema(lab, q)) for lab in group})
                            else:
                                got = {group[0]: _run_one(methods[group[0]], ids, cfg.temperature, seed,
                                                          cfg.max_new_tokens, learn=learn,
                                                          json_schema=schema(group[0], q))}
                            load, elapsed = one.result(), time.perf_counter() - t0
                            if ours_alone:
                                got[group[0]]["peak_rss_mb"] = peak_rss_mb()
                            for lab in group:
                                _add_load(load, elapsed, lab, other_s, wall_s)
                                batch.append({"method": lab, "name": methods[lab].spec.name,
                                              "question_id": q.question_id, "category": q.category, "turn": turn,
                                              "repeat": rep, "order": order.index(lab), "prompt_tokens": len(ids),
                                              "new_tokens": len(got[lab]["tokens"]), **got[lab],
                                              **json_record(q, schema(lab, q), got[lab]["tokens"], tokenizer)})
                                bar.update(1)
                except PeerFailed as e:  # another engine's bug costs this prompt, not the run
                    del prompts[(q.question_id, turn)]
                    skipped.append({"question_id": q.question_id, "turn": turn, "prompt_tokens": len(ids),
                                    "reason": str(e)})
                    print(f"specdec bench: question {q.question_id} turn {turn} skipped for every method: {e}",
                          file=sys.stderr)
                    bar.update((len(q.turns) - turn) * cfg.repeats * len(labels) - len(batch))
                    break
                records.extend(batch)
                for rec in batch:  # a prompt's lines land together: raw/ never holds half a prompt
                    if raw_files:
                        raw_files[rec["method"]].write(json.dumps(rec) + "\n")
                        raw_files[rec["method"]].flush()
                answer = next(r["tokens"] for r in batch if r["method"] == "vanilla")
                # MT-bench: the second turn sees the target's own first answer (our vanilla's, so
                # every method gets the same second-turn prompt)
                history = msgs + [{"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)}]
    timed_s = time.time() - started
    contention = meter.result()
    contention["by_method"] = {lab: other_s[lab] / wall_s[lab] if wall_s[lab] > 0 else None for lab in labels}

    if cfg.temperature > 0:  # how far a lossy rule drifts: the target's log-likelihood of what was sampled
        for r in records:
            if r.get("stats") is not None:
                r["stats"]["loglik_per_token"] = answer_loglik(model, prompts[(r["question_id"], r["turn"])],
                                                               r["tokens"], vanilla.runner)
    # losslessness audit: at T=0 the timed outputs themselves; at T>0 a greedy replay of a few prompts
    if cfg.temperature == 0:
        audit_recs = records
    else:
        audit_recs = []
        for key in list(prompts)[: cfg.audit_questions]:
            for lab in labels:
                r = _run_one(methods[lab], prompts[key], 0.0, 0, cfg.max_new_tokens,
                             json_schema=schema(lab, asked[key]))
                audit_recs.append({"method": lab, "question_id": key[0], "turn": key[1], "repeat": 0,
                                   "tokens": r["tokens"]})
    # peers on other weights than our methods' (llama.cpp; hf when --weights differs) are not audited; each
    # of our methods is audited against the vanilla of its own precision
    own = own_precision(model)
    other = (cfg.weights or own) != own
    exclude = {s.label for s in cfg.methods if not s.audited or (s.is_peer and other)}
    schemas = any(q.json_schema for q in questions)
    groups = _audit_groups(methods, precisions, model, own, schemas)
    # in-process HF peers answer freely: under schemas their reference is a free vanilla of the run's own
    # weights, if one ran
    free = (precisions["vanilla"], None, False)
    ref = next((r for r in groups if _audit_key(methods, precisions, r, schemas) == free), None) \
        if schemas else "vanilla"
    if ref is not None:
        groups[ref][0].extend(lab for lab in labels if lab not in precisions)
    # a method in no group (a free one without a free vanilla): not audited, its agreement is reported
    exclude |= set(labels) - set(groups) - {lab for members, _ in groups.values() for lab in members}
    aud = audit_groups(audit_recs, prompts, groups, cfg.tie_tol, exclude=exclude)
    n_replay = min(cfg.audit_questions, len(prompts))
    aud["mode"] = "timed outputs (T=0)" if cfg.temperature == 0 else f"greedy replay of {n_replay} prompts (T>0 run)"

    timed = metrics.fastest_repeats(records) if cfg.timing == "best" else records
    # under schemas the HF peers answer freely: the constrained vanilla is the baseline
    baseline = metrics.choose_baseline(timed, ("vanilla",) if schemas else ("hf", "vanilla"))
    summary = metrics.summarize(timed, baseline, "vanilla")
    for lab, agr in aud["agreement"].items():  # peers outside the audit: their agreement with vanilla
        if lab in summary:
            summary[lab][metrics.OVERALL]["agreement"] = agr
    totals = {c: sum(r["wall_time"] for r in records if r["method"] == c) for c in ("hf", "vanilla")}
    run = {
        "command": cfg.command, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "duration_s": time.time() - started, "timed_s": timed_s,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("methods", "progress")},
        "methods": [{"label": s.label, "name": s.name, "opts": s.opts, "peer": s.is_peer, "audited": s.audited,
                     "lossy": s.lossy, "constrained": schemas and s.constrained,
                     **({"precision": precisions[s.label]} if s.label in precisions else {}),
                     **({"target": s.target} if s.target else {}),
                     **({"weights": methods[s.label].weights} if hasattr(methods[s.label], "weights") else {}),
                     **_peak_rss(records, s.label)}
                    for s in cfg.methods],
        "questions": len(questions), "generations": len(records), "skipped": skipped,
        "categories": list(dict.fromkeys(q.category for q in questions)),
        "baseline": baseline, "baseline_candidates_total_s": totals, "contention": contention, "floor": floor,
        "floors": floors,
        "machine": machine_info(), "target": _model_info(model, vanilla.runner),
        "draft": _model_info(draft_model, None) if draft_model is not None else None,
    }
    result = {"run": run, "summary": summary, "audit": aud, "records": records, "prompts": prompts}
    if out is not None:
        (out / "run.json").write_text(json.dumps(run, indent=1, default=str))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "audit.json").write_text(json.dumps(aud, indent=1))
        report.write_report(out, run, summary, aud)
        write_answers(out, records, tokenizer, run["target"].get("name_or_path") or run["target"]["model_type"])
    return result


class PeerFailed(Exception):
    """A peer (another engine) raised on one prompt."""


def _add_load(c: dict, wall: float, lab: str, other_s: dict, wall_s: dict) -> None:
    if c.get("other_cpu_frac") is not None:  # None: no /proc/stat to read
        other_s[lab] += c["other_cpu_frac"] * wall
        wall_s[lab] += wall


def _run_one(method, ids: list[int], temperature: float, seed: int, max_new: int, learn: bool = True,
             json_schema: str | None = None) -> dict:
    if isinstance(method, OurMethod):  # our bugs stop the run: they must be seen
        return method.run(ids, temperature, seed, max_new, learn, json_schema)
    # a peer that cannot apply a schema never gets one (MethodSpec.constrained)
    schema = {"json_schema": json_schema} if json_schema is not None else {}
    try:
        return method.run(ids, temperature, seed, max_new, **schema)
    except Exception as e:  # noqa: BLE001 - any failure of another engine on one prompt
        raise PeerFailed(f"{method.spec.label} failed on it ({type(e).__name__}: {str(e)[:200]})") from e


def _audit_key(methods: dict, precisions: dict, lab: str, schemas: bool) -> tuple:
    """What a method is lossless relative to: the target's precision, the target, whether a schema applied."""
    return precisions[lab], methods[lab].target, schemas and methods[lab].spec.constrained


def _audit_groups(methods: dict, precisions: dict, model, own: str, schemas: bool = False) -> dict:
    """reference label -> (our labels on its precision, target and constraint, what judges a tie): `vanilla`'s
    group first. A tie is judged by the HF model when the precision and target are the run's own, else by that
    vanilla's runner. Under schemas (the extraction set) a free method's reference is a free vanilla
    (`vanilla:constrained=false`); without one it has none (it is in no group)."""
    key = {lab: _audit_key(methods, precisions, lab, schemas) for lab in precisions}
    refs = {}
    for lab, k in key.items():
        if methods[lab].spec.name == "vanilla" and k not in refs.values():
            refs[lab] = k
    refs = {"vanilla": key["vanilla"], **{r: k for r, k in refs.items() if r != "vanilla"}}
    groups = {}
    for ref, k in refs.items():
        members = [lab for lab, kk in key.items() if kk == k and lab != ref]
        hf_judge = k[:2] == (own, None) and not isinstance(model, GGUFModel)  # a GGUF model has no HF forward
        groups[ref] = (members, model if hf_judge else runner_logits(methods[ref].dec.runner))
    return groups


@torch.inference_mode()
def answer_loglik(model, prompt_ids: list[int], answer: list[int], runner=None) -> float | None:
    """Mean log p_target(x_t | x_<t) (T = 1) over the answer tokens: one teacher-forced forward (HF's;
    a GGUF model has none: `runner`'s, our vanilla's, from an empty cache)."""
    if not answer:
        return None
    dev = next(model.parameters()).device
    ids = list(prompt_ids) + list(answer)
    if isinstance(model, GGUFModel):
        runner.reset()
        try:
            logits = runner.forward(torch.tensor(ids), logits_rows=slice(len(prompt_ids) - 1, len(ids) - 1)).logits
        finally:
            runner.reset()
    else:
        logits = model(torch.tensor([ids], device=dev)).logits[0, len(prompt_ids) - 1:-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(answer, device=dev)[:, None])
    return float(lp.mean())


def _model_info(model, runner) -> dict:
    cfg = model.config
    p = next(model.parameters())
    gguf = isinstance(model, GGUFModel)  # its parameters() are only the float tensors (norms)
    return {
        "name_or_path": getattr(cfg, "_name_or_path", "") or "", "model_type": cfg.model_type,
        "parameters": model.n_params if gguf else sum(t.numel() for t in model.parameters()),
        "dtype": f"GGUF blocks ({model.block_types})" if gguf else str(p.dtype).replace("torch.", ""),
        "device": str(p.device), "runner": type(runner).__name__ if runner is not None else None,
        "vocab_size": getattr(cfg, "vocab_size", None),
    }
