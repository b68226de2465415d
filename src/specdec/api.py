"""The user-facing API: `dec = specdec.load(...)`, `dec.generate(...)`, `dec.stream(...)`."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import torch
from pydantic import Field, model_validator

from specdec.detok import GrowingText
from specdec.drafters import registry
from specdec.drafters.base import Drafter
from specdec.engine import decode
from specdec.errors import SpecdecError
from specdec.grammar import KINDS, Constraint, Vocabulary, compile_grammar
from specdec.options import option
from specdec.runtime.base import Runner
from specdec.runtime.gguf import GGUFModel
from specdec.runtime.loading import Runtime, build_runner, eos_ids, load_model
from specdec.sampling import SamplingParams
from specdec.slot import Slot
from specdec.stats import Stats

# the README demo: what `specdec generate` answers without a prompt, and `bench --demo` times
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."

Messages = Sequence[dict]


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: Stats
    finish_reason: str


@dataclass
class Chunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # the tokens since the previous chunk: all chunks' together are the Generation's
    final: Generation | None = None  # set on the last chunk
    # per token of token_ids, how it was produced: 0 sampled by the target (each step's bonus token, and
    # the first token), k >= 1 a draft token the target accepted at depth k of the draft
    depths: list[int] = field(default_factory=list)


class GenerationParams(SamplingParams):
    """What one request asks for: the sampling fields plus its limits. The engine reads it as its
    SamplingParams."""

    max_new_tokens: int = option(256, "tokens to generate at most", ge=1)
    stop: list[Annotated[str, Field(min_length=1)]] = option(
        [], "a stop string: the answer ends before the first one (repeatable)", shown="none", escapes=True)
    json_schema: str | None = option(None, "the answer is JSON fitting this JSON schema (its text)", shown="none")
    json_object: bool = option(False, "the answer is a JSON object")
    regex: str | None = option(None, "the answer matches this regular expression", shown="none")
    grammar: str | None = option(None, "the answer follows this Lark (or llama.cpp GBNF) grammar (its text)",
                                 shown="none")

    @model_validator(mode="after")
    def _one_constraint(self) -> GenerationParams:
        given = [k for k in KINDS if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, json_object, regex, grammar (got {', '.join(given)})")
        if given:
            compile_grammar(given[0], getattr(self, given[0]))
        return self

    @property
    def constrained(self) -> str | None:
        """llguidance's grammar for the constraint asked for, or None."""
        kind = next((k for k in KINDS if getattr(self, k)), None)
        return None if kind is None else compile_grammar(kind, getattr(self, kind))


@dataclass
class Decoder:
    """A target, a drafter and a tokenizer. Safe to share between threads: requests are serialized
    (slot.py), and a stream another request interrupted rebuilds its state and continues exactly. Fastest
    on the thread that loaded it: on a CPU, decoding on a second thread's OpenMP team was 2.7x slower
    (docs/architecture.md, continuous batching)."""

    runner: Runner
    tokenizer: object
    drafter: Drafter
    method: str
    eos_ids: set[int] = field(default_factory=set)
    slot: Slot = field(default_factory=Slot)
    _tok_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # fast tokenizers are not
    _vocabulary: Vocabulary | None = field(default=None, repr=False)

    def constraint(self, params: SamplingParams) -> Constraint | None:
        """A fresh grammar state for a request whose params ask for structured output, else None."""
        grammar = getattr(params, "constrained", None)
        if grammar is None:
            return None
        with self._tok_lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary(self.tokenizer, self.runner.vocab_size, self.eos_ids)
        return self._vocabulary.constraint(grammar, params.greedy)

    @property
    def weights(self) -> str:
        """The target's linear-weight precision: decoding is lossless relative to that target."""
        return self.runner.weights

    def steps(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int, stats: Stats,
              on_verify: Callable | None = None, drafter: Drafter | None = None,
              learn: bool = True, prefill_steps: bool = False) -> Iterator[list[int]]:
        """The new token ids of each decoding step, under this Decoder's turn-taking like every request
        (the benchmark and `specdec tune` decode token ids through here). on_verify, learn, prefill_steps:
        engine.decode's.
        drafter: another drafter over the same target instead of this Decoder's (e.g. NoDrafter)."""
        return decode(self.runner, self.drafter if drafter is None else drafter, prompt_ids, params, max_new_tokens,
                      self.eos_ids, stats, on_verify=on_verify, lease=self.slot.lease(), learn=learn,
                      prefill_steps=prefill_steps, constraint=self.constraint(params))

    def encode(self, prompt: str | Messages) -> list[int]:
        """A string is raw text; a list of {"role", "content"} messages goes through the chat template."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            if not prompt:
                raise SpecdecError("prompt is empty")
            with self._tok_lock:
                ids = tok(prompt, add_special_tokens=True)["input_ids"]
            if not ids:
                raise SpecdecError("prompt is empty after tokenization")
            return ids
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            raise SpecdecError("prompt must be a non-empty string or a non-empty list of "
                               f"{{'role': str, 'content': str}} messages, got {_short(prompt)}")
        for i, m in enumerate(prompt):
            check_text(m["content"], f"prompt message {i}")
        if not getattr(tok, "chat_template", None):
            raise SpecdecError("this tokenizer has no chat template: pass a plain string prompt")
        try:
            with self._tok_lock:
                ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        except Exception as e:
            raise SpecdecError(f"could not apply the chat template to these messages: {e}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def stream(
        self,
        prompt: str | Messages,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        json_schema: dict | str | None = None,
        json_object: bool = False,
        regex: str | None = None,
        grammar: str | None = None,
        **unknown,
    ) -> Iterator[Chunk]:
        """Chunks of text as they are decoded; the last one carries the whole Generation. Parameters
        and prompt are checked here, before the first chunk is asked for. json_schema (a dict or its
        JSON text), json_object, regex or grammar (Lark or GBNF text): structured output, lossless."""
        if unknown:
            raise SpecdecError(f"unknown option {next(iter(unknown))!r} (valid: "
                               f"{', '.join(GenerationParams.model_fields)})")
        stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else stop
        if isinstance(json_schema, (dict, bool)):
            json_schema = json.dumps(json_schema)
        params = GenerationParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed, stop=[] if stops is None else stops,
                                  json_schema=json_schema, json_object=json_object, regex=regex, grammar=grammar)
        return self._stream(self.encode(prompt), params)

    def _stream(self, prompt_ids: list[int], params: GenerationParams) -> Iterator[Chunk]:
        stats = Stats()
        text = TextStream(self, prompt_ids, params.stop, stats)
        steps = self.steps(prompt_ids, params, params.max_new_tokens, stats)
        try:
            for new in steps:
                chunk = text.push(new)
                if chunk is not None:
                    yield chunk
                if text.stopped:
                    break
        finally:
            steps.close()
        yield text.final()

    def generate(self, prompt: str | Messages, **kw) -> Generation:
        for chunk in self.stream(prompt, **kw):
            if chunk.final is not None:
                return chunk.final
        raise AssertionError("stream ended without a final chunk")

    def _text(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """A request's new tokens, step by step -> Chunks of text. Holds back an unfinished UTF-8 character and
    any tail that could still become a stop string; at a stop string the answer ends where vanilla
    decoding would end it (at the token completing it)."""

    def __init__(self, decoder: Decoder, prompt_ids: list[int], stops: list[str], stats: Stats) -> None:
        self.decoder, self.prompt_ids, self.stops, self.stats = decoder, prompt_ids, stops, stats
        self.ids: list[int] = []
        self.growing = GrowingText(decoder._text)
        self.text = ""
        self.sent = 0  # characters of text already yielded
        self.held: list[int] = []  # ids and depths not yet yielded (their text is held back, or was cut)
        self.depths: list[int] = []
        self.forwards = 0  # verify forwards seen
        self.finish: str | None = None  # "stop" once a stop string ended the answer

    @property
    def stopped(self) -> bool:
        return self.finish is not None

    def push(self, new: list[int]) -> Chunk | None:
        """A step's new tokens: the chunk of text they complete, if any."""
        stats, ids, start = self.stats, self.ids, len(self.ids)
        ids.extend(new)
        # a verify step records its accepted path (accepted + 1) before yielding: its first
        # accepted - 1 tokens are drafts at depths 1, 2, ...; the prefill's token records none
        drafted = stats.accept_lengths[-1] - 1 if len(stats.accept_lengths) > self.forwards else 0
        self.forwards = len(stats.accept_lengths)
        step_depths = [i + 1 if i < drafted else 0 for i in range(len(new))]
        text = self.growing.extend(new)
        hit = _find_stop(text, self.stops)
        if hit is not None:
            # the output must be what vanilla decoding would give: cut at the token that completes it
            while len(ids) > start + 1 and _find_stop(self.decoder._text(ids[:-1]), self.stops) is not None:
                ids.pop()
            self.held += ids[start:]
            self.depths += step_depths[:len(ids) - start]
            self.text, self.finish = text[:hit], "stop"
            stats.new_tokens = len(ids)
            stats.finish_reason = self.finish
            return None
        self.held += new
        self.depths += step_depths
        self.text = text
        safe = _safe_prefix_len(text, self.stops)
        if safe <= self.sent:
            return None
        chunk = Chunk(text[self.sent:safe], self.held, depths=self.depths)
        self.sent, self.held, self.depths = safe, [], []
        return chunk

    def final(self) -> Chunk:
        """The last chunk, carrying the whole Generation (after the last step, or a stop string)."""
        text = self.decoder._text(self.ids) if self.finish is None else self.text
        finish = self.finish or self.stats.finish_reason
        gen = Generation(text, self.ids, self.prompt_ids, self.stats, finish)
        return Chunk(text[self.sent:], self.held, gen, self.depths)


def check_text(text: str, name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates: what Python makes of non-UTF-8 bytes in argv
        raise SpecdecError(f"{name} is not valid UTF-8 text (bad character at position {e.start})") from None


def _short(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _safe_prefix_len(text: str, stops: list[str]) -> int:
    """Hold back an unfinished UTF-8 character and any tail that could still become a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[end - k:end] == s[:k]:
                end -= k
                break
    return end


def load(
    target: str | None = None,
    method: str = "auto",
    draft: str | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    threads: int | None = None,
    weights: str | None = None,
    **opts,
) -> Decoder:
    """Load a target (HF dir, .gguf, or the embedded default "smollm2") and a drafting method.

    Methods and their options: `specdec.drafters.registry` (README's table; `specdec methods`). The
    method and its options are checked before any model loads. weights: the target's linear-weight
    precision (fp32, bf16, fp16, int8; default the model's dtype): decoding is lossless relative to it.
    """
    rt = Runtime(device=device, dtype=dtype, backend=backend, threads=threads, weights=weights)
    spec, _ = registry.parse(method, opts)
    if spec.needs_draft and draft is None:
        raise SpecdecError(f"method {method!r} needs a draft model: pass draft=<HF dir or .gguf>")
    rt.apply()
    model, tok, _ = load_model(target, rt.device, rt.torch_dtype(), rt.weights)
    if rt.weights is None and isinstance(model, GGUFModel):
        rt = rt.model_copy(update={"weights": "gguf"})
    draft_model = draft_tok = None
    if spec.needs_draft or (spec.takes_draft and draft is not None):
        draft_model, draft_tok, _ = load_model(draft, next(model.parameters()).device, rt.torch_dtype(), rt.weights)
    return _decoder(model, tok, method, draft_model, draft_tok, rt, opts)


def from_models(model, tokenizer, method: str = "vanilla", draft_model=None, draft_tokenizer=None,
                backend: str = "auto", weights: str | None = None, **opts) -> Decoder:
    """A Decoder over models already in memory (what `load` does after loading)."""
    return _decoder(model, tokenizer, method, draft_model, draft_tokenizer, Runtime(backend=backend, weights=weights),
                    opts)


def _decoder(model, tokenizer, method: str, draft_model, draft_tokenizer, rt: Runtime, opts: dict) -> Decoder:
    spec, options = registry.parse(method, opts)
    runner = build_runner(model, rt)
    drafter = spec.build(registry.Target(model, runner, tokenizer, draft_model, draft_tokenizer, rt), options)
    if method == "auto":  # report what auto resolved to: the tree drafter (its union's first member) or vanilla
        method = drafter.lead.name
    return Decoder(runner, tokenizer, drafter, method, eos_ids(model, tokenizer))
