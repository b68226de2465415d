"""The long-context set: prompts of about 2k, 4k, 8k and 16k tokens, built from shipped data and from Python's
own standard library (its source ships with every Python):

- `summarize-<n>`: Spec-Bench's news articles (CNN/DM), concatenated, to be summarised;
- `rag-<n>`: its Natural Questions passages, concatenated, and one of their questions;
- `code-<n>`: standard-library modules' source, concatenated, with a function to rename throughout (an edit
  that copies most of the file: where lookup drafting should shine).

A prompt takes about 90% of its length, in characters from a per-kind characters-per-token estimate (the
benchmark reports its real token count), so that a model with an 8k context answers the 8k prompts."""

from __future__ import annotations

import importlib
import inspect
import re

from specdec.errors import SpecdecError

LENGTHS = {"2k": 2048, "4k": 4096, "8k": 8192, "16k": 16384}
PER_LENGTH = 2  # prompts per kind and length, from different parts of the sources
CHARS_PER_TOKEN = {"summarize": 4.6, "rag": 4.4, "code": 3.75}  # as SmolLM2's tokenizer counts them
FILL = 0.9  # of the length: an n-token context holds the prompt and a 256-token answer
# modules whose source makes up the code prompts, in order; each prompt starts at another module
MODULES = ("textwrap", "shlex", "difflib", "argparse", "configparser", "calendar", "fractions", "statistics",
           "string", "heapq", "bisect", "csv", "dataclasses", "enum", "pprint", "gettext")


def _fill(parts, chars: int) -> str:
    """Parts joined until `chars` characters, the last one cut at a line (or word) boundary."""
    out, n = [], 0
    for p in parts:
        if n + len(p) >= chars:
            cut = p.rfind("\n", 0, chars - n)
            if cut < (chars - n) // 2:
                cut = p.rfind(" ", 0, chars - n)
            out.append(p[: max(cut, 0)])
            break
        out.append(p)
        n += len(p)
    else:
        raise SpecdecError(f"the long-context set's sources hold fewer than {chars} characters")
    return "".join(out)


def _module_sources(start: int):
    for name in MODULES[start:] + MODULES[:start]:
        try:
            src = inspect.getsource(importlib.import_module(name))
        except (OSError, TypeError):
            raise SpecdecError(f"the long-context set's code prompts read the standard library's source "
                               f"({name}.py), which this Python install lacks") from None
        yield f"# file: {name}.py\n{src}\n"


def long_context_prompts(spec_bench: list) -> list[tuple[str, str, str]]:
    """The set's (question id, category `<kind>-<length>`, prompt), from Spec-Bench's questions."""
    news = [q.turns[0].removeprefix("Summarize:").strip() for q in spec_bench if q.category == "summarization"]
    rag = [q.turns[0].rsplit("\n", 1) for q in spec_bench if q.category == "rag"]
    if len(news) < 2 or len(rag) < 2:
        raise SpecdecError("the long-context set needs Spec-Bench's summarization and rag questions")
    out = []
    for label, tokens in LENGTHS.items():
        chars = {kind: int(FILL * tokens * c) for kind, c in CHARS_PER_TOKEN.items()}
        for i in range(PER_LENGTH):
            start = i * len(news) // PER_LENGTH
            docs = _fill((f"Document {k + 1}:\n{d}\n\n" for k, d in enumerate(news[start:] + news[:start])),
                         chars["summarize"])
            out.append((f"summarize-{label}-{i}", f"summarize-{label}",
                        f"{docs}\n\nSummarize the documents above in one paragraph."))
            start = i * len(rag) // PER_LENGTH
            passages = _fill((p + "\n\n" for p, _ in rag[start:] + rag[:start]), chars["rag"])
            out.append((f"rag-{label}-{i}", f"rag-{label}",
                        f"{passages}\n\nAnswer from the passages above: {rag[start][1].strip()}"))
            code = _fill(_module_sources(i * len(MODULES) // PER_LENGTH), chars["code"])
            name = re.search(r"^\s*def ((?!__)\w+)\(", code, re.M)  # the first function or method, not a dunder
            out.append((f"code-{label}-{i}", f"code-{label}",
                        f"```python\n{code}```\n\nRename the function `{name[1]}` to `{name[1]}_v2` everywhere in the "
                        "code above, and output the whole updated code, nothing else."))
    return out
