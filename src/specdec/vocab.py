"""A draft's reduced vocabulary (FR-Spec, Zhao et al. 2025): the token ids a draft model's LM head scores.

A small draft model spends much of its step on its LM head (Qwen2.5's 151,936 rows are 37% of the 0.5B's
bytes per token), yet it proposes almost only frequent tokens. Scoring the N most frequent ids cuts that
share by vocab / N; a token outside them is never drafted, which costs acceptance only: the target verifies
every draft, so the output does not change.

Frequencies come from text shipped with the package (GSM8K's training problems and solutions) and the
Python standard library's own sources (code), never from benchmark prompts; counted once per tokenizer and
cached.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import torch

from specdec.files import atomic_file, cache_dir, find_data

CODE_BYTES = 4_000_000  # of standard-library sources: about as much code as GSM8K's 4 MB of prose and math
CORPUS_VERSION = 1  # bump when the corpus changes: cached counts are keyed by it


def _corpus() -> list[str]:
    texts = []
    train = find_data("gsm8k/train.jsonl")
    if train is not None:
        for line in train.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                texts.append(rec.get("question", "") + "\n" + rec.get("answer", ""))
    lib, size = Path(sysconfig.get_paths()["stdlib"]), 0
    for f in sorted(lib.glob("*.py")):  # the top-level modules: no tests, no vendored packages
        if size >= CODE_BYTES:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        size += len(text)
    return texts


def _key(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps([CORPUS_VERSION, vocab]).encode()).hexdigest()[:16]


def token_counts(tokenizer, vocab_size: int) -> torch.Tensor:
    """How often each id occurs in the corpus [vocab_size] (int64), cached per tokenizer."""
    path = cache_dir() / "vocab" / f"counts-{_key(tokenizer)}.pt"
    if path.exists():
        try:
            counts = torch.load(path, weights_only=True)
            if counts.numel() >= vocab_size:
                return counts[:vocab_size]
        except Exception:  # a damaged cache file: count again
            pass
    counts = torch.zeros(max(vocab_size, len(tokenizer)), dtype=torch.long)
    for ids in tokenizer(_corpus(), add_special_tokens=False, verbose=False)["input_ids"]:  # no length warnings
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=counts.numel())[:counts.numel()]
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        torch.save(counts, tmp)
    return counts[:vocab_size]


def frequent_ids(counts: torch.Tensor, size: int, always: set[int] = frozenset()) -> torch.Tensor:
    """The `size` most frequent ids (ties: the lower id first) plus `always`, sorted."""
    n = counts.numel()
    order = torch.sort(-counts, stable=True).indices  # by count, then id
    keep = torch.zeros(n, dtype=torch.bool)
    forced = torch.tensor(sorted(t for t in always if 0 <= t < n), dtype=torch.long)
    keep[forced] = True
    rest = order[~keep[order]][:max(0, size - int(keep.sum()))]
    keep[rest] = True
    return keep.nonzero().flatten()


def draft_vocab(tokenizer, vocab_size: int, size: int) -> torch.Tensor | None:
    """The ids a draft scores: the `size` most frequent ones and every special token; None for the whole
    vocabulary (size 0 or not smaller than it, or no tokenizer to count with)."""
    if tokenizer is None or size <= 0 or size >= vocab_size:
        return None
    return frequent_ids(token_counts(tokenizer, vocab_size), size, set(tokenizer.all_special_ids))
