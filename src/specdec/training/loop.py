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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.options import arg_type, bool_flag, checked
from specdec.training.shards import ShardData, global_batch

SCHEDULES = ("cosine", "linear", "constant")


def knob(default, help: str, metavar: str | None = None, shown: str | None = None):
    """A config field with its flag's help (and metavar, and the default as help shows it)."""
    return field(default=default, metadata={"help": help, "metavar": metavar, "shown": shown})


@dataclass
class LoopConfig:
    """What every trainer's config has (data, schedule, checkpoints, logging); train.py and medusa.py add
    their model's fields and may change a default. The defaults are docs/training.md's recipe for the
    shipped heads (EAGLE: lr 1e-3, 3 epochs; Medusa: lr 1e-3, warmup 20, clip 1.0; both batch 8)."""

    data: str
    out: str
    steps: int = knob(0, "optimizer steps; 0: as many as --epochs passes over the data take", "N")
    epochs: float = knob(1.0, "passes over the data, when --steps is 0", "X")
    batch_size: int = knob(8, "sequences per optimizer step, over all processes", "N")
    max_len: int = knob(1024, "tokens kept per sequence (the rest is cut)", "N")
    lr: float = knob(3e-4, "peak learning rate (AdamW)", "X")
    warmup: int = knob(50, "steps of linear warmup to --lr; a warmup as long as the whole run is cut to a tenth "
                       "of it, with a note", "N")
    schedule: str = knob("cosine", "the learning rate after warmup: cosine or linear decay to --min-lr-ratio "
                         "times --lr, or constant")
    min_lr_ratio: float = knob(0.05, "where the decay ends, as a fraction of --lr", "X")
    weight_decay: float = knob(0.0, "AdamW weight decay", "X")
    clip: float = knob(0.5, "gradient-norm clip (0: none)", "X")
    save_every: int = knob(200, "write a checkpoint every N steps and at the end (a re-run resumes from the "
                           "newest)", "N")
    keep_checkpoints: int = knob(2, "checkpoints kept, the newest", "N")
    log_every: int = knob(10, "a line of log.jsonl (loss, top-1 agreement, lr) every N steps", "N")
    seed: int = knob(0, "picks the batches and the noise: the same seed, the same run", "N")
    stop_after: int = knob(0, "testing aid: stop (as if killed) after N steps of this invocation; 0: run to "
                           "the end", "N")
    ship_to: str = knob("", "also write a small fp16 copy of the result here (without LM-head rows that "
                        "stayed the target's)", "PATH", "none")
    init_from: str = knob("", "start from these trained weights (a warm start on new data, or Medusa-2 from "
                          "Medusa-1 heads)", "PATH", "none")

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


def warmup_steps(cfg, total: int) -> int:
    """cfg.warmup, or a tenth of the run when the warmup would take all of it (the lr would never reach
    --lr: e.g. the default warmup in a run of a few steps)."""
    return cfg.warmup if cfg.warmup < total else total // 10


def lr_lambda(cfg, total: int):
    """Linear warmup, then cosine / linear decay to min_lr_ratio, or constant (cfg: warmup, schedule,
    min_lr_ratio)."""
    warmup = warmup_steps(cfg, total)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.schedule == "constant":
            return 1.0
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
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
    if warmup_steps(cfg, total) != cfg.warmup and main:
        print(f"specdec: note: --warmup {cfg.warmup} is not shorter than the run's {total} steps: warming up "
              f"over {warmup_steps(cfg, total)} instead", file=sys.stderr, flush=True)
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
    """One flag per field of the config dataclass `cls` (data/out and `skip` aside), with the field's help
    and default: booleans as `--flag` (or `--flag true|false`), `choices` as choices, the rest typed by
    `rules` (argparse types with range checks)."""
    d = cls(data="", out="")
    for f in fields(cls):
        if f.name in ("data", "out", *skip):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        shown = f.metadata.get("shown") or (str(default).lower() if isinstance(default, bool) else str(default))
        kw = dict(default=default, help=f"{f.metadata.get('help', '')} (default {shown})",
                  metavar=f.metadata.get("metavar"))
        if isinstance(default, bool):
            p.add_argument(flag, **(kw | {"metavar": "{true,false}"}), **bool_flag(const=True))
        elif f.name in (choices or {}):
            p.add_argument(flag, choices=choices[f.name], **(kw | {"metavar": "{" + ",".join(choices[f.name]) + "}"}))
        else:
            p.add_argument(flag, type=rules.get(f.name, type(default)), **kw)


def load_target(path, spec):
    """The target (`path`: materialize(spec)) for training, fp32: only its embeddings and LM head are used,
    no tokenizer needed."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        raise SpecdecError(f"could not load the target model {spec!r}: {e}") from None
