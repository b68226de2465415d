"""What every draft-head trainer shares besides its step loop (trainer.py): the learning-rate schedule,
checkpoints written to a temporary dir and renamed, finished-run detection and the resume check, and the
data checks. Batches are pure functions of (seed, step), so a checkpoint needs only the trained module, the
optimizer, the scheduler and the step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.files import atomic_dir, check_writable
from specdec.training.config import LoopConfig
from specdec.training.shards import ShardData, list_shards


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


def finished_run(cfg: LoopConfig, result: str) -> tuple[Path, int] | None:
    """(cfg.out/result, its step count) when the run is complete: the result is written (its config.json's
    specdec.training holds the run's config and steps), the last checkpoint is its final step, the resume
    settings are the same (and a --ship-to copy exists); else None."""
    out = Path(cfg.out)
    ckpts, done = checkpoints(out), out / result
    try:
        training = json.loads((done / "config.json").read_text())["specdec"]["training"]
        saved, total = type(cfg).from_dict(training["config"]), int(training["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not ckpts or int(ckpts[-1].name.split("-")[1]) < total:
        return None
    if any(getattr(saved, k) != getattr(cfg, k) for k in cfg.resume_keys()):
        return None  # the resume check says what differs
    if cfg.ship_to and not (Path(cfg.ship_to) / "config.json").is_file():
        return None  # a re-run with a new --ship-to writes that copy
    return done, total


def check_paths(cfg: LoopConfig) -> None:
    """What a run needs from the file system, checked before the target loads: --out and --ship-to
    writable, --init-from present, and for a new run --data's dirs holding shards (a resumed run reads
    the shards it started with, and says which one is gone); a resumed run's settings are checked too."""
    check_writable(cfg.out, "--out")
    if cfg.ship_to:
        check_writable(cfg.ship_to, "--ship-to")
    if cfg.keep_in:
        check_writable(cfg.keep_in, "--keep-in")
    if cfg.init_from and not Path(cfg.init_from).expanduser().exists():
        raise SpecdecError(f"--init-from {cfg.init_from} does not exist")
    if load_resume(cfg, mmap=True) is not None:
        return
    dirs = [Path(d.strip()).expanduser() for d in str(cfg.data).split(",") if d.strip()]
    if not dirs:
        raise SpecdecError("--data names no directory")
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:  # e.g. a "~" the shell left unexpanded after a comma
        raise SpecdecError(f"--data: directory not found: {', '.join(missing)}")
    if not any(list_shards(d) for d in dirs):
        raise SpecdecError(f"--data {cfg.data} holds no data shards (shard-*.safetensors): run `specdec datagen` "
                           "first")


def load_resume(cfg: LoopConfig, mmap: bool = False) -> dict | None:
    """The newest checkpoint's state of the run in cfg.out, else the one kept in cfg.keep_in (its
    "model" None, "weights" its dir, no "optimizer"); None: a new run. A SpecdecError when its resume
    settings differ from cfg's. mmap: the tensors left on disk (only the settings are read)."""
    out = Path(cfg.out)
    ckpts = checkpoints(out)
    if ckpts:
        resume = torch.load(ckpts[-1] / "state.pt", map_location="cpu", weights_only=False, mmap=mmap)
    elif cfg.keep_in and (Path(cfg.keep_in) / KEPT).is_file():
        out = Path(cfg.keep_in)
        resume = json.loads((out / KEPT).read_text()) | {"model": None, "weights": out / "weights"}
    else:
        return None
    saved = type(cfg).from_dict(resume["config"])
    for k in cfg.resume_keys():
        if getattr(saved, k) != getattr(cfg, k):
            raise SpecdecError(f"{out} holds a run with {k}={getattr(saved, k)!r}, not {getattr(cfg, k)!r}: "
                               "resume with the same settings or use another --out")
    return resume


KEPT, LOG = "state.json", "log.jsonl"


def keep_checkpoint(dest: Path, model: torch.nn.Module, sched, step: int, state: dict,
                    write: Callable[[torch.nn.Module, Path], None], log: Path | None = None) -> None:
    """A checkpoint small enough to commit: `write(model, dir)`'s small copy of the trained weights (fp16,
    files of <= 16 MiB, parameters that never move left out), the schedule and the step, and the run's
    `log` (its log.jsonl) up to that step, whose curves outlive the machine. Why no optimizer moments: they
    triple the size, and Adam rebuilds them within its first steps."""
    with atomic_dir(dest) as tmp:
        write(model, tmp / "weights")
        keep = {k: state[k] for k in ("config", "shards", "seconds")}
        (tmp / KEPT).write_text(json.dumps(keep | {"step": step, "scheduler": sched.state_dict()}, indent=1))
        if log is not None and log.is_file():
            (tmp / LOG).write_text("".join(log_lines(log, step)))


def log_lines(log: Path, last: int) -> list[str]:
    """The lines of a log.jsonl up to step `last`."""
    return [ln + "\n" for ln in log.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last]


def write_kept(model: torch.nn.Module, dest: Path) -> None:
    """The trained weights as keep_checkpoint keeps them by default: fp16 safetensors files of <= 16 MiB,
    frozen parameters left out (the run rebuilds them)."""
    from huggingface_hub import save_torch_state_dict

    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    sd = {k: v.detach().cpu().to(torch.float16) if v.is_floating_point() else v.detach().cpu()
          for k, v in model.state_dict().items() if k not in frozen}
    Path(dest).mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(sd, dest, max_shard_size="16MB")


def read_kept(model: torch.nn.Module, weights: Path) -> None:
    """write_kept's weights into `model` (fp32); what they leave out must be frozen."""
    from huggingface_hub import load_torch_model

    got = load_torch_model(model, weights, strict=False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if got.unexpected_keys or set(got.missing_keys) - frozen:
        raise SpecdecError(f"{weights} holds other weights than this run trains (missing "
                           f"{sorted(set(got.missing_keys) - frozen)[:3]}, unexpected {got.unexpected_keys[:3]})")


def same_start(acc, start: int, out: str) -> None:
    """Every process resumes from the same step: a process that cannot see rank 0's checkpoints would
    otherwise train from another state (or wait forever for the others)."""
    if acc.num_processes == 1:
        return
    starts = acc.gather(torch.tensor([start], device=acc.device)).tolist()
    if len(set(starts)) > 1:
        raise SpecdecError(f"the processes found different checkpoints in {out} (steps {starts}): --out must be "
                           "on a file system every process sees")


def load_data(cfg, resume: dict | None, fingerprint: dict, hidden_size: int, world: int,
              main: bool = True, aux: bool = False, features=None) -> tuple[ShardData, int]:
    """The run's shards (a resume: exactly the ones it started with), checked against the target, and
    the run's total step count. aux, features: ShardData's."""
    data = ShardData(cfg.data, resume["shards"] if resume else None, cfg.max_len, aux, features)
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
    if len(data) < world:  # a step's batch holds every sequence at most: some process would get none
        raise SpecdecError(f"the {len(data)} trainable sequences in {cfg.data} are fewer than the {world} processes")
    return data, total


def start_log(out: Path, cfg, start: int) -> Path:
    """Main process: the run's config.json, and log.jsonl without the lines of steps a killed run did
    after its last checkpoint; a run resumed from a kept checkpoint (--keep-in) starts it from the kept log."""
    log_f = out / LOG
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=1))
    kept = Path(cfg.keep_in) / LOG if cfg.keep_in else None
    source = log_f if log_f.is_file() else kept if start and kept is not None and kept.is_file() else None
    if source is not None:
        log_f.write_text("".join(log_lines(source, start)))
    return log_f


def global_sum(acc, x: torch.Tensor) -> torch.Tensor:
    """x summed over the processes (a copy)."""
    return acc.reduce(x.detach().clone(), reduction="sum") if acc.num_processes > 1 else x.detach().clone()


def load_target(path, spec):
    """The target (`path`: materialize(spec)) for training, fp32: only its embeddings and LM head are used,
    no tokenizer needed."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        raise SpecdecError(f"could not load the target model {spec!r}: {e}") from None
