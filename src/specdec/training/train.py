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
count, so N processes follow the 1-process run. The skeleton (trainer.py), checkpoints, the resume check and the
data checks (loop.py) are shared with `train medusa` (medusa.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from specdec.errors import SpecdecError
from specdec.heads.fspad import CONNECTORS
from specdec.runtime.gguf import float_weight
from specdec.training.config import LoopConfig, knob, recipe
from specdec.training.loop import finished_run, global_sum, lr_lambda
from specdec.training.objective import Objective, unrolled, unrolled_mask
from specdec.training.trainer import Trainer
from specdec.vocab import frequent_ids

# the heads (and with them transformers) are imported inside functions: the CLI parser imports this module
__all__ = ["TrainConfig", "train_eagle", "finished_head", "lr_lambda", "unrolled", "unrolled_mask"]

ARCHS = ("eagle", "eagle3")


class TrainConfig(LoopConfig):
    # the shipped head's recipe (docs/training.md section 3; lr 1e-3 beat 3e-4 in a probe)
    out: str = recipe(LoopConfig, "out", description="run dir: checkpoints/, log.jsonl, head/ (the result); re-run "
                      "the same command to resume")
    epochs: float = recipe(LoopConfig, "epochs", default=3.0)
    lr: float = recipe(LoopConfig, "lr", default=1e-3)
    log_every: int = recipe(LoopConfig, "log_every", default=20)
    ce_weight: float = knob(0.1, "weight of the cross-entropy to the target's next-token distribution, beside "
                            "the feature loss", ge=0, resume=True)
    tv_weight: float = knob(0.0, "> 0: also minimise TV(p, q), what a sampled draft token loses at T = 1", ge=0,
                            resume=True)
    noise: float = knob(0.1, "input features get U(-noise, noise)", ge=0, resume=True)
    draft_vocab: int = knob(0, "the head's own LM head over the N most frequent answer tokens (the shipped "
                            "SmolLM2 head: 8192); 0: the target's full, frozen LM head", ge=0, resume=True)
    freeze_lm_head: bool = knob(False, "with --draft-vocab: keep the LM-head rows copied from the target (the "
                                "shipped recipe; --ship-to then stores none of them)", resume=True)
    unroll: int = knob(1, "draft steps trained per row: > 1 also trains on the head's own predictions", ge=1,
                       resume=True)
    layers: int = knob(0, "decoder layers: 0 = 1 (EAGLE), or as many as --init-from has; more grows that "
                       "head", ge=0, resume=True)
    connector: Literal[CONNECTORS] = knob("fc", "fc (EAGLE) or sampler (FSPAD's Feature Sampler)", resume=True)
    pad: bool = knob(False, "FSPAD's Partial Alignment Distillation", resume=True)
    sampler_size: int = knob(0, "the Feature Sampler's intermediate size; 0: the target's intermediate_size",
                             ge=0, resume=True)
    intermediate_size: int = knob(0, "the decoder layer's MLP width; 0: the target's intermediate_size (narrower: a "
                                  "smaller head and a cheaper draft step)", ge=0, resume=True)
    init_layer: Literal["random", "target"] = knob("random", "EAGLE-3: the draft layer starts random, or as the "
                                                    "target's last decoder layer (Eagle3Head.start_as)",
                                                    resume=True)
    feature_cache: str = knob("", "data of token ids alone: keep each sequence's target features here and read "
                              "them back in later epochs and runs instead of running the target again (fp32: "
                              "~25 KB a token for Qwen2.5-1.5B with EAGLE-3's aux layers)", metavar="DIR",
                              shown="none")
    arch: Literal[ARCHS] = knob("eagle", "eagle (EAGLE-1/2, FSPAD) or eagle3 (fused low/middle/high target "
                                "features; data: datagen --aux-layers eagle3)", resume=True)

    def check(self) -> None:
        if self.init_layer == "target" and (self.arch != "eagle3" or self.init_from):
            raise SpecdecError("--init-layer target starts a new EAGLE-3 head (--arch eagle3, no --init-from)")
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


# ---- the trainer ----

def finished_head(cfg: TrainConfig) -> tuple[Path, int] | None:
    """(cfg.out/head, its step count) when this run is complete: the head is written, the last checkpoint
    is its final step, the settings are the same (and a --ship-to copy exists); else None."""
    return finished_run(cfg, "head")


class EagleTrainer(Trainer):
    """An EAGLE-1/2, FSPAD or EAGLE-3 head (module doc)."""

    def __init__(self, cfg: TrainConfig, target, accelerator=None, progress: bool = True, features=None) -> None:
        super().__init__(cfg, target, accelerator, progress, features)
        self.aux = cfg.arch == "eagle3"
        self.stats_shape = (cfg.unroll, 5)

    def finished(self, path: Path, steps: int) -> dict:
        from specdec.heads.io import load_head

        lm = self.target_lm
        head = load_head(path, lm.shape[1], lm.shape[0], target_lm_head=lm)
        return {"steps": steps, "total_steps": steps, "history": [], "head": head, "finished": True,
                "seconds": 0.0, "data_tokens": head.meta.get("training", {}).get("data_tokens", 0)}

    def setup(self) -> None:
        dev = self.acc.device
        self.emb = self.target.get_input_embeddings().weight.detach().to(dev, torch.float32)
        self.lm_dev = self.target_lm.to(dev)

    def model(self) -> torch.nn.Module:
        from specdec.heads.io import load_head
        from specdec.heads.model import Eagle3Head, EagleHead, head_config

        cfg, data, target = self.cfg, self.data, self.target
        vocab, hidden = self.target_lm.shape
        mlp = {"intermediate_size": cfg.intermediate_size} if cfg.intermediate_size else {}
        if not cfg.init_from:
            if self.aux:
                head = Eagle3Head(head_config(target.config, **mlp), data.aux_layers)
                if cfg.init_layer == "target":
                    decoder = target.get_decoder()
                    last = decoder.layers[-1]
                    names = [f"self_attn.{n}_proj" for n in "qkvo"] + [f"mlp.{n}_proj" for n in ("gate", "up", "down")]
                    weights = {f"{n}.weight": float_weight(_get(last, n).weight) for n in names}
                    for n in ("input_layernorm", "post_attention_layernorm"):
                        weights[f"{n}.weight"] = float_weight(_get(last, n).weight)
                    head.start_as(weights, float_weight(decoder.norm.weight))
            else:
                head = EagleHead(head_config(target.config, num_hidden_layers=cfg.layers or 1, **mlp),
                                 connector=cfg.connector, pad=cfg.pad, sampler_size=cfg.sampler_size or None)
            if cfg.draft_vocab:
                eos = getattr(target.config, "eos_token_id", None)
                always = set([eos] if isinstance(eos, int) else (eos or []))
                head.set_draft_vocab(frequent_ids(data.token_counts(vocab), cfg.draft_vocab, always),
                                     self.target_lm)
            return head
        # the warm start fixes the draft vocabulary too (its rows may come from the target)
        head = load_head(cfg.init_from, hidden_size=hidden, vocab_size=vocab, target_lm_head=self.target_lm).train()
        vd = head.draft_vocab_size or head.vocab_size
        if head.kind != cfg.kind and (self.aux or head.kind == "eagle3"):
            raise SpecdecError(f"--init-from {cfg.init_from} is an {head.kind} head, not --arch {cfg.arch}")
        if head.aux_layers != data.aux_layers:
            raise SpecdecError(f"--init-from {cfg.init_from} reads target layers {list(head.aux_layers)}, the data "
                               f"holds {list(data.aux_layers)}")
        if cfg.intermediate_size not in (0, head.config.intermediate_size):
            raise SpecdecError(f"--init-from {cfg.init_from} has an MLP width of {head.config.intermediate_size}: "
                               "pass the same --intermediate-size, or none")
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
        return head

    def optimizer(self, head):
        if head.lm_head is not None and self.cfg.freeze_lm_head:
            head.lm_head.weight.requires_grad_(False)
        params = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=self.cfg.weight_decay)
        return params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(self.cfg, self.total))

    def objective(self, head):
        return Objective(head, self.emb, self.lm_dev, self.cfg.unroll)

    def loss(self, step, mine, ids, feats, mask):
        cfg, acc, h = self.cfg, self.acc, self.target_lm.shape[1]
        world, objective = acc.num_processes, self.module
        n_global = float(global_sum(acc, mask[:, 1:].sum()))
        feats, aux = (feats[..., :h], feats[..., h:]) if self.aux else (feats, None)
        noise = None
        if cfg.noise > 0:  # per sequence and step: independent of how the batch is split over processes
            noise = torch.zeros((feats if aux is None else aux)[:, :-1].shape)
            for r, i in enumerate(mine):
                g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 1_000_033 + i)
                n_i = self.data.spans[i][1] - self.data.spans[i][0] - 1
                noise[r, :n_i] = (torch.rand(n_i, noise.shape[-1], generator=g) * 2 - 1) * cfg.noise
            noise = noise.to(acc.device)
        # DDP averages gradients over processes: scale so the sum matches a global token mean
        return objective(ids, feats, mask, noise, max(n_global, 1.0) / world, cfg.ce_weight, cfg.tv_weight, aux)

    def record(self, s):
        cfg = self.cfg
        n = max(float(s[0, 3]), 1.0)  # step 0 (= plain EAGLE training) keeps the old fields
        loss = float(s[0, 0]) + cfg.ce_weight * float(s[0, 1]) + cfg.tv_weight * float(s[0, 4])
        # t1_accept = 1 - TV: a sampled draft token's acceptance at T = 1 (over the draft vocabulary)
        rec = {"loss": loss / n, "feature_loss": float(s[0, 0]) / n, "ce": float(s[0, 1]) / n,
               "top1_acc": float(s[0, 2]) / n, "t1_accept": 1 - float(s[0, 4]) / n}
        if cfg.unroll > 1:
            rec["top1_acc_by_step"] = [round(float(r[2]) / max(float(r[3]), 1.0), 4) for r in s]
        return rec, {"loss": f"{rec['loss']:.3f}", "acc": f"{rec['top1_acc']:.3f}"}

    def write(self, head, ckpt: Path) -> None:
        from specdec.heads.io import save_head

        save_head(head, ckpt / "head", extra=self.meta)

    def write_kept(self, head, dest: Path) -> None:
        """A kept checkpoint's head in the shipped form (fp16, the target's LM-head rows left out when
        frozen): `--head` and `bench` read it as it is."""
        from specdec.heads.io import save_head

        save_head(head, dest, extra=self.meta, dtype=torch.float16, lm_head=not self.cfg.freeze_lm_head)

    def read_kept(self, head, weights: Path) -> None:
        from specdec.heads.io import load_head

        vocab, hidden = self.target_lm.shape
        kept = load_head(weights, hidden_size=hidden, vocab_size=vocab, target_lm_head=self.target_lm)
        head.load_state_dict(kept.state_dict())

    def finish(self, final, step: int, seconds: float) -> dict:
        from specdec.heads.io import save_head

        cfg = self.cfg
        if step == self.total and self.acc.is_main_process:
            save_head(final, Path(cfg.out) / "head", extra=self.meta)
            if cfg.ship_to:
                save_head(final, cfg.ship_to, extra=self.meta, dtype=torch.float16, lm_head=not cfg.freeze_lm_head)
        return {"head": final}


def _get(module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def train_eagle(cfg: TrainConfig, target_model, accelerator=None, progress: bool = True, features=None) -> dict:
    """Train (or resume) an EAGLE head for `target_model`. Returns a summary; the head ends up in
    cfg.out/head (an HF-style dir usable with `--head`). features: for data of token ids alone (ShardData's)."""
    return EagleTrainer(cfg, target_model, accelerator, progress, features).train()
