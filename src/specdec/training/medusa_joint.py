"""Medusa-2 (Cai et al., 2024, §2.3.2): the heads trained jointly with the backbone, `specdec train medusa
--joint`. The result is a NEW target (<out>/target, an HF directory) and heads for it (<out>/heads):
decoding with them is lossless relative to the new target, not the original.

    L = KL(p_orig || p_new) + lambda0 · L_Medusa-1
L_LM, self-distillation that keeps the backbone's quality: per answer row t, KL between the original
target's next-token distribution p_orig = softmax(LM_orig(f_t)) (f_t: the shards' stored feature, the
original's after the final norm, so no second model runs) and the new one's, softmax(LM_new(g_t)) with g_t
the trained backbone's feature. L_Medusa-1: medusa_objective.py's head loss on g (the heads read the
trained backbone's features; their soft labels are the new target's own distributions, detached: the heads
are verified against the new target). lambda0 = 0.2: Medusa's medusa_heads_coefficient in its Medusa-2
recipe.

The backbone: LoRA adapters (peft) on the attention and MLP projections, merged into the saved target, or
every weight (--full-finetune); it learns at --backbone-lr (default lr / 4: Medusa's recipe gives the
heads 4x the backbone's rate) behind a learning-rate warm-up of its own that starts after the heads'
warm-up: the first --heads-warmup steps train only the heads, on the stored features (the backbone is
still the original then, and the shards hold its features: a Medusa-1 warm start at Medusa-1's cost).
The backbone's decoder layers recompute their activations in the backward pass unless --keep-activations
(SmolLM2-135M, batch 4: peak RSS 6.9 GB instead of 9.8, ~35 s per joint step instead of ~31 on one core).

A checkpoint holds the heads and the backbone's trainable tensors (JointTrained), the optimizer, the
scheduler and the step: resumes are exact (trainer.py, loop.py). At the end the new target's features (a forward
through it) give the heads' accuracies, and `drift` how far it moved from the original; both go into
the heads' config.json with both targets' fingerprints. It trains in one process.
"""

from __future__ import annotations

import copy
import functools
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specdec.errors import SpecdecError
from specdec.files import atomic_dir
from specdec.heads.medusa import MedusaHeads
from specdec.heads.medusa_io import save_medusa
from specdec.heads.shipped import target_fingerprint
from specdec.training import medusa_objective
from specdec.training.loop import lr_lambda
from specdec.training.medusa_objective import MedusaObjective, head_accuracies, heads_record, held_in
from specdec.training.shards import ShardData

__all__ = ["JointTraining", "drift", "JointTrained", "JointObjective", "trainable_backbone"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
DRIFT_PROMPTS, DRIFT_TOKENS = 16, 32  # held-in prompts and greedy tokens each that `drift` is measured on


# ---- the backbone and what a checkpoint holds ----

def trainable_backbone(original, cfg):
    """(a copy of `original` to train, its peft wrapper or None): LoRA adapters on its attention and MLP
    projections (of the last cfg.lora_layers decoder layers, or all; the rest frozen), or every weight with
    cfg.full_finetune. `original` is left as it was."""
    model = copy.deepcopy(original).float().eval()
    model.requires_grad_(cfg.full_finetune)
    layers = list(getattr(model.get_decoder(), "layers", []))
    lora_layers = cfg.lora_layers
    if lora_layers > len(layers):
        raise SpecdecError(f"--lora-layers {lora_layers}: the target has {len(layers)} decoder layers")
    trained = layers[-lora_layers:] if lora_layers and not cfg.full_finetune else layers
    if not cfg.keep_activations:  # each trained layer's activations are recomputed in the backward pass
        for layer in trained:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    if cfg.full_finetune:
        return model, None
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    targets = [t for t in LORA_TARGETS if t in names]
    if not targets:
        raise SpecdecError(f"LoRA: the target has none of the projections {', '.join(LORA_TARGETS)}: "
                           "use --full-finetune")
    torch.manual_seed(cfg.seed)  # LoRA's A matrices start random: the same in every run of these settings
    only = {"layers_to_transform": list(range(len(layers) - lora_layers, len(layers)))} if lora_layers else {}
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets,
                      bias="none", **only)
    with warnings.catch_warnings():  # peft asks transformers a deprecated question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft_model = get_peft_model(model, lora)
    return peft_model.get_base_model(), peft_model


class JointTrained(nn.Module):
    """What a Medusa-2 checkpoint holds: the heads (heads.*) and the backbone's trainable tensors
    (backbone.*: LoRA's A and B, or every weight), not the frozen rest of the backbone."""

    def __init__(self, heads: MedusaHeads, backbone: nn.Module) -> None:
        super().__init__()
        self.heads, self.backbone = heads, backbone

    def trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.backbone.named_parameters() if p.requires_grad}

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        sd = {f"heads.{k}": v.detach() for k, v in self.heads.state_dict().items()}
        return sd | {f"backbone.{n}": p.detach() for n, p in self.trainable().items()}

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        want, have = set(self.state_dict()), set(state)
        if want != have:
            diff = ", ".join(sorted(want ^ have)[:3])
            raise SpecdecError(f"the checkpoint's tensors are not this run's ({diff}): resume with the same "
                               "settings or use another --out")
        self.heads.load_state_dict({k[len("heads."):]: v for k, v in state.items() if k.startswith("heads.")})
        with torch.no_grad():
            for n, p in self.trainable().items():
                p.copy_(state[f"backbone.{n}"])


def _kl(g, lm_new, f, lm_orig):
    """(Σ KL(p_orig || p_new), Σ [argmax p_new == argmax p_orig]) over the rows."""
    logq = torch.log_softmax(F.linear(g, lm_new), dim=-1)
    with torch.no_grad():
        logp = torch.log_softmax(F.linear(f, lm_orig), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum()
    return kl, (logq.detach().argmax(-1) == logp.argmax(-1)).float().sum()


class JointObjective(nn.Module):
    """Medusa-2's loss (module doc). `head` is what a checkpoint holds; the backbone stays in eval mode
    (no dropout: a step is a pure function of the weights and the batch)."""

    def __init__(self, trained: JointTrained, orig_lm: torch.Tensor, weights: list[float], lambda0: float) -> None:
        super().__init__()
        self.head = trained
        self.orig_lm = orig_lm  # frozen: a plain attribute
        self.medusa = MedusaObjective(trained.heads, self.new_lm().detach(), weights)
        self.lambda0 = lambda0

    def new_lm(self) -> torch.Tensor:
        return self.head.backbone.get_output_embeddings().weight

    def train(self, mode: bool = True):
        super().train(mode)
        self.head.backbone.eval()
        return self

    def forward(self, ids, feats, mask, joint: bool):
        """ids, mask [B, T], feats [B, T, H] (the original's). joint False (the heads' warm-up): the
        backbone gets no gradient and the heads read the stored features. Returns the loss and stats
        [1 + K, 3]: row 0 (Σ KL, Σ top-1 agreement with the original, rows), then the heads' (Σ CE, Σ top-1
        agreement, rows)."""
        k_heads = self.head.heads.num_heads
        lab = mask[:, 1:].bool()  # row t predicts x_{t+1}: an answer token
        n_lm = lab.sum().float()
        counts = torch.stack([mask[:, k + 2:].sum() for k in range(k_heads)]).clamp(min=1.0)
        lm = self.new_lm()
        if not joint:  # the backbone is still the original, whose features the shards hold: KL 0, agreement 1
            self.medusa.target_lm = lm.detach()
            h_loss, stats = self.medusa(ids, feats, mask, counts)
            return self.lambda0 * h_loss, torch.cat([torch.stack([n_lm * 0, n_lm, n_lm])[None], stats])
        g = self.head.backbone.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        self.medusa.target_lm = lm.view(lm.shape)  # a full fine-tune's LM head learns from the heads too
        h_loss, stats = self.medusa(ids, g, mask, counts)
        args = (g[:, :-1][lab], lm, feats[:, :-1][lab], self.orig_lm)
        if args[0].shape[0] * lm.shape[0] > medusa_objective.RECOMPUTE_ABOVE:
            kl, agree = checkpoint(_kl, *args, use_reentrant=False)
        else:
            kl, agree = _kl(*args)
        loss = kl / n_lm.clamp(min=1.0) + self.lambda0 * h_loss
        return loss, torch.cat([torch.stack([kl.detach(), agree, n_lm])[None], stats])


def heads_warmup(cfg, total: int) -> int:
    hw = total // 4 if cfg.heads_warmup < 0 else cfg.heads_warmup
    if hw >= total:
        raise SpecdecError(f"--heads-warmup {hw} leaves none of the run's {total} steps to train the backbone")
    return hw


def backbone_lambda(cfg, total: int, hw: int):
    """The backbone's learning-rate factor: 0 during the heads' warm-up, then the heads' schedule (warm-up,
    decay) over the steps that remain."""
    base = lr_lambda(cfg, total - hw)
    return lambda step: 0.0 if step < hw else base(step - hw)


# ---- the trainer's hooks (medusa.JointTrainer: these on Medusa-1's trainer) ----

class JointTraining:
    """Medusa-2's hooks of trainer.Trainer (module doc): the heads (the Medusa-1 trainer's `model`) with a
    copy of the target's backbone; at the end <out>/target and then <out>/heads (whose existence marks a
    finished run) are written. The summary adds "drift", "target" (its dir) and "model" (the new target, in
    memory)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stats_shape = (1 + self.cfg.num_heads, 3)  # row 0: the backbone's KL; then the heads'

    def setup(self) -> None:
        world = self.acc.num_processes
        if world > 1:
            raise SpecdecError(f"--joint trains in one process, not {world}: run it without accelerate launch")

    def trainable(self, heads: MedusaHeads) -> JointTrained:
        self.hw = heads_warmup(self.cfg, self.total)
        self.backbone, self.peft_model = trainable_backbone(self.target, self.cfg)
        return JointTrained(heads, self.backbone)

    def optimizer(self, trained: JointTrained):
        cfg, total = self.cfg, self.total
        head_params, bb_params = list(trained.heads.parameters()), list(trained.trainable().values())
        backbone_lr = cfg.backbone_lr or cfg.lr / 4
        opt = torch.optim.AdamW([{"params": head_params, "lr": cfg.lr}, {"params": bb_params, "lr": backbone_lr}],
                                weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [lr_lambda(cfg, total), backbone_lambda(cfg, total, self.hw)])
        self.meta["training"] |= {"heads_warmup": self.hw, "backbone_lr": backbone_lr,
                                  "backbone": "full" if cfg.full_finetune else f"lora r={cfg.lora_rank} "
                                  f"alpha={cfg.lora_alpha}" + (f" last {cfg.lora_layers} layers" if cfg.lora_layers
                                                               else "")}
        return head_params + bb_params, opt, sched

    def objective(self, trained: JointTrained) -> JointObjective:
        orig_lm = self.target_lm.to(self.acc.device)
        return JointObjective(trained, orig_lm, self.cfg.weights, self.cfg.lambda0)

    def loss(self, step, mine, ids, feats, mask):
        return self.module(ids, feats, mask, step >= self.hw)

    def record(self, s):
        n = s[0, 2].clamp(min=1.0)
        h = heads_record(self.cfg.weights, s[1:])
        kl, agree = float(s[0, 0] / n), float(s[0, 1] / n)
        rec = {"loss": kl + self.cfg.lambda0 * h.pop("loss"), "kl": kl, "lm_top1_agreement": agree} | h
        return rec, {"loss": f"{rec['loss']:.3f}", "kl": f"{kl:.4f}",
                     "acc": "/".join(f"{a:.2f}" for a in h["top1_acc_by_head"])}

    def write(self, trained, ckpt: Path) -> None:
        pass  # state.pt holds it all: the result is the merged target, written once at the end

    def finish(self, final: JointTrained, step: int, seconds: float) -> dict:
        cfg, original, data, heads, out = self.cfg, self.target, self.data, final.heads, Path(self.cfg.out)
        summary = {"heads": heads, "accuracies": None, "drift": None, "target": None, "model": None}
        if step < self.total:
            return summary
        for layer in getattr(self.backbone.get_decoder(), "layers", []):
            layer.__dict__.pop("forward", None)  # recomputation off again
        peft_model = self.peft_model
        new = (peft_model.merge_and_unload() if peft_model is not None else self.backbone).eval().requires_grad_(False)
        save_target(new, original, out / "target")
        heads.eval()
        new_lm = new.get_output_embeddings().weight.detach()
        accs, rows = head_accuracies(heads, NewFeatures(data, new), held_in(len(data), cfg.seed), new_lm)
        moved = drift(original, new, drift_prompts(data, cfg.seed), DRIFT_TOKENS)
        meta = self.meta
        meta["training"]["seconds"] = round(self.earlier + seconds, 3)
        heads.meta = meta | {"kind": "medusa-2", "target": target_fingerprint(new), "original_target": meta["target"],
                             "lossless_relative_to": str((out / "target").resolve()), "accuracies": accs,
                             "accuracy_rows": rows, "drift": moved}
        save_medusa(heads, out / "heads")
        if cfg.ship_to:
            save_medusa(heads, cfg.ship_to, dtype=torch.float16)
        return summary | {"accuracies": accs, "drift": moved, "target": str(out / "target"), "model": new}


def save_target(model, original, path: Path) -> None:
    """`model` as an HF directory (config.json, model.safetensors), with the original's tokenizer files
    when it was loaded from a directory that has them; written atomically."""
    src = Path(getattr(original, "name_or_path", "") or "")
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp)
        if str(src) and src.is_dir():
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp / name)


class NewFeatures:
    """The shards' token ids and masks with another backbone's features (one forward per batch): what
    head_accuracies reads to measure the heads against the new target."""

    def __init__(self, data: ShardData, model) -> None:
        self.data, self.decoder = data, model.get_decoder()
        self.dev = next(model.parameters()).device

    @torch.no_grad()
    def batch(self, seq_idx: list[int]):
        ids, _, mask = self.data.batch(seq_idx)
        feats = self.decoder(input_ids=ids.to(self.dev), use_cache=False).last_hidden_state.float()
        return ids, feats, mask


# ---- drift from the original ----

def drift_prompts(data: ShardData, seed: int, n: int = DRIFT_PROMPTS) -> list[list[int]]:
    """The prompts (the tokens before the first answer token) of n held-in training sequences."""
    out = []
    for i in held_in(len(data), seed, n):
        a, b = data.spans[i]
        answer = data.mask[a:b].nonzero()
        end = int(answer[0]) if len(answer) else b - a
        out.append(data.ids[a:a + max(end, 1)].tolist())
    return out


@torch.no_grad()
def greedy(model, prompt: list[int], n: int) -> list[int]:
    dev = next(model.parameters()).device
    out = model(torch.tensor([prompt], device=dev), use_cache=True)
    toks: list[int] = []
    while True:
        toks.append(int(out.logits[0, -1].argmax()))
        if len(toks) == n:
            return toks
        out = model(torch.tensor([toks[-1:]], device=dev), past_key_values=out.past_key_values, use_cache=True)


@torch.no_grad()
def drift(original_model, new_model, prompts_ids, n_tokens: int) -> dict:
    """How far a new target moved from the original on `prompts_ids`: the original's greedy continuation
    (n_tokens) of each prompt is read by both models; greedy_agreement = the share of those positions where
    the new model's argmax is the original's, kl_per_token = the mean KL(p_original || p_new) there
    (nats). An unchanged model scores 1 and 0."""
    prompts = [list(map(int, p)) for p in prompts_ids]
    if not prompts or any(not p for p in prompts) or n_tokens < 1:
        raise SpecdecError("drift needs non-empty prompts and n_tokens >= 1")
    agree = kl = 0.0
    n = 0
    for p in prompts:
        ids = p + greedy(original_model, p, n_tokens)
        rows = slice(len(p) - 1, len(ids) - 1)  # the logits that predict the continuation
        lp = torch.log_softmax(_logits(original_model, ids)[rows], -1)
        lq = torch.log_softmax(_logits(new_model, ids)[rows].to(lp.device), -1)
        kl += float((lp.exp() * (lp - lq)).sum())
        agree += float((lq.argmax(-1) == lp.argmax(-1)).sum())
        n += lp.shape[0]
    return {"greedy_agreement": round(agree / n, 6), "kl_per_token": round(max(kl, 0.0) / n, 8),
            "prompts": len(prompts), "tokens": n}


def _logits(model, ids: list[int]) -> torch.Tensor:
    dev = next(model.parameters()).device
    return model(torch.tensor([ids], device=dev), use_cache=False).logits[0].float()
