"""Train Medusa heads on datagen shards: `specdec train medusa` (Medusa-1: the target frozen, the heads
read the stored features), `specdec train medusa --joint` (Medusa-2, medusa_joint.py: the backbone is
trained with the heads and saved as a new target) and `specdec train medusa --arch hydra` (Hydra's heads,
heads/hydra.py: as Medusa-1, each head also reading the data's tokens along its path).

The loss and the accuracies are medusa_objective.py's. Medusa-1: nothing but the heads has gradients; at
the end, each head's top-i accuracy on held-in data goes into the heads' config.json (specdec.accuracies),
from which the `medusa` method builds Medusa's sparse tree.

The skeleton, the step loop, checkpoints, exact resume and multi-process runs are trainer.py's and loop.py's,
as for train.py's heads; both kinds share this config, its flags and the checks before training (data,
draft vocabulary, resume settings).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from specdec.errors import SpecdecError
from specdec.heads.hydra import HydraHeads
from specdec.heads.medusa import LM_HEADS, MedusaHeads
from specdec.heads.medusa_io import load_medusa, save_medusa
from specdec.training.config import LoopConfig, knob, recipe
from specdec.training.loop import finished_run, global_sum, lr_lambda
from specdec.training.medusa_joint import JointTraining
from specdec.training.medusa_objective import MedusaObjective, head_accuracies, heads_record, held_in
from specdec.training.trainer import Trainer
from specdec.vocab import frequent_ids

__all__ = ["MedusaTrainConfig", "train_medusa", "head_accuracies", "held_in", "MedusaObjective"]


class MedusaTrainConfig(LoopConfig):
    # Medusa's own settings and docs/training.md section 5's recipe
    out: str = recipe(LoopConfig, "out", description="run dir: checkpoints/, log.jsonl, heads/ (the result; with "
                      "--joint also target/, the new target the heads are for)")
    max_len: int = recipe(LoopConfig, "max_len", ge=3)
    lr: float = recipe(LoopConfig, "lr", default=1e-3, description="peak learning rate (AdamW; Medusa's)")
    warmup: int = recipe(LoopConfig, "warmup", default=20)
    clip: float = recipe(LoopConfig, "clip", default=1.0)
    arch: Literal["medusa", "hydra"] = knob(
        "medusa", "medusa: parallel heads on the last feature; hydra: Hydra's sequentially-dependent heads (each "
        "also reads the embeddings of the tokens before it on its path; for the `hydra` method)", resume=True)
    prefix_attention: bool = knob(False, "--arch hydra: Hydra++'s prefix attention, one decoder layer of the "
                                  "target's shape over the context's features, read by the heads", resume=True)
    num_heads: int = knob(4, "heads; head k predicts the token k + 2 positions ahead", ge=1, le=16, resume=True)
    num_layers: int = knob(1, "residual blocks per head", ge=1, resume=True)
    lm_head: Literal[LM_HEADS] = knob("target", "target (the target's, shared and frozen) or own (one per head, "
                                      "from the target's rows, trained)", resume=True)
    draft_vocab: int = knob(0, "LM heads over the N most frequent answer tokens (the shipped SmolLM2 heads: "
                            "8192); 0: the full target vocabulary", ge=0, resume=True)
    decay: float = knob(0.8, "head k's loss weight is decay^(k+1)", gt=0, le=1, resume=True)
    # Medusa-2 (--joint): L = KL(p_original || p_new) + lambda0 * the heads' loss, the backbone trained too
    joint: bool = knob(False, "Medusa-2: train the backbone too; the result is a new target in <out>/target",
                       resume=True)
    lambda0: float = knob(0.2, "--joint: the heads' loss weight (Medusa's medusa_heads_coefficient)", ge=0,
                          resume=True)
    backbone_lr: float = knob(0.0, "--joint: the backbone's lr; 0: --lr / 4 (Medusa's ratio)", ge=0, resume=True)
    heads_warmup: int = knob(-1, "--joint: first steps that train only the heads; -1: a quarter of the run", ge=-1,
                             resume=True)
    full_finetune: bool = knob(False, "--joint: train every backbone weight instead of LoRA adapters", resume=True)
    lora_rank: int = knob(16, "--joint: LoRA rank", ge=1, resume=True)
    lora_alpha: float = knob(32.0, "--joint: LoRA alpha", gt=0, resume=True)
    # the layers below the adapters run without a graph, so a step's backward covers N layers
    lora_layers: int = knob(0, "--joint: adapters on the last N decoder layers only; 0: all", ge=0, resume=True)
    # recomputing costs ~10%; SmolLM2-135M, batch 4 (~1,350 tokens): peak RSS 9.8 GB instead of 6.9
    keep_activations: bool = knob(False, "--joint: keep the backbone's activations for the backward pass "
                                  "instead of recomputing them (faster, far more memory)")

    def check(self) -> None:
        if self.prefix_attention and self.arch != "hydra":
            raise SpecdecError("--prefix-attention is Hydra++'s layer under Hydra's heads: it needs --arch hydra")
        if self.arch == "hydra" and self.joint:
            raise SpecdecError("--joint trains Medusa-2 heads with the backbone: it does not apply to --arch hydra")
        if self.full_finetune and not self.joint:
            raise SpecdecError("--full-finetune trains the backbone: it needs --joint")
        if self.lora_layers and self.full_finetune:
            raise SpecdecError("--lora-layers limits LoRA's adapters: it does not apply to --full-finetune")

    @property
    def kind(self) -> str:
        return "hydra" if self.arch == "hydra" else "medusa-2" if self.joint else "medusa"

    @property
    def heads_class(self) -> type[MedusaHeads]:
        return HydraHeads if self.arch == "hydra" else MedusaHeads

    @property
    def weights(self) -> list[float]:
        return [self.decay ** (k + 1) for k in range(self.num_heads)]


# ---- the trainer ----

def finished_heads(cfg: MedusaTrainConfig) -> tuple[Path, int] | None:
    """(cfg.out/heads, its step count) when this run is complete; else None (see loop.finished_run)."""
    return finished_run(cfg, "heads")


def warm_start(cfg: MedusaTrainConfig, hidden: int, vocab: int, lm_cpu: torch.Tensor) -> MedusaHeads:
    """The --init-from heads, checked against the run's flags (shape, LM head kind, draft vocabulary)."""
    heads = load_medusa(cfg.init_from, hidden, vocab, target_lm_head=lm_cpu, cls=cfg.heads_class).train()
    have = {"num_heads": heads.num_heads, "num_layers": heads.num_layers, "lm_head": heads.lm_head_kind,
            "draft_vocab": 0 if heads.d2t is None else heads.draft_vocab_size,
            "prefix_attention": getattr(heads, "prefix", None) is not None}
    for k, v in have.items():
        if getattr(cfg, k) != v:
            flag = "--" + k.replace("_", "-")
            fix = (f"pass {flag}" if v else f"drop {flag}") if isinstance(v, bool) else \
                f"pass {flag} {v}, not {getattr(cfg, k)}"
            raise SpecdecError(f"--init-from {cfg.init_from} has {k}={v}: {fix}")
    heads.meta = {}
    return heads


class MedusaTrainer(Trainer):
    """Medusa-1 heads: the target frozen, the heads read the stored features (module doc)."""

    result = "heads"

    def __init__(self, cfg: MedusaTrainConfig, target, accelerator=None, progress: bool = True) -> None:
        super().__init__(cfg, target, accelerator, progress)
        self.stats_shape = (cfg.num_heads, 3)

    def finished(self, path: Path, steps: int) -> dict:
        vocab, hidden = self.target_lm.shape
        heads = load_medusa(path, hidden, vocab, target_lm_head=self.target_lm, cls=self.cfg.heads_class)
        return {"steps": steps, "total_steps": steps, "history": [], "heads": heads, "finished": True,
                "seconds": 0.0, "data_tokens": heads.meta.get("training", {}).get("data_tokens", 0),
                "accuracies": heads.meta.get("accuracies"), "drift": heads.meta.get("drift"),
                "target": str(Path(self.cfg.out) / "target") if self.cfg.joint else None}

    def model(self) -> MedusaHeads:
        cfg, lm_cpu = self.cfg, self.target_lm
        vocab, hidden = lm_cpu.shape
        if cfg.init_from:
            return warm_start(cfg, hidden, vocab, lm_cpu)
        prefix = {"prefix": HydraHeads.prefix_sizes(self.target.config)} if cfg.prefix_attention else {}
        heads = cfg.heads_class(hidden, vocab, cfg.num_heads, cfg.num_layers, cfg.lm_head, **prefix)
        draft_ids = None
        if cfg.draft_vocab:
            eos = getattr(self.target.config, "eos_token_id", None)
            always = set([eos] if isinstance(eos, int) else (eos or []))
            draft_ids = frequent_ids(self.data.token_counts(vocab), cfg.draft_vocab, always)
        heads.init_lm_heads(lm_cpu, draft_ids)
        return heads

    def optimizer(self, heads):
        params = list(heads.parameters())
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        return params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(self.cfg, self.total))

    def objective(self, heads):
        self.lm_dev = self.target_lm.to(self.acc.device)
        # Hydra's heads read the path's token embeddings (a frozen copy of the target's input table)
        self.embed = (self.target.get_input_embeddings().weight.detach().float().to(self.acc.device)
                      if self.cfg.arch == "hydra" else None)
        return MedusaObjective(heads, self.lm_dev, self.cfg.weights, self.embed)

    def loss(self, step, mine, ids, feats, mask):
        counts = torch.stack([mask[:, k + 2:].sum() for k in range(self.cfg.num_heads)])
        # DDP averages gradients over processes: scale so the sum matches each head's global row mean
        world = self.acc.num_processes
        return self.module(ids, feats, mask, global_sum(self.acc, counts).clamp(min=1.0) / world)

    def record(self, s):
        rec = heads_record(self.cfg.weights, s)
        return rec, {"loss": f"{rec['loss']:.3f}", "acc": "/".join(f"{a:.2f}" for a in rec["top1_acc_by_head"])}

    def write(self, heads, ckpt: Path) -> None:
        save_medusa(heads, ckpt / "heads", extra=self.meta)

    def finish(self, final, step: int, seconds: float) -> dict:
        cfg = self.cfg
        if step == self.total and self.acc.is_main_process:
            final.eval()
            accs, rows = head_accuracies(final, self.data, held_in(len(self.data), cfg.seed), self.lm_dev,
                                         embed=self.embed)
            self.meta["training"]["seconds"] = round(self.earlier + seconds, 3)
            final.meta = self.meta | {"accuracies": accs, "accuracy_rows": rows}
            save_medusa(final, Path(cfg.out) / "heads")
            if cfg.ship_to:
                save_medusa(final, cfg.ship_to, dtype=torch.float16)
        return {"heads": final, "accuracies": final.meta.get("accuracies")}


class JointTrainer(JointTraining, MedusaTrainer):
    """Medusa-2: the heads with the backbone (medusa_joint.py's hooks on Medusa-1's heads)."""


def train_medusa(cfg: MedusaTrainConfig, target_model, accelerator=None, progress: bool = True) -> dict:
    """Train (or resume) Medusa heads for `target_model`. Returns a summary; the heads end up in
    cfg.out/heads (usable with `medusa:heads=<dir>`), with --joint next to a new target in cfg.out/target
    (the heads are for that target; `target_model` itself is left as it was)."""
    kind = JointTrainer if cfg.joint else MedusaTrainer
    return kind(cfg, target_model, accelerator, progress).train()
