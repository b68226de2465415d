"""`specdec train eagle|fspad|eagle3|medusa`: the command line of train.py and medusa.py. The flags are the
config models' fields (training/config.py), checked as argparse reads them; a finished run is reported
before the target loads."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.files import check_writable
from specdec.options import add_flags, flag_values, one_line_errors
from specdec.runtime.loading import Runtime, load_model, materialize, resolve
from specdec.training.config import LoopConfig
from specdec.training.features import target_features
from specdec.training.loop import check_paths, load_target
from specdec.training.medusa import MedusaTrainConfig, finished_heads, train_medusa
from specdec.training.shards import aux_layers_of, tokens_only
from specdec.training.train import TrainConfig, finished_head, train_eagle

# the EAGLE-family subcommands: (name, the settings they fix, what they train)
EAGLE_KINDS = (
    ("eagle", {}, "an EAGLE-1/2 head, or FSPAD's ablations (--connector sampler, --pad)"),
    ("fspad", {"connector": "sampler", "pad": True}, "an FSPAD head: train eagle --connector sampler --pad"),
    ("eagle3", {"arch": "eagle3", "connector": "fc", "pad": False, "sampler_size": 0, "layers": 0},
     "an EAGLE-3 head (data: datagen --aux-layers eagle3): train eagle --arch eagle3"),
)


def add_parser(sub) -> None:
    tp = one_line_errors(sub.add_parser("train", help="train a draft head on `specdec datagen` data"))
    kinds = tp.add_subparsers(dest="kind", required=True)
    for kind, fixed, what in EAGLE_KINDS:
        p = one_line_errors(kinds.add_parser(kind, help=f"{what} (resumes from --out if it holds checkpoints)"))
        _add_config_flags(p, TrainConfig, fixed)
        p.set_defaults(func=cmd_train_eagle)
    p = one_line_errors(kinds.add_parser(
        "medusa", help="Medusa heads: K heads on the target's last feature; Medusa-1 (the target frozen), or "
        "Medusa-2 with --joint (the backbone trained too, saved as a new target), or Hydra's heads with --arch "
        "hydra; resumes from --out if it holds checkpoints"))
    _add_config_flags(p, MedusaTrainConfig)
    p.set_defaults(func=cmd_train_medusa)


def _add_config_flags(p: argparse.ArgumentParser, schema: type[LoopConfig], fixed: dict | None = None) -> None:
    p.add_argument("--model", default=None, metavar="PATH", help="the target, the one the data was made with: "
                   "HF dir, .gguf, or smollm2 (default: the embedded SmolLM2-135M-Instruct)")
    add_flags(p, schema, skip=tuple(fixed or ()), early=True)
    add_flags(p, Runtime, only=("threads",))
    p.set_defaults(**{f"{schema.__name__}.{k}": v for k, v in (fixed or {}).items()})


def config_of(args: argparse.Namespace, schema: type[LoopConfig]) -> LoopConfig:
    """The run's config from the parsed flags (the subcommand's fixed settings included)."""
    return schema.parse(flag_values(args, schema))


def checked_run(args, schema: type[LoopConfig], finished, said: Callable[[LoopConfig, str, Path], str],
                ) -> LoopConfig | None:
    """The run's config with every check done before the target loads; None when the run is already finished
    (`finished(cfg)`: (result dir, steps)), which is then said (`said(cfg, what, result dir)`) and nothing else
    happens."""
    Runtime.parse(flag_values(args, Runtime)).apply()
    cfg = config_of(args, schema)
    cfg.check()
    resolve(args.model)
    done = finished(cfg)
    if done is not None:
        print(said(cfg, f"{cfg.out} is already finished (step {done[1]}/{done[1]})", done[0]))
        return None
    check_paths(cfg)
    return cfg


def cmd_train_eagle(args) -> int:
    cfg = checked_run(args, TrainConfig, finished_head, lambda c, m, at: f"train {c.kind}: {m}; the head is in {at}")
    if cfg is None:
        return 0
    aux = aux_layers_of(cfg.data) if cfg.arch == "eagle3" else ()  # the data's aux layers
    online = tokens_only(cfg.data)
    if cfg.feature_cache:
        if not online:
            raise SpecdecError(f"--feature-cache: the shards in {cfg.data} hold their features already (it applies "
                               "to data of token ids alone, datagen --tokens-only)")
        check_writable(cfg.feature_cache, "--feature-cache")
    # data of token ids alone: each batch's features come from the target on its own kernels (online)
    if online:
        target = load_model(args.model)[0]  # a GGUF file on its own blocks: no fp32 copy of the whole model
        features = target_features(target, aux, cfg.feature_cache or None)
    else:
        target, features = load_target(materialize(args.model), args.model), None
    r = train_eagle(cfg, target, features=features)
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


def cmd_train_medusa(args) -> int:
    def named(c) -> str:
        return "train medusa" + (" --joint" if c.joint else "") + (" --arch hydra" if c.arch == "hydra" else "")

    def target(c) -> str:
        return f"; the new target is in {Path(c.out) / 'target'}" if c.joint else ""

    cfg = checked_run(args, MedusaTrainConfig, finished_heads,
                      lambda c, m, at: f"{named(c)}: {m}; the heads are in {at}{target(c)}")
    if cfg is None:
        return 0
    name = named(cfg)
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
          f"heads: {Path(cfg.out) / 'heads'}{target(cfg)}")
    return 0
