"""Train Medusa heads (Medusa-1: the target frozen) on datagen shards: `specdec train medusa`.

Head k (0-based) on row t reads the stored feature f_t and learns the target's own distribution for the
token at offset k + 2: p = softmax(LM(f_{t+k+1})) over the draft vocabulary (self-distillation with soft
labels, computed on the fly from the stored features with the frozen target LM head):
    loss = Σ_k λ_k · CE(p, p̂_k),  λ_k = decay^(k+1)  (Medusa's 0.8^k, k counted from 1),
each head's CE averaged over the rows whose label x_{t+k+2} lies in the sequence and is an answer token.
Nothing but the heads has gradients.

At the end, each head's top-i accuracy on held-in data (a fixed, seeded slice of the training sequences):
acc[k][i] = the share of answer rows where head k's rank-i token is the target's argmax token there (over
the full vocabulary: a token outside the draft vocabulary matches no rank). It goes into the heads'
config.json (specdec.accuracies), from which the `medusa` method builds Medusa's sparse tree.

The step loop, checkpoints, exact resume and multi-process runs are train.py's (loop.py). Medusa-2 (joint
training with the backbone) would be another objective with the same forward signature: it gets the token
ids too, to run the backbone itself instead of reading the stored features.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specdec.errors import SpecdecError
from specdec.heads.medusa import LM_HEADS, MedusaHeads
from specdec.heads.medusa_io import load_medusa, save_medusa
from specdec.heads.shipped import target_fingerprint
from specdec.options import add_flags, arg_type, flag_values
from specdec.target.loading import Runtime, materialize
from specdec.training.datagen import checked, one_line_errors
from specdec.training.loop import (
    SCHEDULES,
    add_config_flags,
    finished_run,
    global_sum,
    load_data,
    load_resume,
    load_target,
    lr_lambda,
    run_steps,
)
from specdec.training.shards import ShardData, build_draft_vocab

__all__ = ["MedusaTrainConfig", "train_medusa", "head_accuracies", "held_in", "MedusaObjective"]

RANKS = 10  # top-i accuracies measured per head (the drafter's MAX_RANK)
HELD_IN = 64  # sequences the accuracies are measured on
# one head's logits above this many elements are recomputed in the backward pass instead of kept
# (K heads x batch x length x vocabulary would not fit otherwise; the result is the same)
RECOMPUTE_ABOVE = 1 << 26


@dataclass
class MedusaTrainConfig:
    data: str
    out: str
    steps: int = 0  # 0: derived from epochs
    epochs: float = 1.0
    batch_size: int = 16  # sequences per optimizer step, over all processes
    max_len: int = 1024
    lr: float = 1e-3
    warmup: int = 100
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    clip: float = 1.0
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    lm_head: str = "target"  # target (shared, frozen) | own (one per head, from the target's rows, trained)
    draft_vocab: int = 0  # 0 = the full target vocabulary
    decay: float = 0.8  # head k's loss weight: decay^(k+1)
    save_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    stop_after: int = 0  # testing aid: stop (as if killed) after this many steps of this invocation
    ship_to: str = ""  # also write an fp16 copy here

    @classmethod
    def from_dict(cls, d: dict) -> MedusaTrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def check(self) -> None:
        """The CLI's rules for API callers too: a SpecdecError naming the flag, before any work."""
        for name, rule in RULES.items():
            checked(name, getattr(self, name), rule)
        if self.schedule not in SCHEDULES:
            raise SpecdecError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.lm_head not in LM_HEADS:
            raise SpecdecError(f"--lm-head must be one of {', '.join(LM_HEADS)}, got {self.lm_head!r}")

    @property
    def kind(self) -> str:
        return "medusa"

    @property
    def weights(self) -> list[float]:
        return [self.decay ** (k + 1) for k in range(self.num_heads)]


RULES = {
    "steps": arg_type(int, ge=0), "epochs": arg_type(float, gt=0), "batch_size": arg_type(int, ge=1),
    "max_len": arg_type(int, ge=3), "lr": arg_type(float, ge=0), "warmup": arg_type(int, ge=0),
    "min_lr_ratio": arg_type(float, ge=0, le=1), "weight_decay": arg_type(float, ge=0),
    "clip": arg_type(float, ge=0), "num_heads": arg_type(int, ge=1, le=16), "num_layers": arg_type(int, ge=1),
    "draft_vocab": arg_type(int, ge=0), "decay": arg_type(float, gt=0, le=1), "save_every": arg_type(int, ge=1),
    "keep_checkpoints": arg_type(int, ge=1), "log_every": arg_type(int, ge=1), "seed": arg_type(int, ge=0),
    "stop_after": arg_type(int, ge=0),
}
# what a resumed (or re-run) run must share with the one in --out
RESUME_KEYS = ("data", "steps", "epochs", "batch_size", "max_len", "lr", "warmup", "schedule", "min_lr_ratio",
               "weight_decay", "clip", "num_heads", "num_layers", "lm_head", "draft_vocab", "decay", "seed")


# ---- the objective ----

def lm_rows(heads: MedusaHeads, target_lm: torch.Tensor, k: int) -> torch.Tensor:
    """Head k's LM head weight over the draft vocabulary."""
    if heads.lm_heads is not None:
        return heads.lm_heads[k].weight
    return target_lm if heads.d2t is None else target_lm[heads.d2t]


def _head_ce(h, lm, p, top, w):
    """(Σ w · CE(p, softmax(h lm^T)), Σ w · [argmax == top]) over the rows."""
    logp = torch.log_softmax(F.linear(h, lm), dim=-1)
    ce = (-(p * logp).sum(-1) * w).sum()
    hits = ((logp.detach().argmax(-1) == top).float() * w).sum()
    return ce, hits


class MedusaObjective(nn.Module):
    """Medusa-1's loss: everything with gradients runs inside forward, so DDP sees every use of the
    parameters. `head` is the trained module (what a checkpoint holds)."""

    def __init__(self, heads: MedusaHeads, target_lm: torch.Tensor, weights: list[float]) -> None:
        super().__init__()
        self.head = heads
        self.target_lm = target_lm  # frozen: a plain attribute, not a parameter or a buffer DDP would broadcast
        self.weights = weights

    def forward(self, ids, feats, mask, n_global: torch.Tensor):
        """feats [B, T, H], mask [B, T]; n_global [K]: each head's label rows over all processes, divided by
        the process count. Returns the loss and stats [K, 3] (Σ CE, Σ top-1 agreement, rows)."""
        heads, t = self.head, feats.shape[1]
        lm_t = self.target_lm if heads.d2t is None else self.target_lm[heads.d2t]
        # only label rows cost LM-head work (prompts are often half the tokens): row j of the [B, T-2]
        # grid is f_{j+1}, the target's distribution for x_{j+2}, a label iff x_{j+2} is an answer token
        lab = mask[:, 2:].bool()
        where = torch.full(lab.shape, -1, dtype=torch.long, device=feats.device)
        where[lab] = torch.arange(int(lab.sum()), device=feats.device)
        with torch.no_grad():
            p_t = torch.softmax(F.linear(feats[:, 1:t - 1][lab], lm_t), dim=-1)
            top_t = p_t.argmax(-1)
        hid = heads.hidden(feats[:, :max(t - 2, 0)])
        loss, stats = 0.0, []
        for k in range(heads.num_heads):
            n = max(t - 2 - k, 0)  # rows t' whose label x_{t'+k+2} is inside the batch
            sel = lab[:, k:k + n]
            rows = where[:, k:k + n][sel]
            ones = torch.ones(rows.shape[0], device=feats.device)
            args = (hid[k][:, :n][sel], lm_rows(heads, self.target_lm, k), p_t[rows], top_t[rows], ones)
            if args[0].shape[0] * args[1].shape[0] > RECOMPUTE_ABOVE:
                ce, hits = checkpoint(_head_ce, *args, use_reentrant=False)
            else:
                ce, hits = _head_ce(*args)
            loss = loss + self.weights[k] * ce / n_global[k]
            stats.append(torch.stack([ce.detach(), hits, ones.sum()]))
        return loss, torch.stack(stats)


# ---- accuracies ----

def held_in(n: int, seed: int, size: int = HELD_IN) -> list[int]:
    """The training sequences the accuracies are measured on: `size` of them, chosen by the seed."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 12345)
    return sorted(torch.randperm(n, generator=g)[:size].tolist())


@torch.no_grad()
def head_accuracies(heads: MedusaHeads, data: ShardData, seqs: list[int], target_lm: torch.Tensor,
                    ranks: int = RANKS, batch: int = 4) -> tuple[list[list[float]], list[int]]:
    """(acc [K][ranks], answer rows per head): acc[k][i] = the share of rows where head k's rank-i token
    is the argmax of the target's full-vocabulary distribution for the same position."""
    k_heads, dev = heads.num_heads, target_lm.device
    hits = torch.zeros(k_heads, ranks, dtype=torch.float64)
    rows = torch.zeros(k_heads, dtype=torch.float64)
    for a in range(0, len(seqs), batch):
        _, feats, mask = (x.to(dev) for x in data.batch(seqs[a:a + batch]))
        t = feats.shape[1]
        if t < 3:
            continue
        top_t = F.linear(feats[:, 1:t - 1], target_lm).argmax(-1)  # [B, T-2]: x_{s+1} from f_s
        hid = heads.hidden(feats[:, :t - 2])
        for k in range(min(k_heads, t - 2)):
            n = t - 2 - k
            logits = F.linear(hid[k][:, :n], lm_rows(heads, target_lm, k))
            r = min(ranks, logits.shape[-1])
            top = logits.topk(r, dim=-1).indices
            if heads.d2t is not None:
                top = heads.d2t[top]
            w = mask[:, k + 2:].double()
            hits[k, :r] += ((top == top_t[:, k:k + n, None]).double() * w[..., None]).sum((0, 1)).cpu()
            rows[k] += w.sum().cpu()
    acc = hits / rows.clamp(min=1)[:, None]
    return [[round(float(x), 6) for x in row] for row in acc], [int(x) for x in rows]


# ---- the trainer ----

def finished_heads(cfg: MedusaTrainConfig) -> tuple[Path, int] | None:
    """(cfg.out/heads, its step count) when this run is complete; else None (see loop.finished_run)."""
    return finished_run(cfg, MedusaTrainConfig, RESUME_KEYS, "heads")


def train_medusa(cfg: MedusaTrainConfig, target_model, accelerator=None, progress: bool = True) -> dict:
    """Train (or resume) Medusa heads for `target_model`. Returns a summary; the heads end up in
    cfg.out/heads (usable with `medusa:heads=<dir>`)."""
    from accelerate import Accelerator

    cfg.check()
    done = finished_heads(cfg)
    lm_cpu = target_model.get_output_embeddings().weight.detach().float()
    vocab, hidden = lm_cpu.shape
    if done is not None:  # nothing to do: a re-run of a finished run only reports it
        heads = load_medusa(done[0], hidden, vocab, target_lm_head=lm_cpu)
        return {"steps": done[1], "total_steps": done[1], "history": [], "heads": heads, "finished": True,
                "seconds": 0.0, "data_tokens": heads.meta.get("training", {}).get("data_tokens", 0),
                "accuracies": heads.meta.get("accuracies")}
    acc = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    world, dev = acc.num_processes, acc.device
    target_lm = lm_cpu.to(dev)
    fp = target_fingerprint(target_model)
    resume = load_resume(cfg, MedusaTrainConfig, RESUME_KEYS)
    data, total = load_data(cfg, resume, fp, hidden, world, acc.is_main_process)

    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(hidden, vocab, cfg.num_heads, cfg.num_layers, cfg.lm_head)
    draft_ids = None
    if cfg.draft_vocab:
        eos = getattr(target_model.config, "eos_token_id", None)
        always = set([eos] if isinstance(eos, int) else (eos or []))
        draft_ids = build_draft_vocab(data.token_counts(vocab), cfg.draft_vocab, always)
    heads.init_lm_heads(lm_cpu, draft_ids)
    if resume is not None:
        heads.load_state_dict(resume["model"])
    heads.to(dev)
    params = list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
    start = resume["step"] if resume else 0
    objective = acc.prepare(MedusaObjective(heads, target_lm, cfg.weights))

    n_data = data.n_tokens
    meta = {"target": fp, "training": {"data_tokens": n_data, "data_sequences": len(data), "steps": total,
                                       "config": asdict(cfg) | {"stop_after": 0, "ship_to": ""}}}
    state = {"config": asdict(cfg), "shards": data.names, "head_meta": meta}

    def step_fn(step, mine, ids, feats, mask):
        counts = torch.stack([mask[:, k + 2:].sum() for k in range(cfg.num_heads)])
        # DDP averages gradients over processes: scale so the sum matches each head's global row mean
        return objective(ids, feats, mask, global_sum(acc, counts).clamp(min=1.0) / world)

    def record(s):
        n = s[:, 2].clamp(min=1.0)
        ce, top1 = (s[:, 0] / n).tolist(), (s[:, 1] / n).tolist()
        rec = {"loss": sum(w * c for w, c in zip(cfg.weights, ce)), "ce_by_head": ce, "top1_acc_by_head": top1}
        return rec, {"loss": f"{rec['loss']:.3f}", "acc": "/".join(f"{a:.2f}" for a in top1)}

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
        "medusa", help="Medusa-1 heads: K heads on the frozen target's last feature (resumes from --out if it "
        "holds checkpoints)"))
    p.add_argument("--model", default=None, help="the target (must be the one the data was made with)")
    p.add_argument("--data", required=True, help="datagen dir(s), comma-separated")
    p.add_argument("--out", required=True, help="run dir: checkpoints/, log.jsonl, heads/ (the result)")
    add_config_flags(p, MedusaTrainConfig, RULES, {"schedule": SCHEDULES, "lm_head": LM_HEADS})
    add_flags(p, Runtime, only=("threads",))
    p.set_defaults(func=cmd_train_medusa)


def cmd_train_medusa(args) -> int:
    Runtime.parse(flag_values(args, Runtime)).apply()
    cfg = MedusaTrainConfig.from_dict(vars(args))
    cfg.check()
    done = finished_heads(cfg)
    if done is not None:  # before the target loads: nothing else happens
        print(f"train medusa: {cfg.out} is already finished (step {done[1]}/{done[1]}); the heads are in {done[0]}")
        return 0
    r = train_medusa(cfg, load_target(materialize(args.model), args.model))
    heads, steps = Path(cfg.out) / "heads", f"step {r['steps']}/{r['total_steps']}"
    if r["steps"] < r["total_steps"]:
        print(f"train medusa: stopped at {steps}; re-run the same command to resume")
        return 0
    last = r["history"][-1] if r["history"] else None
    loss = f"; loss {last['loss']:.4f}" if last else ""
    top1 = "/".join(f"{row[0]:.3f}" for row in r["accuracies"] or [])
    print(f"train medusa: {steps} in {r['seconds']:.0f} s{loss}; held-in top-1 accuracy by head {top1}; "
          f"heads: {heads}")
    return 0
