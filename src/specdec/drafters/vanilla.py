"""`vanilla`: no drafting, the baseline every other method must reproduce token for token."""

from __future__ import annotations

from specdec.drafters.base import NoDrafter
from specdec.drafters.registry import Method, NoOptions, register

register(Method("vanilla", "none: one target forward per token (the baseline, same engine)", NoOptions,
                lambda target, opts: NoDrafter()))
