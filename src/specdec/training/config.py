"""The settings every draft-head trainer shares, as an `Options` model: each field declared once with its
type, range, default and help, from which the CLI's flags, their help and the checks of API callers
come. A field marked `resume=True` is one a resumed (or re-run) run must share with the run in --out.
train.py (EAGLE, FSPAD, EAGLE-3) and medusa.py add their model's fields and may change a default.

Errors name a field by its flag ("--max-len must be an integer >= 2, got 1"): the flags are what the
docs and the CLI call these settings.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from pydantic.fields import FieldInfo

from specdec.options import Options, option

SCHEDULES = ("cosine", "linear", "constant")


def knob(default: Any, help: str, *, resume: bool = False, **kw: Any) -> Any:
    """A training field: `option(...)`, and whether a resumed run must share its value."""
    f = option(default, help, **kw)
    f.json_schema_extra["resume"] = resume
    return f


def recipe(base: type[Options], name: str, **change: Any) -> Any:
    """`base`'s field `name` (type, range, help, resume mark) with a trainer's own default, help or bounds
    (pydantic's Field keywords)."""
    return FieldInfo.merge_field_infos(base.model_fields[name], Field(**change))


class LoopConfig(Options):
    """What every trainer's config has (data, schedule, checkpoints, logging). The defaults are
    docs/training.md's recipe for the shipped heads (EAGLE: lr 1e-3, 3 epochs; Medusa: lr 1e-3, warmup
    20, clip 1.0; both batch 8)."""

    data: str = Field(description="datagen dir(s), comma-separated",
                      json_schema_extra={"resume": True, "metavar": "DIR[,DIR...]"})
    out: str = Field(description="run dir: checkpoints/, log.jsonl and the result; re-run the same command "
                     "to resume", json_schema_extra={"metavar": "DIR"})
    steps: int = knob(0, "optimizer steps; 0: as many as --epochs passes over the data take", ge=0, resume=True)
    epochs: float = knob(1.0, "passes over the data, when --steps is 0", gt=0, resume=True)
    batch_size: int = knob(8, "sequences per optimizer step, over all processes", ge=1, resume=True)
    max_len: int = knob(1024, "tokens kept per sequence (the rest is cut)", ge=2, resume=True)
    lr: float = knob(3e-4, "peak learning rate (AdamW)", ge=0, resume=True)
    warmup: int = knob(50, "steps of linear warmup to --lr; a warmup as long as the whole run is cut to a tenth "
                       "of it, with a note", ge=0, resume=True)
    schedule: Literal[SCHEDULES] = knob("cosine", "the learning rate after warmup: cosine or linear decay to "
                                        "--min-lr-ratio times --lr, or constant", resume=True)
    min_lr_ratio: float = knob(0.05, "where the decay ends, as a fraction of --lr", ge=0, le=1, resume=True)
    weight_decay: float = knob(0.0, "AdamW weight decay", ge=0, resume=True)
    clip: float = knob(0.5, "gradient-norm clip (0: none)", ge=0, resume=True)
    save_every: int = knob(200, "write a checkpoint every N steps and at the end (a re-run resumes from the "
                           "newest)", ge=1)
    keep_checkpoints: int = knob(2, "checkpoints kept, the newest", ge=1)
    log_every: int = knob(10, "a line of log.jsonl (loss, top-1 agreement, lr) every N steps", ge=1)
    seed: int = knob(0, "picks the batches and the noise: the same seed, the same run", ge=0, resume=True)
    precision: Literal["fp32", "bf16"] = knob("fp32", "bf16: the head's matmuls in bfloat16 under autocast (weights "
                                              "and optimizer stay fp32); ~2x faster on a CPU with AVX512-BF16 "
                                              "or AMX, and on a GPU")
    keep_in: str = knob("", "also keep each checkpoint here small enough to commit (fp16 weights in files of "
                        "<= 16 MiB, the schedule, no optimizer moments): a run whose --out holds no checkpoint "
                        "resumes from it, e.g. on a new machine from a folder in the repository",
                        metavar="DIR", shown="none")
    stop_after: int = knob(0, "testing aid: stop (as if killed) after N steps of this invocation; 0: run to "
                           "the end", ge=0)
    ship_to: str = knob("", "also write a small fp16 copy of the result here (without LM-head rows that "
                        "stayed the target's)", metavar="PATH", shown="none")
    init_from: str = knob("", "start from these trained weights (a warm start on new data, or Medusa-2 from "
                          "Medusa-1 heads)", metavar="PATH", shown="none", resume=True)

    @classmethod
    def label(cls, name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def resume_keys(cls) -> tuple[str, ...]:
        """The fields a resumed (or re-run) run must share with the run in --out."""
        return tuple(n for n, f in cls.model_fields.items() if (f.json_schema_extra or {}).get("resume"))

    @classmethod
    def from_dict(cls, d: dict) -> LoopConfig:
        """A config from a saved one (checkpoint, config.json): keys of other trainers' fields ignored."""
        return cls(**{k: v for k, v in d.items() if k in cls.model_fields})

    def check(self) -> None:
        """Rules between fields (each field's own are checked when the config is made)."""
