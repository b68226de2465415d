"""Train an EAGLE head, or FSPAD's variants (--connector sampler, --pad), or an EAGLE-3 head (--arch eagle3:
`train eagle3`; shards from datagen --aux-layers eagle3; CE only, as EAGLE-3 has no feature loss, and
--unroll is its training-time test), on datagen shards (docs/design.md, "Training data").

Row t of a sequence reads (x_{t+1}, f_t + noise) and predicts f_{t+1}:
loss = SmoothL1(f̂_{t+1}, f_{t+1}) + w · CE(p_target, p̂), p = softmax of the (draft-vocabulary) LM head
on f_{t+1} and f̂_{t+1}, averaged over rows whose input token x_{t+1} is an answer token.

Exact resume: batches and noise are pure functions of (seed, step, sequence), so a checkpoint needs only
the head, the optimizer, the scheduler and the step; it is written to a temporary dir and renamed.
Multi-process: `accelerate launch --multi_gpu --num_processes 2 -m specdec.cli train eagle ...` (on a
machine without GPUs this is torchrun -> MULTI_CPU, gloo, DDP; `--cpu` would start a single process);
each process takes a slice of the same global batch and the loss is normalised by the global token
count, so N processes follow the 1-process run. The step loop, checkpoints, the resume check and the data
checks are loop.py's, shared with `train medusa` (medusa.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.heads.fspad import CONNECTORS
from specdec.heads.shipped import target_fingerprint
from specdec.options import add_flags, arg_type, flag_values
from specdec.target.loading import Runtime, materialize
from specdec.training import medusa
from specdec.training.datagen import one_line_errors
from specdec.training.loop import (
    LOOP_RULES,
    SCHEDULES,
    LoopConfig,
    add_config_flags,
    finished_run,
    global_sum,
    knob,
    load_data,
    load_resume,
    load_target,
    lr_lambda,
    run_steps,
)
from specdec.training.objective import Objective, unrolled, unrolled_mask
from specdec.training.shards import aux_layers_of, build_draft_vocab

# the heads (and with them transformers) are imported inside functions: the CLI parser imports this module
__all__ = ["TrainConfig", "train_eagle", "finished_head", "lr_lambda", "unrolled", "unrolled_mask"]


@dataclass
class TrainConfig(LoopConfig):
    # the shipped head's recipe (docs/training.md section 3; lr 1e-3 beat 3e-4 in a probe)
    epochs: float = knob(3.0, "passes over the data, when --steps is 0", "X")
    lr: float = knob(1e-3, "peak learning rate (AdamW)", "X")
    log_every: int = knob(20, "a line of log.jsonl (loss, top-1 agreement, lr) every N steps", "N")
    ce_weight: float = knob(0.1, "weight of the cross-entropy to the target's next-token distribution, beside "
                            "the feature loss", "X")
    tv_weight: float = knob(0.0, "> 0: also minimise TV(p, q), what a sampled draft token loses at T = 1", "X")
    noise: float = knob(0.1, "input features get U(-noise, noise)", "X")
    draft_vocab: int = knob(0, "the head's own LM head over the N most frequent answer tokens (the shipped "
                            "SmolLM2 head: 8192); 0: the target's full, frozen LM head", "N")
    freeze_lm_head: bool = knob(False, "with --draft-vocab: keep the LM-head rows copied from the target (the "
                                "shipped recipe; --ship-to then stores none of them)")
    unroll: int = knob(1, "draft steps trained per row: > 1 also trains on the head's own predictions", "N")
    layers: int = knob(0, "decoder layers: 0 = 1 (EAGLE), or as many as --init-from has; more grows that "
                       "head", "N")
    connector: str = knob("fc", "fc (EAGLE) or sampler (FSPAD's Feature Sampler)")
    pad: bool = knob(False, "FSPAD's Partial Alignment Distillation")
    sampler_size: int = knob(0, "the Feature Sampler's intermediate size; 0: the target's intermediate_size",
                             "N")
    arch: str = knob("eagle", "eagle (EAGLE-1/2, FSPAD) or eagle3 (fused low/middle/high target features; data: "
                     "datagen --aux-layers eagle3)")

    def check(self) -> None:
        """The CLI's rules for API callers too: a SpecdecError before any work."""
        self.check_rules(RULES)
        if self.arch not in ARCHS:
            raise SpecdecError(f"--arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if self.connector not in CONNECTORS:
            raise SpecdecError(f"--connector must be one of {', '.join(CONNECTORS)}, got {self.connector!r}")
        if self.sampler_size and self.connector != "sampler":
            raise SpecdecError("--sampler-size needs --connector sampler")
        if self.arch == "eagle3":
            for flag, given in (("--connector", self.connector != "fc"), ("--pad", self.pad),
                                ("--layers", self.layers > 1)):
                if given:
                    raise SpecdecError(f"{flag} does not apply to an EAGLE-3 head (--arch eagle3: one layer, its "
                                       "own connector)")

    @property
    def kind(self) -> str:
        if self.arch == "eagle3":
            return "eagle3"
        return "fspad" if (self.connector, self.pad) == ("sampler", True) else "eagle"


ARCHS = ("eagle", "eagle3")
# the argparse types of the numeric options (steps 0 = derived from epochs; layers 0 = the default)
RULES = {
    **LOOP_RULES, "ce_weight": arg_type(float, ge=0), "tv_weight": arg_type(float, ge=0),
    "noise": arg_type(float, ge=0), "draft_vocab": arg_type(int, ge=0), "unroll": arg_type(int, ge=1),
    "layers": arg_type(int, ge=0), "sampler_size": arg_type(int, ge=0),
}
# what a resumed (or re-run) run must share with the one in --out
RESUME_KEYS = ("data", "steps", "epochs", "batch_size", "max_len", "lr", "warmup", "schedule", "min_lr_ratio",
               "weight_decay", "draft_vocab", "freeze_lm_head", "seed", "noise", "ce_weight", "tv_weight", "clip",
               "init_from", "unroll", "layers", "connector", "pad", "sampler_size", "arch")


# ---- the trainer ----

def finished_head(cfg: TrainConfig) -> tuple[Path, int] | None:
    """(cfg.out/head, its step count) when this run is complete: the head is written, the last checkpoint
    is its final step, the settings are the same (and a --ship-to copy exists); else None."""
    return finished_run(cfg, TrainConfig, RESUME_KEYS, "head")


def train_eagle(cfg: TrainConfig, target_model, accelerator=None, progress: bool = True) -> dict:
    """Train (or resume) an EAGLE head for `target_model`. Returns a summary; the head ends up in
    cfg.out/head (an HF-style dir usable with `--head`)."""
    from accelerate import Accelerator

    from specdec.heads.io import load_head, save_head
    from specdec.heads.model import Eagle3Head, EagleHead, head_config

    cfg.check()
    done = finished_head(cfg)
    if done is not None:  # nothing to do: a re-run of a finished run only reports it
        lm = target_model.get_output_embeddings().weight.detach().float()
        head = load_head(done[0], lm.shape[1], lm.shape[0], target_lm_head=lm)
        return {"steps": done[1], "total_steps": done[1], "history": [], "head": head, "finished": True,
                "seconds": 0.0, "data_tokens": head.meta.get("training", {}).get("data_tokens", 0)}
    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    world, dev = acc.num_processes, acc.device
    emb = target_model.get_input_embeddings().weight.detach().to(dev, torch.float32)
    target_lm = target_model.get_output_embeddings().weight.detach().to(dev, torch.float32)
    fp = target_fingerprint(target_model)
    resume = load_resume(cfg, TrainConfig, RESUME_KEYS)
    eagle3 = cfg.arch == "eagle3"
    data, total = load_data(cfg, resume, fp, target_model.config.hidden_size, world, acc.is_main_process, eagle3)

    torch.manual_seed(cfg.seed)
    if cfg.init_from:  # the warm start fixes the draft vocabulary too (its rows may come from the target)
        head = load_head(cfg.init_from, hidden_size=emb.shape[1], vocab_size=emb.shape[0],
                         target_lm_head=target_lm.cpu()).train()
        vd = head.draft_vocab_size or head.vocab_size
        if head.kind != cfg.kind and (eagle3 or head.kind == "eagle3"):
            raise SpecdecError(f"--init-from {cfg.init_from} is an {head.kind} head, not --arch {cfg.arch}")
        if head.aux_layers != data.aux_layers:
            raise SpecdecError(f"--init-from {cfg.init_from} reads target layers {list(head.aux_layers)}, the data "
                               f"holds {list(data.aux_layers)}")
        if cfg.draft_vocab and cfg.draft_vocab != vd:
            raise SpecdecError(f"--init-from {cfg.init_from} has a draft vocabulary of {vd}, "
                               f"not --draft-vocab {cfg.draft_vocab}")
        if (head.connector, head.pad) != (cfg.connector, cfg.pad):  # e.g. FSPAD warm-started from EAGLE
            try:
                head = head.with_variant(cfg.connector, cfg.pad, cfg.sampler_size or None)
            except SpecdecError as e:
                raise SpecdecError(f"--init-from {cfg.init_from}: {e}") from None
        elif cfg.sampler_size not in (0, head.sampler_size or 0):
            raise SpecdecError(f"--init-from {cfg.init_from} has sampler size {head.sampler_size}: pass the same "
                               "--sampler-size")
        if cfg.layers:
            head.grow(cfg.layers)
    else:
        if eagle3:
            head = Eagle3Head(head_config(target_model.config), data.aux_layers)
        else:
            head = EagleHead(head_config(target_model.config, num_hidden_layers=cfg.layers or 1),
                             connector=cfg.connector, pad=cfg.pad, sampler_size=cfg.sampler_size or None)
        if cfg.draft_vocab:
            eos = getattr(target_model.config, "eos_token_id", None)
            always = set([eos] if isinstance(eos, int) else (eos or []))
            vocab = build_draft_vocab(data.token_counts(emb.shape[0]), cfg.draft_vocab, always)
            head.set_draft_vocab(vocab, target_lm.cpu())
    if resume is not None:
        head.load_state_dict(resume["model"])
    head.to(dev)
    if head.lm_head is not None and cfg.freeze_lm_head:
        head.lm_head.weight.requires_grad_(False)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
    start = resume["step"] if resume else 0
    objective = acc.prepare(Objective(head, emb, target_lm, cfg.unroll))

    n_data = data.n_tokens
    head_meta = {"target": fp, "training": {"data_tokens": n_data, "data_sequences": len(data), "steps": total,
                                            "config": asdict(cfg) | {"stop_after": 0, "ship_to": ""}}}
    state = {"config": asdict(cfg), "shards": data.names, "head_meta": head_meta}

    h = target_model.config.hidden_size

    def step_fn(step, mine, ids, feats, mask):
        n_global = float(global_sum(acc, mask[:, 1:].sum()))
        feats, aux = (feats[..., :h], feats[..., h:]) if eagle3 else (feats, None)
        noise = None
        if cfg.noise > 0:  # per sequence and step: independent of how the batch is split over processes
            noise = torch.zeros((feats if aux is None else aux)[:, :-1].shape)
            for r, i in enumerate(mine):
                g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 1_000_033 + i)
                n_i = data.spans[i][1] - data.spans[i][0] - 1
                noise[r, :n_i] = (torch.rand(n_i, noise.shape[-1], generator=g) * 2 - 1) * cfg.noise
            noise = noise.to(dev)
        # DDP averages gradients over processes: scale so the sum matches a global token mean
        return objective(ids, feats, mask, noise, max(n_global, 1.0) / world, cfg.ce_weight,
                         cfg.tv_weight, aux)

    def record(s):
        n = max(float(s[0, 3]), 1.0)  # step 0 (= plain EAGLE training) keeps the old fields
        loss = float(s[0, 0]) + cfg.ce_weight * float(s[0, 1]) + cfg.tv_weight * float(s[0, 4])
        # t1_accept = 1 - TV: a sampled draft token's acceptance at T = 1 (over the draft vocabulary)
        rec = {"loss": loss / n, "feature_loss": float(s[0, 0]) / n, "ce": float(s[0, 1]) / n,
               "top1_acc": float(s[0, 2]) / n, "t1_accept": 1 - float(s[0, 4]) / n}
        if cfg.unroll > 1:
            rec["top1_acc_by_step"] = [round(float(r[2]) / max(float(r[3]), 1.0), 4) for r in s]
        return rec, {"loss": f"{rec['loss']:.3f}", "acc": f"{rec['top1_acc']:.3f}"}

    step, history, seconds = run_steps(
        acc, cfg, data, objective, opt, sched, params, total, start, state, step_fn, record, (cfg.unroll, 5),
        lambda h, d: save_head(h, d / "head", extra=head_meta), f"train {cfg.kind}", progress,
        (resume or {}).get("seconds", 0.0))
    final = acc.unwrap_model(objective).head
    if step == total and acc.is_main_process:
        save_head(final, Path(cfg.out) / "head", extra=head_meta)
        if cfg.ship_to:
            save_head(final, cfg.ship_to, extra=head_meta, dtype=torch.float16, lm_head=not cfg.freeze_lm_head)
    acc.wait_for_everyone()
    return {"steps": step, "total_steps": total, "history": history, "head": final,
            "seconds": seconds, "data_tokens": n_data}


# ---- CLI ----

def add_parser(sub) -> None:
    tp = sub.add_parser("train", help="train a draft head on `specdec datagen` data")
    one_line_errors(tp)
    kinds = tp.add_subparsers(dest="kind", required=True)
    for kind, fixed, what in (("eagle", {}, "an EAGLE-1/2 head, or FSPAD's ablations (--connector sampler, --pad)"),
                              ("fspad", {"connector": "sampler", "pad": True}, "an FSPAD head: train eagle "
                               "--connector sampler --pad"),
                              ("eagle3", {"arch": "eagle3", "connector": "fc", "pad": False, "sampler_size": 0,
                                          "layers": 0},
                               "an EAGLE-3 head (data: datagen --aux-layers eagle3): train eagle --arch eagle3")):
        p = one_line_errors(kinds.add_parser(kind, help=f"{what} (resumes from --out if it holds checkpoints)"))
        p.add_argument("--model", default=None, metavar="PATH", help="the target, the one the data was made "
                       "with: HF dir, .gguf, or smollm2 (default: the embedded SmolLM2-135M-Instruct)")
        p.add_argument("--data", required=True, metavar="DIR[,DIR...]", help="datagen dir(s), comma-separated")
        p.add_argument("--out", required=True, metavar="DIR", help="run dir: checkpoints/, log.jsonl, head/ "
                       "(the result); re-run the same command to resume")
        choices = {"schedule": SCHEDULES, "connector": CONNECTORS, "arch": ARCHS}
        add_config_flags(p, TrainConfig, RULES, choices, skip=fixed)
        add_flags(p, Runtime, only=("threads",))
        p.set_defaults(func=cmd_train_eagle, **fixed)
    medusa.add_parser(kinds)


def cmd_train_eagle(args) -> int:
    Runtime.parse(flag_values(args, Runtime)).apply()
    cfg = TrainConfig.from_dict(vars(args))
    cfg.check()
    if cfg.arch == "eagle3":  # the data's aux layers, before the target loads
        aux_layers_of(cfg.data)
    done = finished_head(cfg)
    if done is not None:  # before the target loads: nothing else happens
        print(f"train {cfg.kind}: {cfg.out} is already finished (step {done[1]}/{done[1]}); the head is in {done[0]}")
        return 0
    model = load_target(materialize(args.model), args.model)
    r = train_eagle(cfg, model)
    head, steps = Path(cfg.out) / "head", f"step {r['steps']}/{r['total_steps']}"
    last = r["history"][-1] if r["history"] else None
    if r.get("finished"):
        print(f"train {cfg.kind}: {cfg.out} is already finished ({steps}); the head is in {head}")
    elif r["steps"] < r["total_steps"]:
        print(f"train {cfg.kind}: stopped at {steps}; re-run the same command to resume")
    else:
        loss = f"; loss {last['loss']:.4f}, top-1 agreement {last['top1_acc']:.3f}" if last else ""
        print(f"train {cfg.kind}: {steps} in {r['seconds']:.0f} s{loss}; head: {head}")
    return 0
