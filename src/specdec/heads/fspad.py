"""FSPAD's two changes to the EAGLE head (Gao et al., "Boosting Lossless Speculative Decoding via Feature
Sampling and Partial Alignment Distillation"), written once for the training module (heads.model) and the
lean runner (heads.runner), which pass in their own linears (nn.Linear or packed).

Feature Sampler (connector "sampler", in place of EAGLE's fc(cat(e, f))):
    η = f + down(SiLU(gate(e)) ⊙ up(f)),   gate, up: H -> I,  down: I -> H.
The residual is on f. Why: the head's first layer takes η without an input norm (as EAGLE), so η stays
at the scale of the target's features whatever the sampler learns, and the sampler only has to learn
the token-specific correction that e brings (the paper allows a residual; it does not pin one).

Partial Alignment Distillation (pad): the last decoder layer's MLP writes 2H instead of H; both halves
are added to the same residual h: f = h + m[:H] (feature loss; the next draft step's input feature) and
f̃ = h + m[H:] (the frozen LM head; logit loss).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

CONNECTORS = ("fc", "sampler")

Lin = Callable[[torch.Tensor], torch.Tensor]


def feature_sampler(e: torch.Tensor, f: torch.Tensor, gate: Lin, up: Lin, down: Lin) -> torch.Tensor:
    """η from the embedding e of x_{t+1} and the feature f_t (see the module docstring for the residual)."""
    return gated_sample(F.silu(gate(e)), f, up, down)


def gated_sample(gated: torch.Tensor, f: torch.Tensor, up: Lin, down: Lin) -> torch.Tensor:
    """η from SiLU(gate(e)) already computed (the runner's token table holds it for draft tokens)."""
    return f + down(gated * up(f))


def pad_outputs(h: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, f̃): the 2H MLP output m split in two, each half on the same residual h."""
    n = h.shape[-1]
    return h + m[..., :n], h + m[..., n:]
