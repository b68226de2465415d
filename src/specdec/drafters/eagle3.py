"""EAGLE-3 (method `eagle3`): EAGLE-2's drafting (drafters.eagle, dynamic trees, sampled children at T > 0)
with an EAGLE-3 head (heads.model.Eagle3Head). A committed row reads the target's hidden states entering
the head's aux layers, fused by the head's fc (runner.target_input); a draft row the head's own output.
The engine computes those states only because the drafter lists their layers (Drafter.aux_layers).
"""

from __future__ import annotations

from pydantic import field_validator

from specdec.drafters.base import Drafter
from specdec.drafters.eagle import Eagle2Options, eagle2_drafter, head_runner, with_shipped_head
from specdec.drafters.registry import Method, Target, option, register
from specdec.heads.shipped import shipped_targets


class Eagle3Options(Eagle2Options):
    # without a head given and none shipped at all, say so when the options are parsed, before any model loads
    model_config = Eagle2Options.model_config | {"validate_default": True}
    head: str | None = option(None, "EAGLE-3 head dir (`specdec train eagle3`, or an official EAGLE-3 export); "
                              "default: the one shipped for the target", shown="shipped")
    lookup: int | None = option(None, "a prompt-lookup chain in every tree: not available with eagle3 (0 only)",
                                ge=0, le=0, shown="0")

    @field_validator("head")
    @classmethod
    def _given(cls, v: str | None) -> str | None:
        if v is None and not shipped_targets("eagle3"):
            raise ValueError("must be given: no EAGLE-3 head ships for any target; pass head=<dir> "
                             "(train one with `specdec datagen --aux-layers eagle3` + `specdec train eagle3`)")
        return v


def build_eagle3(target: Target, opts: Eagle3Options) -> Drafter:
    opts = with_shipped_head(target, opts, "eagle3", "eagle3", "an EAGLE-3 head")
    runner, head_dir = head_runner(target, opts, "eagle3")
    drafter = eagle2_drafter(runner, opts, head_dir)
    drafter.name = "eagle3"
    return drafter


register(Method("eagle3", "EAGLE-3: EAGLE-2 drafting with an EAGLE-3 head (reads the target's low, middle and high "
                "layers; `specdec train eagle3`)", Eagle3Options, build_eagle3))
