"""Train Medusa heads on datagen shards: `specdec train medusa` (Medusa-1: the target frozen, the heads
read the stored features) and `specdec train medusa --joint` (Medusa-2, medusa_joint.py: the backbone is
trained with the heads and saved as a new target).

The loss and the accuracies are medusa_objective.py's. Medusa-1: nothing but the heads has gradients; at
the end, each head's top-i accuracy on held-in data goes into the heads' config.json (specdec.accuracies),
from which the `medusa` method builds Medusa's sparse tree.

The step loop, checkpoints, exact resume and multi-process runs are train.py's (loop.py); both kinds share
this config, its flags and the checks before training (data, draft vocabulary, resume settings).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.heads.medusa import LM_HEADS, MedusaHeads
from specdec.heads.medusa_io import load_medusa, save_medusa
from specdec.heads.shipped import target_fingerprint
from specdec.options import add_flags, arg_type, flag_values
from specdec.target.loading import Runtime, materialize
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
from specdec.training.medusa_joint import train_joint
from specdec.training.medusa_objective import MedusaObjective, head_accuracies, heads_record, held_in
from specdec.training.shards import build_draft_vocab

__all__ = ["MedusaTrainConfig", "train_medusa", "head_accuracies", "held_in", "MedusaObjective"]


@dataclass
class MedusaTrainConfig(LoopConfig):
    # Medusa's own settings and docs/training.md section 5's recipe
    lr: float = knob(1e-3, "peak learning rate (AdamW; Medusa's)", "X")
    warmup: int = knob(20, "steps of linear warmup to --lr; a warmup as long as the whole run is cut to a "
                       "tenth of it, with a note", "N")
    clip: float = knob(1.0, "gradient-norm clip (0: none)", "X")
    num_heads: int = knob(4, "heads; head k predicts the token k + 2 positions ahead", "N")
    num_layers: int = knob(1, "residual blocks per head", "N")
    lm_head: str = knob("target", "target (the target's, shared and frozen) or own (one per head, from the "
                        "target's rows, trained)")
    draft_vocab: int = knob(0, "LM heads over the N most frequent answer tokens (the shipped SmolLM2 heads: "
                            "8192); 0: the full target vocabulary", "N")
    decay: float = knob(0.8, "head k's loss weight is decay^(k+1)", "X")
    # Medusa-2 (--joint): L = KL(p_original || p_new) + lambda0 * the heads' loss, the backbone trained too
    joint: bool = knob(False, "Medusa-2: train the backbone too; the result is a new target in <out>/target")
    lambda0: float = knob(0.2, "--joint: the heads' loss weight (Medusa's medusa_heads_coefficient)", "X")
    backbone_lr: float = knob(0.0, "--joint: the backbone's lr; 0: --lr / 4 (Medusa's ratio)", "X")
    heads_warmup: int = knob(-1, "--joint: first steps that train only the heads; -1: a quarter of the run", "N")
    full_finetune: bool = knob(False, "--joint: train every backbone weight instead of LoRA adapters")
    lora_rank: int = knob(16, "--joint: LoRA rank", "N")
    lora_alpha: float = knob(32.0, "--joint: LoRA alpha", "X")
    # the layers below the adapters run without a graph, so a step's backward covers N layers
    lora_layers: int = knob(0, "--joint: adapters on the last N decoder layers only; 0: all", "N")
    # recomputing costs ~10%; SmolLM2-135M, batch 4 (~1,350 tokens): peak RSS 9.8 GB instead of 6.9
    keep_activations: bool = knob(False, "--joint: keep the backbone's activations for the backward pass "
                                  "instead of recomputing them (faster, far more memory)")

    def check(self) -> None:
        """The CLI's rules for API callers too: a SpecdecError naming the flag, before any work."""
        self.check_rules(RULES)
        if self.lm_head not in LM_HEADS:
            raise SpecdecError(f"--lm-head must be one of {', '.join(LM_HEADS)}, got {self.lm_head!r}")
        if self.full_finetune and not self.joint:
            raise SpecdecError("--full-finetune trains the backbone: it needs --joint")
        if self.lora_layers and self.full_finetune:
            raise SpecdecError("--lora-layers limits LoRA's adapters: it does not apply to --full-finetune")

    @property
    def kind(self) -> str:
        return "medusa-2" if self.joint else "medusa"

    @property
    def weights(self) -> list[float]:
        return [self.decay ** (k + 1) for k in range(self.num_heads)]


RULES = {
    **LOOP_RULES, "max_len": arg_type(int, ge=3), "num_heads": arg_type(int, ge=1, le=16),
    "num_layers": arg_type(int, ge=1), "draft_vocab": arg_type(int, ge=0), "decay": arg_type(float, gt=0, le=1),
    "lambda0": arg_type(float, ge=0), "backbone_lr": arg_type(float, ge=0), "heads_warmup": arg_type(int, ge=-1),
    "lora_rank": arg_type(int, ge=1), "lora_alpha": arg_type(float, gt=0), "lora_layers": arg_type(int, ge=0),
}
# what a resumed (or re-run) run must share with the one in --out
RESUME_KEYS = ("data", "steps", "epochs", "batch_size", "max_len", "lr", "warmup", "schedule", "min_lr_ratio",
               "weight_decay", "clip", "num_heads", "num_layers", "lm_head", "draft_vocab", "decay", "seed", "joint",
               "init_from", "lambda0", "backbone_lr", "heads_warmup", "full_finetune", "lora_rank", "lora_alpha",
               "lora_layers")


# ---- the trainer ----

def finished_heads(cfg: MedusaTrainConfig) -> tuple[Path, int] | None:
    """(cfg.out/heads, its step count) when this run is complete; else None (see loop.finished_run)."""
    return finished_run(cfg, MedusaTrainConfig, RESUME_KEYS, "heads")


def warm_start(cfg: MedusaTrainConfig, hidden: int, vocab: int, lm_cpu: torch.Tensor) -> MedusaHeads:
    """The --init-from heads, checked against the run's flags (shape, LM head kind, draft vocabulary)."""
    heads = load_medusa(cfg.init_from, hidden, vocab, target_lm_head=lm_cpu).train()
    have = {"num_heads": heads.num_heads, "num_layers": heads.num_layers, "lm_head": heads.lm_head_kind,
            "draft_vocab": 0 if heads.d2t is None else heads.draft_vocab_size}
    for k, v in have.items():
        if getattr(cfg, k) != v:
            flag = "--" + k.replace("_", "-")
            raise SpecdecError(f"--init-from {cfg.init_from} has {k}={v}: pass {flag} {v}, not {getattr(cfg, k)}")
    heads.meta = {}
    return heads


def train_medusa(cfg: MedusaTrainConfig, target_model, accelerator=None, progress: bool = True) -> dict:
    """Train (or resume) Medusa heads for `target_model`. Returns a summary; the heads end up in
    cfg.out/heads (usable with `medusa:heads=<dir>`), with --joint next to a new target in cfg.out/target
    (the heads are for that target; `target_model` itself is left as it was)."""
    from accelerate import Accelerator

    cfg.check()
    done = finished_heads(cfg)
    lm_cpu = target_model.get_output_embeddings().weight.detach().float()
    vocab, hidden = lm_cpu.shape
    if done is not None:  # nothing to do: a re-run of a finished run only reports it
        heads = load_medusa(done[0], hidden, vocab, target_lm_head=lm_cpu)
        return {"steps": done[1], "total_steps": done[1], "history": [], "heads": heads, "finished": True,
                "seconds": 0.0, "data_tokens": heads.meta.get("training", {}).get("data_tokens", 0),
                "accuracies": heads.meta.get("accuracies"), "drift": heads.meta.get("drift"),
                "target": str(Path(cfg.out) / "target") if cfg.joint else None}
    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    world, dev = acc.num_processes, acc.device
    if cfg.joint and world > 1:
        raise SpecdecError(f"--joint trains in one process for now, not {world}: run it without accelerate launch")
    fp = target_fingerprint(target_model)
    resume = load_resume(cfg, MedusaTrainConfig, RESUME_KEYS)
    data, total = load_data(cfg, resume, fp, hidden, world, acc.is_main_process)

    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        heads = warm_start(cfg, hidden, vocab, lm_cpu)
    else:
        heads = MedusaHeads(hidden, vocab, cfg.num_heads, cfg.num_layers, cfg.lm_head)
        draft_ids = None
        if cfg.draft_vocab:
            eos = getattr(target_model.config, "eos_token_id", None)
            always = set([eos] if isinstance(eos, int) else (eos or []))
            draft_ids = build_draft_vocab(data.token_counts(vocab), cfg.draft_vocab, always)
        heads.init_lm_heads(lm_cpu, draft_ids)
    n_data = data.n_tokens
    meta = {"target": fp, "training": {"data_tokens": n_data, "data_sequences": len(data), "steps": total,
                                       "config": asdict(cfg) | {"stop_after": 0, "ship_to": ""}}}
    if cfg.joint:
        return train_joint(cfg, target_model, heads, data, total, resume, meta, acc, progress)
    if resume is not None:
        heads.load_state_dict(resume["model"])
    heads.to(dev)
    target_lm = lm_cpu.to(dev)
    params = list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
    start = resume["step"] if resume else 0
    objective = acc.prepare(MedusaObjective(heads, target_lm, cfg.weights))
    state = {"config": asdict(cfg), "shards": data.names, "head_meta": meta}

    def step_fn(step, mine, ids, feats, mask):
        counts = torch.stack([mask[:, k + 2:].sum() for k in range(cfg.num_heads)])
        # DDP averages gradients over processes: scale so the sum matches each head's global row mean
        return objective(ids, feats, mask, global_sum(acc, counts).clamp(min=1.0) / world)

    def record(s):
        rec = heads_record(cfg.weights, s)
        return rec, {"loss": f"{rec['loss']:.3f}", "acc": "/".join(f"{a:.2f}" for a in rec["top1_acc_by_head"])}

    step, history, seconds = run_steps(
        acc, cfg, data, objective, opt, sched, params, total, start, state, step_fn, record, (cfg.num_heads, 3),
        lambda h, d: save_medusa(h, d / "heads", extra=meta), f"train {cfg.kind}", progress,
        (resume or {}).get("seconds", 0.0))
    final = acc.unwrap_model(objective).head
    if step == total and acc.is_main_process:
        final.eval()
        accs, rows = head_accuracies(final, data, held_in(len(data), cfg.seed), target_lm)
        meta["training"]["seconds"] = round((resume or {}).get("seconds", 0.0) + seconds, 3)
        final.meta = meta | {"accuracies": accs, "accuracy_rows": rows}
        save_medusa(final, Path(cfg.out) / "heads")
        if cfg.ship_to:
            save_medusa(final, cfg.ship_to, dtype=torch.float16)
    acc.wait_for_everyone()
    return {"steps": step, "total_steps": total, "history": history, "heads": final, "seconds": seconds,
            "data_tokens": n_data, "accuracies": final.meta.get("accuracies")}


# ---- CLI (a subcommand of `specdec train`, see train.py) ----

def add_parser(kinds) -> None:
    p = one_line_errors(kinds.add_parser(
        "medusa", help="Medusa heads: K heads on the target's last feature; Medusa-1 (the target frozen), or "
        "Medusa-2 with --joint (the backbone trained too, saved as a new target); resumes from --out if it "
        "holds checkpoints"))
    p.add_argument("--model", default=None, metavar="PATH", help="the target, the one the data was made with: "
                   "HF dir, .gguf, or smollm2 (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", required=True, metavar="DIR[,DIR...]", help="datagen dir(s), comma-separated")
    p.add_argument("--out", required=True, metavar="DIR", help="run dir: checkpoints/, log.jsonl, heads/ (the "
                   "result; with --joint also target/, the new target the heads are for)")
    add_config_flags(p, MedusaTrainConfig, RULES, {"schedule": SCHEDULES, "lm_head": LM_HEADS})
    add_flags(p, Runtime, only=("threads",))
    p.set_defaults(func=cmd_train_medusa)


def cmd_train_medusa(args) -> int:
    Runtime.parse(flag_values(args, Runtime)).apply()
    cfg = MedusaTrainConfig.from_dict(vars(args))
    cfg.check()
    out, name = Path(cfg.out), "train medusa" + (" --joint" if cfg.joint else "")
    target = f"; the new target is in {out / 'target'}" if cfg.joint else ""
    done = finished_heads(cfg)
    if done is not None:  # before the target loads: nothing else happens
        print(f"{name}: {cfg.out} is already finished (step {done[1]}/{done[1]}); the heads are in {done[0]}{target}")
        return 0
    r = train_medusa(cfg, load_target(materialize(args.model), args.model))
    steps = f"step {r['steps']}/{r['total_steps']}"
    if r["steps"] < r["total_steps"]:
        print(f"{name}: stopped at {steps}; re-run the same command to resume")
        return 0
    last = r["history"][-1] if r["history"] else None
    loss = f"; loss {last['loss']:.4f}" if last else ""
    top1 = "/".join(f"{row[0]:.3f}" for row in r["accuracies"] or [])
    drift = r.get("drift")
    drift = (f"; drift from the original: greedy agreement {drift['greedy_agreement']:.3f}, "
             f"KL {drift['kl_per_token']:.4f} nats/token" if drift else "")
    print(f"{name}: {steps} in {r['seconds']:.0f} s{loss}; held-in top-1 accuracy by head {top1}{drift}; "
          f"heads: {out / 'heads'}{target}")
    return 0
