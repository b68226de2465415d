"""Self-distillation data for draft heads: the target answers non-benchmark prompts, then one
teacher-forced forward over prompt + answer stores token ids and the target's features.

Shards are planned up front (shard i = a source, a sampling temperature and a slice of prompts), so a
run is resumable: finished shards are skipped, each shard is written atomically and recorded (size,
sha256) in manifest.json, and a resumed run redoes a shard that fails that check. Shard tensors:
input_ids int32 [N], features fp16 [N, H] (f_t, the target's last hidden state after the final norm),
aux_features fp16 [N, k * H] when the plan names aux layers (the hidden state entering each of those k
layers: EAGLE-3's low/middle/high features, layers 2, L/2 and L - 3 by default),
loss_mask uint8 [N] (1 = answer token), offsets int64 [S + 1] (sequence s is rows offsets[s]:offsets[s+1]).

Prompts never come from benchmarks: GSM8K *train* questions, prompts the target writes itself from a
bare chat template (the user turn generated first), and optionally GSM8K train's own solutions
(teacher-forced only: one prefill, no generation). Every prompt is also checked against the benchmark
question files and dropped on a match.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.files import atomic_write_text, check_writable, data_roots, find_data
from specdec.heads.shipped import target_fingerprint
from specdec.options import arg_type, checked
from specdec.runtime import lean as lean_mod
from specdec.runtime.loading import eos_ids
from specdec.sampling import SamplingParams
from specdec.training import dist
from specdec.training.features import engine_answers, runner_features
from specdec.training.prompts import CODE_OPENINGS, PromptSource, benchmark_prompts, gold_answer, is_benchmark
from specdec.training.shards import (
    list_shards,
    merge_manifests,
    pack_shard,
    read_manifest,
    resume_shards,
    write_manifest,
    write_shard,
)

__all__ = ["Plan", "run_datagen", "generate_answers", "teacher_force", "benchmark_prompts", "is_benchmark",
           "list_shards", "pack_shard", "write_shard"]

SOURCES = ("gsm8k", "self", "self-code", "gsm8k-gold")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# ---- argument checks: the CLI's argparse types, and the same rules for API callers ----

def temperature_list(text: str) -> list[float]:
    items = [t.strip() for t in str(text).split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected comma-separated temperatures, got {text!r}")
    return [arg_type(float, ge=0)(t) for t in items]


def source_list(text: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    bad = [t for t in items if t not in SOURCES] or ([] if items else [text])
    if bad:
        raise argparse.ArgumentTypeError(f"unknown source {bad[0]!r}; choose from {', '.join(SOURCES)}")
    return items


# ---- the plan ----

@dataclass
class Plan:
    shard_size: int = 64  # sequences per shard
    sources: list[str] = field(default_factory=lambda: ["self", "gsm8k"])  # docs/training.md's recipe
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = 320
    max_prompt_tokens: int = 256
    self_prompt_tokens: int = 96  # budget for a self-written user turn
    top_p: float = 1.0
    seed: int = 0
    aux_layers: str = "none"  # hidden states stored besides f_t: 'eagle3', 'none' or indices

    def check(self) -> None:
        for name, rule in PLAN_RULES.items():
            checked(name, getattr(self, name), rule)

    def shard(self, i: int) -> tuple[str, float]:
        """Shards cycle through sources fastest, then temperatures."""
        s = self.sources[i % len(self.sources)]
        t = self.temperatures[(i // len(self.sources)) % len(self.temperatures)]
        return s, float(t)

    def nth_of_source(self, i: int) -> int:
        src = self.shard(i)[0]
        return sum(1 for j in range(i) if self.shard(j)[0] == src)


PLAN_RULES = {"shard_size": arg_type(int, ge=1), "sources": source_list, "temperatures": temperature_list,
              "max_new_tokens": arg_type(int, ge=1), "max_prompt_tokens": arg_type(int, ge=1),
              "self_prompt_tokens": arg_type(int, ge=1), "top_p": arg_type(float, gt=0, le=1),
              "seed": arg_type(int, ge=0), "aux_layers": lambda v: aux_layer_list(v)}


def aux_layer_list(text: str) -> str:
    """'none', 'eagle3' (resolved against the model: 2, L/2, L - 3) or distinct layer indices."""
    text = str(text).strip()
    if text in ("", "none", "eagle3"):
        return text or "none"
    try:
        out = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'eagle3', 'none' or comma-separated layer indices, got {text!r}") \
            from None
    if any(i < 0 for i in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"layer indices must be distinct and >= 0, got {text!r}")
    return ",".join(map(str, sorted(out)))


def eagle3_layers(n_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high feature layers."""
    return sorted({min(2, n_layers - 1), n_layers // 2, max(n_layers - 3, 0)})


def resolve_aux_layers(spec: str, n_layers: int) -> list[int]:
    spec = aux_layer_list(spec)
    if spec == "eagle3":
        layers = eagle3_layers(n_layers)
    else:
        layers = [] if spec == "none" else [int(t) for t in spec.split(",")]
    if any(i >= n_layers for i in layers):
        raise SpecdecError(f"--aux-layers {','.join(map(str, layers))}: the target has {n_layers} layers")
    return layers


# ---- model work ----

@torch.inference_mode()
def generate_answers(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos_ids: set[int],
                     pad_id: int, top_p: float = 1.0) -> list[list[int]]:
    """One batched HF generate with left padding; each answer ends at its first EOS (kept)."""
    dev = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        att[r, width - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else dict(
        do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), max_new_tokens=max_new_tokens,
                         pad_token_id=pad_id, eos_token_id=sorted(eos_ids), **kw)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers


@torch.inference_mode()
def teacher_force(model, seqs: list[list[int]], batch_tokens: int = 8192, aux_layers: tuple[int, ...] = (),
                  ) -> list[torch.Tensor]:
    """Target features (after the final norm, then the hidden state entering each aux layer) of each
    sequence; right-padded batches by length."""
    dev = next(model.parameters()).device
    decoder = model.get_decoder()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    feats: list[torch.Tensor | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        j = i + 1  # sorted by length: the last of a group is its longest
        while j < len(order) and len(seqs[order[j]]) * (j - i + 1) <= batch_tokens:
            j += 1
        group = order[i:j]
        width = max(len(seqs[g]) for g in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        att = torch.zeros((len(group), width), dtype=torch.long)
        for r, g in enumerate(group):
            ids[r, : len(seqs[g])] = torch.tensor(seqs[g])
            att[r, : len(seqs[g])] = 1
        out = decoder(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False,
                      output_hidden_states=bool(aux_layers))
        h = out.last_hidden_state
        if aux_layers:  # hidden_states[i] is the input of layer i
            h = torch.cat([h, *(out.hidden_states[i] for i in aux_layers)], -1)
        for r, g in enumerate(group):
            feats[g] = h[r, : len(seqs[g])].float().cpu()
        i = j
    return feats  # type: ignore[return-value]


class AnswerMaker:
    """Batched answers (+ the target's features of prompt + answer). A target the serving engine runs decodes
    through its continuous batching and gets its features from prefill forwards (training.features); other
    architectures use HF generate, then teacher forcing."""

    def __init__(self, model, lean: bool = True, aux_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.aux_layers = tuple(aux_layers)
        # exact rows at every precision: the batch packs its sequences' rows into one forward only then
        self.runner = lean_mod.LeanRunner(model, exact=True) if lean and lean_mod.supports(model) else None

    def __call__(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos_ids: set[int],
                 pad_id: int, top_p: float = 1.0, seed: int = 0, features: bool = True,
                 ) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        torch.manual_seed(seed)
        if self.runner is not None:
            answers = engine_answers(self.runner, prompts, max_new_tokens, SamplingParams(temperature, 0, top_p),
                                     eos_ids, len(prompts))
        else:
            answers = generate_answers(self.model, prompts, max_new_tokens, temperature, eos_ids, pad_id, top_p)
        return answers, self.features([p + a for p, a in zip(prompts, answers)]) if features else None

    def features(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """The target's features of whole sequences (e.g. GSM8K's gold answers: no token generated)."""
        if self.runner is None:
            return teacher_force(self.model, seqs, aux_layers=self.aux_layers)
        return runner_features(self.runner, seqs, self.aux_layers)


def check_run(out_dir, n_shards: int, plan: Plan, batch_size: int, gsm8k, exclude_dir,
              feature_dtype: str) -> tuple[Path | None, list[Path]]:
    """Every check that needs no model, so a bad argument fails before a model loads or a file is
    written. Returns the GSM8K file (None if no source needs one) and the dirs of benchmark prompts."""
    plan.check()
    checked("shards", n_shards, arg_type(int, ge=1))
    checked("batch_size", batch_size, arg_type(int, ge=1))
    if feature_dtype not in _DTYPES:
        raise SpecdecError(f"--feature-dtype must be one of {', '.join(_DTYPES)}, got {feature_dtype!r}")
    check_writable(out_dir)
    gsm = None
    if any(s.startswith("gsm8k") for s in plan.sources):
        # like every data file of the package: $SPECDEC_DATA first, then the package's own copy
        gsm = Path(gsm8k) if gsm8k else find_data("gsm8k/train.jsonl")
        if gsm is None or not gsm.is_file():
            where = gsm or f"gsm8k/train.jsonl under {' or '.join(map(str, data_roots()))}"
            raise SpecdecError(f"GSM8K train file not found at {where}: pass --gsm8k <train.jsonl>, or use "
                               "--sources self (prompts the target writes itself)")
    if exclude_dir and not Path(exclude_dir).is_dir():
        raise SpecdecError(f"--exclude-dir {exclude_dir} is not a directory")
    # every data root, not just the first (and --exclude-dir on top): a benchmark prompt found in any copy
    # is excluded
    excl = ([Path(exclude_dir)] if exclude_dir else []) + [r for r in data_roots() if r.is_dir()]
    return gsm, excl


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_ranks(model, tok, out_dir: str | os.PathLike, n_shards: int, plan: Plan, **kw) -> dict:
    """run_datagen as this process's share of a run across processes (RANK / WORLD_SIZE: torchrun,
    accelerate launch); rank 0 writes the one manifest.json after every rank is done."""
    rank, world = dist.rank_world()
    dist.init(world)
    t = run_datagen(model, tok, out_dir, n_shards, plan, rank=rank, world=world, **kw)
    if world > 1:
        dist.barrier()
        if rank == 0:
            merge_manifests(Path(out_dir))
        dist.finish()
    return t


def run_datagen(model, tok, out_dir: str | os.PathLike, n_shards: int, plan: Plan, batch_size: int = 64,
                gsm8k: str | os.PathLike | None = None, exclude_dir: str | os.PathLike | None = None,
                feature_dtype: str = "float16", progress: bool = True, rank: int = 0, world: int = 1,
                tokens_only: bool = False) -> dict:
    """Make shards 0..n_shards-1 that are not there yet (or fail their check). Returns totals of this call.
    tokens_only: shards hold token ids and loss masks, no features (~5 bytes a token: small enough to keep in a
    repository); training computes the features of `aux_layers` from the target (training.features).
    Across `world` processes, process `rank` makes shards i with i % world == rank (each shard's samples
    depend on i alone: the same data as one process) and records them in its own manifest; the caller
    folds those into manifest.json once all are done (merge_manifests)."""
    from tqdm import tqdm

    gsm_path, excl = check_run(out_dir, n_shards, plan, batch_size, gsm8k, exclude_dir, feature_dtype)
    out = Path(out_dir)
    aux = resolve_aux_layers(plan.aux_layers, model.config.num_hidden_layers)
    meta = {"target": target_fingerprint(model), "hidden_size": model.config.hidden_size,
            "vocab_size": int(model.config.vocab_size), "plan": asdict(plan),
            "feature_dtype": feature_dtype, "aux_layers": aux, "format": 1,
            "features": not tokens_only}
    meta_file = out / "meta.json"
    old = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    if old is not None and any(old.get(k, True) != meta[k] for k in ("target", "plan", "features")):
        if list_shards(out) or read_manifest(out):
            raise SpecdecError(f"{out} holds data made with a different target, plan or --tokens-only; use another "
                               "directory "
                               f"(existing plan: {old.get('plan')})")
        _say(f"datagen: {out} holds the settings of a run that made no shard: replacing them")
        old = None
    bench = benchmark_prompts(excl)
    maker = AnswerMaker(model, aux_layers=tuple(aux))
    prompts = PromptSource(maker, tok, plan, gsm_path, bench, batch_size)
    eos = eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    # only a run that passed every check writes: a failed one never locks the directory
    if old is None:
        atomic_write_text(meta_file, json.dumps(meta, indent=1))
    todo, manifest = resume_shards(out, n_shards, _say, rank, world)
    totals = {"shards": 0, "sequences": 0, "tokens": 0, "answer_tokens": 0, "gen_seconds": 0.0, "tf_seconds": 0.0}
    mine = len(range(rank, n_shards, world))
    bar = tqdm(total=mine * plan.shard_size, initial=(mine - len(todo)) * plan.shard_size, unit="seq",
               disable=not progress, dynamic_ncols=True, desc="datagen" if world == 1 else f"datagen rank {rank}")
    t_start = time.perf_counter()
    for i in todo:
        src, temp = plan.shard(i)
        torch.manual_seed(plan.seed * 1_000_003 + i)  # a re-run of a killed shard redoes the same work
        t0 = time.perf_counter()
        if src.startswith("self"):
            texts = prompts.self_prompts(i, eos, pad, CODE_OPENINGS if src == "self-code" else ("",))
        else:
            rows = prompts.gsm_rows(i)
            texts = [r["question"] for r in rows]
        ps = [prompts.chat(t) for t in texts]
        if src == "gsm8k-gold":
            answers = [tok(gold_answer(r["answer"]), add_special_tokens=False)["input_ids"] + [min(eos)]
                       for r in rows]
            feats: list = [None] * len(ps)
        else:
            answers, feats = [[] for _ in ps], [None] * len(ps)
            order = sorted(range(len(ps)), key=lambda j: len(ps[j]))  # similar lengths: less left padding
            for b in range(0, len(order), batch_size):
                idx = order[b:b + batch_size]
                got, got_f = maker([ps[j] for j in idx], plan.max_new_tokens, temp, eos, pad, plan.top_p,
                                   seed=(plan.seed * 1_000_003 + i) * 4096 + b, features=not tokens_only)
                for j, a, f in zip(idx, got, got_f or [None] * len(got)):
                    answers[j], feats[j] = a, f
                bar.update(len(idx))
                n_new = sum(len(answers[j]) for j in order[: b + batch_size])
                bar.set_postfix(shard=i, gen_tok_s=f"{n_new / (time.perf_counter() - t0):.0f}")
        t1 = time.perf_counter()
        keep = [j for j in range(len(ps)) if answers[j]]
        seqs = [ps[j] + answers[j] for j in keep]
        missing = [n for n, j in enumerate(keep) if feats[j] is None and not tokens_only]
        tf = maker.features([seqs[n] for n in missing]) if missing else []
        feats = [feats[j] for j in keep]
        for n, f in zip(missing, tf):
            feats[n] = f
        t2 = time.perf_counter()
        tensors = pack_shard(seqs, [len(ps[j]) for j in keep], None if tokens_only else feats, _DTYPES[feature_dtype],
                             model.config.hidden_size, len(aux))
        n_ans = int(tensors["loss_mask"].sum())
        info = {"source": src, "temperature": temp, "sequences": len(seqs), "tokens": int(tensors["offsets"][-1]),
                "answer_tokens": n_ans, "gen_seconds": round(t1 - t0, 2), "tf_seconds": round(t2 - t1, 2)}
        manifest[f"shard-{i:05d}.safetensors"] = write_shard(out / f"shard-{i:05d}.safetensors", tensors, info)
        write_manifest(out, manifest, rank if world > 1 else None)
        if src == "gsm8k-gold" or len(ps) < plan.shard_size:
            bar.update(plan.shard_size - (len(ps) if src != "gsm8k-gold" else 0))
        totals["shards"] += 1
        totals["sequences"] += len(seqs)
        totals["tokens"] += info["tokens"]
        totals["answer_tokens"] += n_ans
        totals["gen_seconds"] += t1 - t0
        totals["tf_seconds"] += t2 - t1
        gen = "no generation" if src == "gsm8k-gold" else f"{n_ans / max(t1 - t0, 1e-9):.0f} tok/s generation"
        bar.write(f"shard {i} ({src}, T={temp}): {len(seqs)} seqs, {n_ans} answer tokens, {gen}, "
                  f"{t2 - t1:.1f} s teacher forcing")
    bar.close()
    if world == 1:
        merge_manifests(out)  # ranks' manifests of an earlier run across processes
    totals["seconds"] = time.perf_counter() - t_start
    return totals
