"""Peers: other implementations timed beside ours, with the same `run(prompt_ids, temperature, seed,
max_new) -> {"tokens", "wall_time", "stats", "calibration"}` as our methods (stats None: a peer has no
engine statistics). HF `generate` variants run in-process on the same torch model; the llama.cpp
peers (bench/llamacpp.py) run llama.cpp on a GGUF file. `build_peer` is the one factory the runner calls.
"""

from __future__ import annotations

import time

import torch

from specdec.bench import llamacpp
from specdec.bench.methods import HF_PEERS, MethodSpec
from specdec.errors import SpecdecError


class HFMethod:
    """HF `generate` peers: plain, prompt lookup, assisted (a draft model)."""

    def __init__(self, spec: MethodSpec, model, eos_ids: set[int], draft_model=None) -> None:
        from transformers import GenerationConfig

        self.spec, self.model, self.draft = spec, model, draft_model
        opts = dict(spec.opts)
        gc = {}
        if spec.name == "hf-pld":
            gc["prompt_lookup_num_tokens"] = opts.pop("num_tokens", opts.pop("prompt_lookup_num_tokens", 10))
            gc["max_matching_ngram_size"] = opts.pop("ngram", opts.pop("max_matching_ngram_size", 2))
        elif spec.name == "hf-assisted":
            if draft_model is None:
                raise SpecdecError("method 'hf-assisted' needs a draft model: pass --draft")
            if "num_tokens" in opts:
                gc["num_assistant_tokens"] = opts.pop("num_tokens")
            if "schedule" in opts:
                gc["num_assistant_tokens_schedule"] = opts.pop("schedule")
        known = set(GenerationConfig().to_dict())
        bad = sorted(k for k in opts if k not in known)
        if bad:
            raise SpecdecError(f"unknown option(s) for method {spec.label!r}: {', '.join(bad)} (options of the hf "
                               "peers are GenerationConfig fields, plus num_tokens / ngram / schedule)")
        gc.update(opts)  # anything else is a GenerationConfig field, passed through
        eos = sorted(eos_ids)
        self.base = dict(eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **gc)
        try:
            GenerationConfig(**self.base).validate(strict=True)
        except Exception as e:
            raise SpecdecError(f"bad options for method {spec.label!r}: {e}") from None
        self._gc = GenerationConfig

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], temperature: float, seed: int, max_new: int) -> dict:
        dev = next(self.model.parameters()).device
        ids = torch.tensor([prompt_ids], device=dev)
        kw = dict(self.base, max_new_tokens=max_new, do_sample=temperature > 0)
        if temperature > 0:  # HF's defaults would add top-k 50: match our plain sampling
            kw.update(temperature=temperature, top_k=0, top_p=1.0)
        gc = self._gc(**kw)
        extra = {"assistant_model": self.draft} if self.spec.name == "hf-assisted" else {}
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, **extra)
        wall = time.perf_counter() - t0
        return {"tokens": out[0, len(prompt_ids):].tolist(), "wall_time": wall, "stats": None, "calibration": None}


def build_peer(spec: MethodSpec, model, eos_ids: set[int], draft_model=None, *, threads: int, n_ctx: int,
               closers=None):
    """The peer for a spec. `threads`: the bench's thread count; `n_ctx`: the longest prompt + new tokens
    the bench will ask for; `closers`: an ExitStack that stops what a peer started (llama-server)."""
    if spec.name in HF_PEERS:
        return HFMethod(spec, model, eos_ids, draft_model)
    return llamacpp.build(spec, model, eos_ids, threads=threads, n_ctx=n_ctx, closers=closers)
