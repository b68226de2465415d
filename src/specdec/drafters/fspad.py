"""FSPAD (Gao et al.): EAGLE-2 drafting with a head that has both of FSPAD's options, the Feature Sampler
connector and Partial Alignment Distillation's second MLP output (heads.fspad). Drafting, trees and
verification are EAGLE-2's; only the head differs."""

from __future__ import annotations

from pydantic import field_validator

from specdec.drafters.base import Drafter
from specdec.drafters.eagle import Eagle2Options, eagle2_drafter, head_runner, with_shipped_head
from specdec.drafters.registry import Method, Target, option, register
from specdec.drafters.union import with_lookup
from specdec.errors import SpecdecError
from specdec.heads.shipped import shipped_targets


class FspadOptions(Eagle2Options):
    # without a head given and none shipped at all, say so when the options are parsed, before any model loads
    model_config = Eagle2Options.model_config | {"validate_default": True}
    head: str | None = option(None, "FSPAD head dir (`specdec train fspad`); default: the one shipped for the "
                              "target", shown="shipped")

    @field_validator("head")
    @classmethod
    def _given(cls, v: str | None) -> str | None:
        if v is None and not shipped_targets("fspad"):
            raise ValueError("must be given: no FSPAD head ships for any target; pass head=<dir> "
                             "(train one with `specdec train fspad`)")
        return v


def build_fspad(target: Target, opts: FspadOptions) -> Drafter:
    opts = with_shipped_head(target, opts, "fspad", "fspad", "an FSPAD head")
    runner, head_dir = head_runner(target, opts, "fspad")
    if (runner.connector, runner.pad) != ("sampler", True):
        raise SpecdecError(f"method 'fspad' needs an FSPAD head (connector=sampler, pad=true); {head_dir} has "
                           f"connector={runner.connector}, pad={str(runner.pad).lower()}: run it with eagle2")
    drafter = eagle2_drafter(runner, opts, head_dir)
    drafter.name = "fspad"
    return with_lookup(drafter, opts.lookup or 0)


register(Method("fspad", "FSPAD: EAGLE-2 drafting with a head that has the Feature Sampler and PAD (`specdec train "
                "fspad`; EAGLE+FS or EAGLE+PAD heads run as eagle2)", FspadOptions, build_fspad))
