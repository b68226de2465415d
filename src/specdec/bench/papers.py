"""`specdec bench --preset papers-table`: the EAGLE-2 paper's Table 1 on this target.

Methods SpS, PLD, Medusa, Lookahead, Hydra, EAGLE, EAGLE-2 (the paper's), FSPAD and auto, over the paper's
Spec-Bench columns we have prompts for: MT-bench, HumanEval, GSM8K, CNN/DM (Spec-Bench's summarization) and
Natural Questions (Spec-Bench's qa). Alpaca is dropped: no installable package ships its prompts (the
alpaca-eval wheel holds evaluator configs and leaderboards; its instructions come from the Hugging Face hub).
A method without what it needs (SpS: --draft; a head method: a head, given or shipped for this target) is
N/A. Lookahead runs with its authors' setting (PAPER_SETTINGS). Each cell is the speedup vs our vanilla and
τ; the published Vicuna-7B row sits under ours, and Kendall's τ compares the two orderings of the methods by
mean speedup. At T > 0 Medusa's and Hydra's typical acceptance join as extra rows, marked LOSSY.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.data import MT_BENCH_CATEGORIES, Question, load_questions
from specdec.bench.methods import MethodSpec, parse_method
from specdec.errors import SpecdecError
from specdec.files import packaged_data_dir
from specdec.heads.shipped import find_shipped_head, shipped_targets

# (question source, column): our category key -> the paper's column name
COLUMNS = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "cnn_dm": "CNN/DM",
           "natural_questions": "Natural Ques."}
METHODS = {"sps": "SpS", "pld": "PLD", "medusa": "Medusa", "lookahead": "Lookahead", "hydra": "Hydra",
           "eagle": "EAGLE", "eagle2": "EAGLE-2", "fspad": "FSPAD", "auto": "auto"}
HEAD_OPTION = {"medusa": "heads", "hydra": "heads", "eagle": "head", "eagle2": "head", "fspad": "head"}
SHIPPED_KIND = {"medusa": "medusa", "hydra": "hydra", "eagle": "eagle", "eagle2": "eagle", "fspad": "fspad"}
# the authors' settings where a method's default is sized for this machine instead: Lookahead's paper runs 7B
# targets with W 7, N 5, G 7 and the pool seeded from the prompt
PAPER_SETTINGS = {"lookahead": "lookahead:window=7:ngram_size=5:guesses=7"}
LOSSY = ("medusa", "hydra")  # their typical acceptance: extra rows at T > 0
PUBLISHED = "papers/eagle2_table1_vicuna7b.json"
NO_HEAD = "no head for this target (pass --methods {m}:{opt}=DIR)"
# flags that pick questions another way
OWN_QUESTIONS = ("dataset", "questions", "categories", "limit", "last", "per_category", "quick", "demo")


@dataclass
class Plan:
    questions: list[Question]
    specs: dict[str, MethodSpec]  # paper method -> its spec (user options applied)
    na: dict[str, str] = field(default_factory=dict)  # paper method -> why it does not run

    def methods_at(self, temperature: float) -> list[MethodSpec]:
        """The specs to time at this temperature: the available methods, plus the lossy extra rows at T > 0."""
        out = [s for m, s in self.specs.items() if m not in self.na]
        if temperature > 0:
            out += [parse_method(self.lossy_label(m)) for m in LOSSY if m not in self.na and not self.specs[m].lossy]
        return out

    def lossy_label(self, method: str) -> str:
        return self.specs[method].label + ":typical=true"


def questions(per_column: int) -> list[Question]:
    """`per_column` questions per column, ids prefixed by the column (the sources' ids overlap)."""
    sb = load_questions("spec_bench")
    mt = [q for q in sb if q.category in MT_BENCH_CATEGORIES]
    rank = {}
    for q in mt:  # round robin over MT-bench's categories: n questions from n different categories
        rank[q.question_id] = (sum(p.category == q.category for p in mt[:mt.index(q)]),
                               MT_BENCH_CATEGORIES.index(q.category))
    picked = {
        "mt_bench": sorted(mt, key=lambda q: rank[q.question_id])[:per_column],
        "humaneval": load_questions("humaneval")[:per_column],
        "gsm8k": load_questions("gsm8k")[:per_column],
        "cnn_dm": [q for q in sb if q.category == "summarization"][:per_column],
        "natural_questions": [q for q in sb if q.category == "qa"][:per_column],
    }
    return [Question(f"{col}/{q.question_id}", col, q.turns) for col, qs in picked.items() for q in qs]


def plan(args, has_draft: bool) -> Plan:
    """Questions and methods, checked before any model loads. --methods gives options to the table's
    methods by name (hydra:heads=DIR, fspad:head=DIR, sps:gamma=4) and nothing else."""
    given = [f"--{k.replace('_', '-')}" for k in OWN_QUESTIONS if getattr(args, k, None) not in (None, False)]
    if given:
        raise SpecdecError(f"--preset papers-table picks its own questions (--per-task N per column): drop "
                           f"{', '.join(given)}")
    specs = {m: parse_method(PAPER_SETTINGS[m]) if m in PAPER_SETTINGS else MethodSpec(m, {}, m) for m in METHODS}
    for text in (args.methods or "").split(","):
        if text.strip():
            s = parse_method(text)
            if s.name not in METHODS:
                raise SpecdecError(f"--preset papers-table: --methods names options of its methods "
                                   f"({', '.join(METHODS)}), not {s.name!r}")
            specs[s.name] = s
    p = Plan(questions(args.per_task or 1), specs)
    if not has_draft:
        p.na["sps"] = "no draft model (--draft)"
    if "head" not in specs["fspad"].opts and not shipped_targets("fspad"):  # no head: its options do not parse
        p.na["fspad"] = NO_HEAD.format(m="fspad", opt="head")
    return p


def check_heads(p: Plan, model) -> None:
    """Mark N/A the head methods with no head given and none shipped for this target."""
    for m, opt in HEAD_OPTION.items():
        if opt in p.specs[m].opts or m in p.na:
            continue
        kind = SHIPPED_KIND.get(m)
        if kind is None or find_shipped_head(model, kind) is None:
            p.na[m] = NO_HEAD.format(m=m, opt=opt)


def model_label(model: str | None) -> str:
    """The table's Model column: the file or directory name, not its path."""
    if not model:
        return "SmolLM2-135M-Instruct"
    return Path(model.rstrip("/")).name.removesuffix(".gguf")


def published() -> dict:
    return json.loads((packaged_data_dir() / PUBLISHED).read_text())


def kendall(paper: dict[str, float], ours: dict[str, float]) -> tuple[float | None, list[str]]:
    """Kendall's τ-b between the two orderings of the methods both have; None under 2 of them or a tie
    everywhere."""
    common = [m for m in paper if m in ours]
    if len(common) < 2:
        return None, common
    from scipy.stats import kendalltau  # here, not at import: scipy.stats costs ~1 s of every CLI start-up

    tau = kendalltau([paper[m] for m in common], [ours[m] for m in common]).statistic
    return (None if math.isnan(tau) else float(tau)), common


def _cell(speedup, tau) -> list[str]:
    ok = lambda x: x is not None and not (isinstance(x, float) and math.isnan(x))  # noqa: E731
    return [f"{speedup:.2f}x" if ok(speedup) else "—", f"{tau:.2f}" if ok(tau) else "—"]


def table(p: Plan, summaries: dict[float, dict], model_name: str) -> str:
    """The Markdown table, one block per temperature: our rows, then the paper's V 7B rows, then Kendall's τ."""
    pub = published()
    cols = list(COLUMNS)
    head = ["Model", "Method"] + [x for c in cols for x in (f"{COLUMNS[c]} speedup", "τ")] + ["Mean speedup", "τ"]
    md = ["# The EAGLE-2 paper's Table 1 on this target", "",
          "Speedup vs our vanilla (wall time per token) and τ (tokens per target forward) per Spec-Bench column; "
          "Mean: over the columns shown. The published rows: " + pub["source"] + ". Alpaca is not run: no "
          "installable package ships its prompts.", ""]
    for t, summary in summaries.items():
        rows, ours_mean = [], {}
        for m, name in METHODS.items():
            label = p.specs[m].label
            if m in p.na:
                rows.append([model_name, name] + ["N/A"] * (2 * len(cols) + 2))
                continue
            rows.append([model_name, name] + _our_cells(summary.get(label, {}), cols, ours_mean, m))
            lossy = p.lossy_label(m)
            if t > 0 and m in LOSSY and lossy in summary:
                rows.append([model_name, f"{name} typical (LOSSY)"] + _our_cells(summary[lossy], cols, {}, m))
        paper = pub["rows"].get(f"{t:g}", {})
        keep = [pub["columns"].index(COLUMNS[c]) for c in cols] + [len(pub["columns"]) - 1]
        for m, cells in paper.items():
            rows.append(["V 7B (paper)", METHODS[m]] + [x for i in keep for x in _cell(*cells[i])])
        md += [f"## Temperature={t:g}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        md += ["| " + " | ".join(r) + " |" for r in rows]
        md.append("")
        na = [f"{METHODS[m]}: {why}" for m, why in p.na.items()]
        if na:
            md += ["N/A: " + "; ".join(na) + ".", ""]
        tau, common = kendall({m: c[-1][0] for m, c in paper.items()}, ours_mean)
        names = ", ".join(METHODS[m] for m in common)
        md += ["Kendall's τ between the paper's ordering of methods by mean speedup and ours: "
               + (f"{tau:.2f} over {len(common)} methods ({names})." if tau is not None else
                  f"not defined ({len(common)} methods in common: {names or 'none'})."), ""]
    return "\n".join(md)


def _our_cells(cells: dict, cols: list[str], means: dict, method: str) -> list[str]:
    sp = [cells[c].get("speedup_vs_vanilla") if c in cells else None for c in cols]
    tau = [cells[c].get("tau") if c in cells else None for c in cols]
    have = [(s, x) for s, x in zip(sp, tau) if s is not None and not math.isnan(s)]
    mean_sp = sum(s for s, _ in have) / len(have) if have else None
    taus = [x for _, x in have if x is not None]
    mean_tau = sum(taus) / len(taus) if taus else None
    if mean_sp is not None:
        means[method] = mean_sp
    return [x for s, x in zip(sp, tau) for x in _cell(s, x)] + _cell(mean_sp, mean_tau)
