"""llama.cpp plain decoding of the README demo prompt on the embedded Q4_1 GGUF, with the same prompt
token ids as ours (a rough peer check until `bench` has the llama.cpp peer; issue 23).

Needs llama-cpp-python (builds from source, ~7 min on 2 cores), in any Python:
    python -m venv /tmp/lcp && /tmp/lcp/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python scripts/llamacpp_demo_probe.py --ids > /tmp/prompt.json      # our token ids + GGUF path
    /tmp/lcp/bin/python scripts/llamacpp_demo_probe.py /tmp/prompt.json
"""

from __future__ import annotations

import json
import sys
import time

DEMO = "Explain in a few sentences why the sky is blue."


def our_ids() -> None:
    from specdec.api import from_models
    from specdec.runtime.loading import load_model, resolve

    model, tok, _ = load_model(None, "cpu")
    ids = from_models(model, tok).encode([{"role": "user", "content": DEMO}])
    print(json.dumps({"ids": ids, "gguf": str(resolve(None))}))


def llama_cpp(path: str, max_new: int = 128) -> None:
    from llama_cpp import Llama

    with open(path) as f:
        p = json.load(f)
    llm = Llama(model_path=p["gguf"], n_ctx=2048, n_threads=2, n_threads_batch=2, verbose=False)
    eos = llm.token_eos()
    for _ in range(3):
        toks: list[int] = []
        t0 = time.perf_counter()
        for t in llm.generate(p["ids"], temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if t == eos:
                break
            toks.append(t)
            if len(toks) >= max_new:
                break
        dt = time.perf_counter() - t0
        print(f"llama.cpp plain: {len(toks)} tokens in {dt:.2f} s = {len(toks) / dt:.1f} tok/s (prefill included)")


if __name__ == "__main__":
    our_ids() if sys.argv[1:] == ["--ids"] else llama_cpp(sys.argv[1])
