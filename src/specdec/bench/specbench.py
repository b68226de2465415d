"""Answer files in Spec-Bench's format, so its `evaluation/speed.py` can recompute our numbers.

One JSONL per method, one line per question (the first repeat): `question_id`, `category`, `answer_id`,
`model_id`, `tstamp` and `choices[0]` = {`index`, `turns` (answer texts), `decoding_steps` (target
forwards), `new_tokens`, `wall_time` (seconds, per turn), `accept_lengths` (tokens per forward, all
turns)}. Peers that do not report their forwards get decoding_steps = new_tokens for plain decoding
and empty accept_lengths otherwise.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path


def answer_lines(records: list[dict], tokenizer, model_id: str) -> dict[str, list[dict]]:
    """method label -> Spec-Bench answer records, questions in first-seen order."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        if r.get("repeat", 0) == 0:
            by.setdefault((r["method"], r["question_id"]), []).append(r)
    out: dict[str, list[dict]] = {}
    for (method, qid), turns in by.items():
        turns.sort(key=lambda r: r["turn"])
        steps, accepts = [], []
        for r in turns:
            st = r.get("stats")
            if st and st.get("accept_lengths") is not None:
                steps.append(st["target_forwards"] + 1)  # + the prefill, which emits the first token
                accepts += st["accept_lengths"]
            else:
                plain = r.get("name") == "hf"
                steps.append(len(r["tokens"]) if plain else None)
                accepts += [1] * len(r["tokens"]) if plain else []
        out.setdefault(method, []).append({
            "question_id": qid, "category": turns[0]["category"], "answer_id": uuid.uuid4().hex[:22],
            "model_id": f"{model_id}-{method}", "tstamp": time.time(),
            "choices": [{"index": 0,
                         "turns": [tokenizer.decode(r["tokens"], skip_special_tokens=True) for r in turns],
                         "decoding_steps": steps, "new_tokens": [len(r["tokens"]) for r in turns],
                         "wall_time": [r["wall_time"] for r in turns], "accept_lengths": accepts}],
        })
    return out


def write_answers(out: Path, records: list[dict], tokenizer, model_id: str) -> None:
    d = out / "specbench"
    d.mkdir(parents=True, exist_ok=True)
    for method, lines in answer_lines(records, tokenizer, model_id).items():
        safe = "".join(c if c.isalnum() or c in "-_=." else "_" for c in method)
        (d / f"{safe}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
