"""The skeleton every draft-head trainer runs (train.py's EAGLE, FSPAD and EAGLE-3 heads, medusa.py's
Medusa-1 heads, medusa_joint.py's Medusa-2): a finished run is only reported; otherwise the data is checked
against the target, the model built (or warm-started), a checkpoint's state restored, and the step loop
runs; at the end of a complete run the result is written. A trainer fills the hooks: `model`, `trainable`,
`optimizer`, `objective` (setup and model), `loss` and `record` (batch -> loss, log line), `write` and
`finish` (save, eval).

The loop: step s trains on `global_batch(s)`; each process takes its slice of it and the trainer's `loss`
normalises by the global row count (DDP averages gradients over processes), so N processes follow the
1-process run (`torchrun` or `accelerate launch`: DDP, gloo on CPU, nccl on CUDA; each process reads
only its rows of the memory-mapped shards). Only the main process writes checkpoints and logs, and every
process resumes from the newest checkpoint. It writes a checkpoint every `save_every` steps and at the
end, logs every `log_every` steps to log.jsonl, and stops after `stop_after` steps (a testing aid: as if killed).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.heads.shipped import target_fingerprint
from specdec.runtime.gguf import float_weight
from specdec.training.config import LoopConfig
from specdec.training.loop import (
    finished_run,
    keep_checkpoint,
    load_data,
    load_resume,
    read_kept,
    same_start,
    save_checkpoint,
    start_log,
    write_kept,
)
from specdec.training.shards import global_batch


@dataclass
class Run:
    """A run's state as the step loop takes it: `module` is accelerate-prepared and `module.head` is what
    a checkpoint holds; `seconds` is what earlier invocations of the run took."""

    module: nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    params: list[nn.Parameter]
    start: int
    state: dict  # what every checkpoint also holds (config, shards, the result's metadata)
    seconds: float = 0.0


class Trainer:
    """Trains `target`'s draft model as `cfg` says; `train()` returns a summary. Subclasses fill the hooks."""

    result = "head"  # the result's dir under --out; its config.json marks a finished run
    aux = False  # the data's aux-layer features are read too
    stats_shape: tuple[int, ...] = (1,)

    def __init__(self, cfg: LoopConfig, target, accelerator=None, progress: bool = True, features=None) -> None:
        """features: sequences -> the target's features, for data of token ids alone (shards.ShardData)."""
        self.cfg, self.target, self.acc, self.progress, self.features = cfg, target, accelerator, progress, features
        # [vocab, hidden] on the CPU (a GGUF file's quantized rows de-quantized)
        self.target_lm = float_weight(target.get_output_embeddings().weight).detach().float()

    # ---- hooks ----

    def finished(self, path: Path, steps: int) -> dict:
        """The summary of a re-run of a finished run (the result in `path`)."""
        raise NotImplementedError

    def setup(self) -> None:
        """Checks and device tensors, once the accelerator is known."""

    def model(self) -> nn.Module:
        """The model to train, new or warm-started (before a resume's state is loaded)."""
        raise NotImplementedError

    def trainable(self, model: nn.Module) -> nn.Module:
        """What a checkpoint holds (its state_dict is the resumed state)."""
        return model

    def write_kept(self, trained: nn.Module, dest: Path) -> None:
        """The trained weights of a kept checkpoint (--keep-in): fp16, files of <= 16 MiB."""
        write_kept(trained, dest)

    def read_kept(self, trained: nn.Module, weights: Path) -> None:
        """write_kept's weights back into `trained`."""
        read_kept(trained, weights)

    def optimizer(self, trained: nn.Module) -> tuple[list[nn.Parameter], torch.optim.Optimizer,
                                                     torch.optim.lr_scheduler.LRScheduler]:
        raise NotImplementedError

    def objective(self, trained: nn.Module) -> nn.Module:
        """The module whose forward is the loss; its `.head` is `trained`."""
        raise NotImplementedError

    def loss(self, step: int, mine: list[int], ids, feats, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss of this process's rows `mine` of step `step`, stats of `stats_shape` summed in logs)."""
        raise NotImplementedError

    def record(self, stats: torch.Tensor) -> tuple[dict, dict]:
        """(the log line's fields, the progress bar's) from the stats summed since the last line."""
        raise NotImplementedError

    def write(self, trained: nn.Module, ckpt: Path) -> None:
        """The result's files in a checkpoint dir, beside state.pt."""

    def finish(self, final: nn.Module, step: int, seconds: float) -> dict:
        """The end of this invocation (`step` == the total: the run is complete): write the result; the
        summary's own fields."""
        raise NotImplementedError

    # ---- the skeleton ----

    def train(self) -> dict:
        from accelerate import Accelerator

        cfg = self.cfg
        cfg.check()
        done = finished_run(cfg, self.result)
        if done is not None:  # nothing to do: a re-run of a finished run only reports it
            return self.finished(*done)
        own = self.acc is None
        if own:
            self.acc = Accelerator(cpu=not torch.cuda.is_available())
        acc = self.acc
        self.setup()
        fp = target_fingerprint(self.target)
        self.resume = resume = load_resume(cfg)
        same_start(acc, resume["step"] if resume else 0, cfg.out)
        self.data, self.total = load_data(cfg, resume, fp, self.target_lm.shape[1], acc.num_processes,
                                          acc.is_main_process, self.aux, self.features)
        torch.manual_seed(cfg.seed)
        model = self.model()
        self.meta = {"target": fp, "training": {"data_tokens": self.data.n_tokens, "data_sequences": len(self.data),
                                                "steps": self.total,
                                                "config": cfg.model_dump() | {"stop_after": 0, "ship_to": ""}}}
        trained = self.trainable(model)
        if resume is not None and resume["model"] is not None:
            trained.load_state_dict(resume["model"])
        trained.to(acc.device)
        params, opt, sched = self.optimizer(trained)
        if resume is not None:
            if resume["model"] is None:  # a kept checkpoint (--keep-in): weights only, the optimizer starts afresh
                self.read_kept(trained, resume["weights"])
            else:
                opt.load_state_dict(resume["optimizer"])
            sched.load_state_dict(resume["scheduler"])
        self.module = module = acc.prepare(self.objective(trained))
        state = {"config": cfg.model_dump(), "shards": self.data.names, "head_meta": self.meta}
        self.earlier = (resume or {}).get("seconds", 0.0)
        step, history, seconds = self.steps(Run(module, opt, sched, params, resume["step"] if resume else 0, state,
                                                self.earlier))
        summary = {"steps": step, "total_steps": self.total, "history": history, "seconds": seconds,
                   "data_tokens": self.data.n_tokens}
        summary |= self.finish(acc.unwrap_model(module).head, step, seconds)
        acc.wait_for_everyone()
        if own and acc.num_processes > 1:
            # DDP's reducer frees without releasing the GIL: if it held the last reference to the gloo group, the
            # group's teardown would join a worker thread that waits for the GIL (a hang). Free it first, while the
            # group is still registered, then end the group (which does release the GIL); a process that exits
            # with its group alive can abort in the group's threads' teardown.
            self.module = module = None
            acc.free_memory()
            acc.end_training()
        return summary

    def steps(self, run: Run) -> tuple[int, list[dict], float]:
        """Train from step run.start to the total. Returns (the step reached, the log lines, this
        invocation's seconds); a checkpoint's "seconds" adds this invocation's to run.seconds."""
        from tqdm import tqdm

        cfg, acc, data, total = self.cfg, self.acc, self.data, self.total
        rank, world, dev = acc.process_index, acc.num_processes, acc.device
        out = Path(cfg.out)
        log_f = out / "log.jsonl"
        if acc.is_main_process:
            start_log(out, cfg, run.start)
        acc.wait_for_everyone()
        bar = tqdm(total=total, initial=run.start, disable=not (self.progress and acc.is_main_process), unit="step",
                   desc=f"train {cfg.kind}", dynamic_ncols=True)
        acc_stats = torch.zeros(self.stats_shape, device=dev)
        t0, tok_done, history = time.perf_counter(), 0, []
        step = run.start
        run.module.train()
        while step < total:
            mine = global_batch(len(data), cfg.batch_size, cfg.seed, step)[rank::world]
            ids, feats, mask = (t.to(dev) for t in data.batch(mine))
            # bf16 by autocast, not accelerate's mixed_precision: that one is fixed per process
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
                loss, stats = self.loss(step, mine, ids, feats, mask)
            run.opt.zero_grad(set_to_none=True)
            acc.backward(loss)
            if cfg.clip > 0:
                acc.clip_grad_norm_(run.params, cfg.clip)
            run.opt.step()
            run.sched.step()
            step += 1
            acc_stats += stats
            tok_done += sum(data.spans[i][1] - data.spans[i][0] for i in mine)
            bar.update(1)
            if step % cfg.log_every == 0 or step == total:
                s = acc.reduce(acc_stats.clone(), reduction="sum") if world > 1 else acc_stats
                fields_, postfix = self.record(s)
                rec = {"step": step, **fields_, "lr": run.sched.get_last_lr()[0],
                       "tokens_per_s": tok_done * world / (time.perf_counter() - t0), "processes": world}
                history.append(rec)
                bar.set_postfix(**postfix)
                if acc.is_main_process:
                    with log_f.open("a") as fh:
                        fh.write(json.dumps(rec) + "\n")
                acc_stats.zero_()
            if (step % cfg.save_every == 0 or step == total) and acc.is_main_process:
                save_checkpoint(out, acc.unwrap_model(run.module).head, run.opt, run.sched, step,
                                run.state | {"seconds": run.seconds + time.perf_counter() - t0}, cfg.keep_checkpoints,
                                self.write)
                if cfg.keep_in:
                    keep_checkpoint(Path(cfg.keep_in), acc.unwrap_model(run.module).head, run.sched, step,
                                    run.state | {"seconds": run.seconds + time.perf_counter() - t0}, self.write_kept,
                                    log_f)
            acc.wait_for_everyone()
            if cfg.stop_after and step - run.start >= cfg.stop_after and step < total:
                break
        bar.close()
        return step, history, time.perf_counter() - t0
