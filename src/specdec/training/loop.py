"""What every draft-head trainer shares (train.py's EAGLE/FSPAD, medusa.py's Medusa): the learning-rate
schedule, checkpoints written to a temporary dir and renamed, finished-run detection and the resume check,
the data checks, the CLI flags of a config dataclass, and the step loop.

The loop: step s trains on `global_batch(s)`; each process takes its slice of it and the trainer's step
function normalises its loss by the global row count (DDP averages gradients over processes), so N
processes follow the 1-process run. Batches are pure functions of (seed, step), so a checkpoint needs only
the trained module, the optimizer, the scheduler and the step; the loop writes one every `save_every` steps
and at the end, logs every `log_every` steps to log.jsonl, and stops after `stop_after` steps (a testing
aid: as if killed).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.options import arg_type, checked
from specdec.training.shards import ShardData, global_batch

SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class LoopConfig:
    """What every trainer's config has (data, schedule, checkpoints, logging); train.py and medusa.py add
    their model's fields and may change a default (Medusa: lr 1e-3, clip 1.0)."""

    data: str
    out: str
    steps: int = 0  # 0: derived from epochs
    epochs: float = 1.0
    batch_size: int = 16  # sequences per optimizer step, over all processes
    max_len: int = 1024
    lr: float = 3e-4
    warmup: int = 100
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    clip: float = 0.5
    save_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    stop_after: int = 0  # testing aid: stop (as if killed) after this many steps of this invocation
    ship_to: str = ""  # also write a small copy here (fp16; no LM head rows that stayed the target's)
    init_from: str = ""  # start from these trained weights (warm start on new data, or Medusa-2 from Medusa-1)

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def check_rules(self, rules: dict) -> None:
        """The CLI's rules for API callers too: a SpecdecError naming the flag, before any work."""
        for name, rule in rules.items():
            checked(name, getattr(self, name), rule)
        if self.schedule not in SCHEDULES:
            raise SpecdecError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")


# the argparse types of the shared numeric options (steps 0 = derived from epochs)
LOOP_RULES = {
    "steps": arg_type(int, ge=0), "epochs": arg_type(float, gt=0), "batch_size": arg_type(int, ge=1),
    "max_len": arg_type(int, ge=2), "lr": arg_type(float, ge=0), "warmup": arg_type(int, ge=0),
    "min_lr_ratio": arg_type(float, ge=0, le=1), "weight_decay": arg_type(float, ge=0),
    "clip": arg_type(float, ge=0), "save_every": arg_type(int, ge=1), "keep_checkpoints": arg_type(int, ge=1),
    "log_every": arg_type(int, ge=1), "seed": arg_type(int, ge=0), "stop_after": arg_type(int, ge=0),
}


def lr_lambda(cfg, total: int):
    """Linear warmup, then cosine / linear decay to min_lr_ratio, or constant (cfg: warmup, schedule,
    min_lr_ratio)."""
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / (cfg.warmup + 1)
        if cfg.schedule == "constant":
            return 1.0
        frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay
    return f


# ---- checkpoints, finished runs, resumes ----

def checkpoints(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(out: Path, model, opt, sched, step: int, state: dict, keep: int,
                    write: Callable[[torch.nn.Module, Path], None]) -> Path:
    """state.pt (model, optimizer, scheduler, step, `state`) and `write(model, dir)`'s files, under
    checkpoints/step-N only once complete; only the newest `keep` are kept."""
    ck = out / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    final = ck / f"step-{step:07d}"
    tmp = ck / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": step, "torch_rng": torch.get_rng_state(), **state}, tmp / "state.pt")
    write(model, tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)  # a checkpoint exists under its real name only when complete
    for old in checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def finished_run(cfg, cls, keys: tuple[str, ...], result: str) -> tuple[Path, int] | None:
    """(cfg.out/result, its step count) when the run is complete: the result is written (its config.json's
    specdec.training holds the run's config and steps), the last checkpoint is its final step, the `keys`
    settings are the same (and a --ship-to copy exists); else None."""
    out = Path(cfg.out)
    ckpts, done = checkpoints(out), out / result
    try:
        training = json.loads((done / "config.json").read_text())["specdec"]["training"]
        saved, total = cls.from_dict(training["config"]), int(training["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not ckpts or int(ckpts[-1].name.split("-")[1]) < total:
        return None
    if any(getattr(saved, k) != getattr(cfg, k) for k in keys):
        return None  # the resume check says what differs
    if cfg.ship_to and not (Path(cfg.ship_to) / "config.json").is_file():
        return None  # a re-run with a new --ship-to writes that copy
    return done, total


def load_resume(cfg, cls, keys: tuple[str, ...]) -> dict | None:
    """The newest checkpoint's state of the run in cfg.out (None: a new run); a SpecdecError when its
    `keys` settings differ from cfg's."""
    out = Path(cfg.out)
    ckpts = checkpoints(out)
    if not ckpts:
        return None
    resume = torch.load(ckpts[-1] / "state.pt", map_location="cpu", weights_only=False)
    saved = cls.from_dict(resume["config"])
    for k in keys:
        if getattr(saved, k) != getattr(cfg, k):
            raise SpecdecError(f"{out} holds a run with {k}={getattr(saved, k)!r}, not {getattr(cfg, k)!r}: "
                               "resume with the same settings or use another --out")
    return resume


def load_data(cfg, resume: dict | None, fingerprint: dict, hidden_size: int, world: int,
              main: bool = True, aux: bool = False) -> tuple[ShardData, int]:
    """The run's shards (a resume: exactly the ones it started with), checked against the target, and
    the run's total step count. aux: with the aux layers' hidden states (ShardData)."""
    data = ShardData(cfg.data, resume["shards"] if resume else None, cfg.max_len, aux)
    if any(m.get("target") and m["target"] != fingerprint for m in data.metas):
        raise SpecdecError(f"the data in {cfg.data} was made with a different target model")
    if data.hidden_size != hidden_size:
        raise SpecdecError(f"data features have size {data.hidden_size}, the target {hidden_size}")
    if not len(data):  # refuse rather than "train" a head on zero-loss rows
        if data.first_answer is None:
            raise SpecdecError(f"the {data.n_sequences} sequences in {cfg.data} hold no answer token: "
                               "nothing to train on")
        raise SpecdecError(f"--max-len {cfg.max_len} leaves no answer token in any of the {data.n_sequences} "
                           f"sequences (the earliest answer starts at token {data.first_answer}): "
                           f"raise --max-len above {data.first_answer}")
    if 2 * data.dropped > data.n_sequences and main:
        print(f"specdec: warning: {data.dropped} of the {data.n_sequences} sequences have no answer token "
              f"within --max-len {cfg.max_len}: training on the other {len(data)}", file=sys.stderr, flush=True)
    total = cfg.steps or max(1, int(cfg.epochs * len(data) / cfg.batch_size))
    if cfg.batch_size < world:
        raise SpecdecError(f"batch size {cfg.batch_size} is smaller than the {world} processes")
    return data, total


def start_log(out: Path, cfg, start: int) -> Path:
    """Main process: the run's config.json, and log.jsonl without the lines of steps a killed run did
    after its last checkpoint."""
    log_f = out / "log.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    if log_f.is_file():
        lines = [ln for ln in log_f.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= start]
        log_f.write_text("".join(ln + "\n" for ln in lines))
    return log_f


# ---- the step loop ----

StepFn = Callable[[int, list, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
RecordFn = Callable[[torch.Tensor], tuple[dict, dict]]


def run_steps(acc, cfg, data: ShardData, module, opt, sched, params, total: int, start: int, state: dict,
              step_fn: StepFn, record: RecordFn, stats_shape: tuple[int, ...],
              write: Callable[[torch.nn.Module, Path], None], desc: str, progress: bool = True,
              seconds: float = 0.0) -> tuple[int, list[dict], float]:
    """Train `module` (accelerate-prepared; `module.head` is what a checkpoint holds) from step `start`
    to `total`: step_fn(step, my sequence ids, ids, feats, mask) -> (loss, stats of `stats_shape`),
    summed over steps and processes between log lines; record(summed stats) -> (the log line's fields,
    the progress bar's). A checkpoint's "seconds" adds this invocation's to `seconds` (the earlier ones').
    Returns (the step reached, the log lines, this invocation's seconds)."""
    from tqdm import tqdm

    rank, world, dev = acc.process_index, acc.num_processes, acc.device
    out = Path(cfg.out)
    log_f = out / "log.jsonl"
    if acc.is_main_process:
        start_log(out, cfg, start)
    acc.wait_for_everyone()
    bar = tqdm(total=total, initial=start, disable=not (progress and acc.is_main_process), unit="step",
               desc=desc, dynamic_ncols=True)
    acc_stats = torch.zeros(stats_shape, device=dev)
    t0, tok_done, history = time.perf_counter(), 0, []
    step = start
    module.train()
    while step < total:
        mine = global_batch(len(data), cfg.batch_size, cfg.seed, step)[rank::world]
        ids, feats, mask = (t.to(dev) for t in data.batch(mine))
        loss, stats = step_fn(step, mine, ids, feats, mask)
        opt.zero_grad(set_to_none=True)
        acc.backward(loss)
        if cfg.clip > 0:
            acc.clip_grad_norm_(params, cfg.clip)
        opt.step()
        sched.step()
        step += 1
        acc_stats += stats
        tok_done += sum(data.spans[i][1] - data.spans[i][0] for i in mine)
        bar.update(1)
        if step % cfg.log_every == 0 or step == total:
            s = acc.reduce(acc_stats.clone(), reduction="sum") if world > 1 else acc_stats
            fields_, postfix = record(s)
            rec = {"step": step, **fields_, "lr": sched.get_last_lr()[0],
                   "tokens_per_s": tok_done * world / (time.perf_counter() - t0), "processes": world}
            history.append(rec)
            bar.set_postfix(**postfix)
            if acc.is_main_process:
                with log_f.open("a") as fh:
                    fh.write(json.dumps(rec) + "\n")
            acc_stats.zero_()
        if (step % cfg.save_every == 0 or step == total) and acc.is_main_process:
            save_checkpoint(out, acc.unwrap_model(module).head, opt, sched, step,
                            state | {"seconds": seconds + time.perf_counter() - t0}, cfg.keep_checkpoints, write)
        acc.wait_for_everyone()
        if cfg.stop_after and step - start >= cfg.stop_after and step < total:
            break
    bar.close()
    return step, history, time.perf_counter() - t0


def global_sum(acc, x: torch.Tensor) -> torch.Tensor:
    """x summed over the processes (a copy)."""
    return acc.reduce(x.detach().clone(), reduction="sum") if acc.num_processes > 1 else x.detach().clone()


# ---- CLI ----

def add_config_flags(p, cls, rules: dict, choices: dict[str, tuple] | None = None, skip=()) -> None:
    """One flag per field of the config dataclass `cls` (data/out and `skip` aside): booleans as switches,
    `choices` as choices, the rest typed by `rules` (argparse types with range checks)."""
    d = cls(data="", out="")
    for f in fields(cls):
        if f.name in ("data", "out", *skip):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default)
        elif f.name in (choices or {}):
            p.add_argument(flag, choices=choices[f.name], default=default)
        else:
            p.add_argument(flag, type=rules.get(f.name, type(default)), default=default)


def load_target(path, spec):
    """The target (`path`: materialize(spec)) for training, fp32: only its embeddings and LM head are used,
    no tokenizer needed."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        raise SpecdecError(f"could not load the target model {spec!r}: {e}") from None
