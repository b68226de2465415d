"""Datagen's model work on the serving engine: answers from continuous batching (batch.Batch, vanilla steps),
and the target's features of whole sequences from prefill forwards of exact rows, which give each row the bits
it gets while decoding. Datagen stores those features, or training computes them per batch from shards that
hold token ids only (online, as SpecForge's online mode)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.batch import Batch
from specdec.drafters.base import NoDrafter
from specdec.engine import Prompt
from specdec.runtime.base import Runner
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams

# features of sequences: per sequence [len, H * (1 + k)] (f_t after the final norm, then the k aux layers' inputs)
Features = Callable[[list[list[int]]], list[torch.Tensor]]


def engine_answers(runner: Runner, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
                   eos_ids: set[int], width: int) -> list[list[int]]:
    """Each prompt's answer, cut after its first EOS (kept), decoded by continuous batching with up to `width`
    sequences a step; the next prompt joins as one leaves. Unseeded sampling draws from torch's global
    generator in a fixed order: a run is reproducible from torch.manual_seed."""
    batch = Batch(runner, NoDrafter(), eos_ids, stall=0)  # nobody streams: a prompt's chunk fills its step
    answers: list[list[int]] = [[] for _ in prompts]
    index, queue = {}, list(range(len(prompts)))
    while queue or len(batch):
        while queue and len(batch) < width:
            i = queue.pop(0)
            index[batch.join(prompts[i], params, max_new_tokens)] = i
        for seq, new in batch.step():
            if isinstance(new, Exception):
                raise new
            answers[index[seq]] += new
    return answers


@torch.inference_mode()
def runner_features(runner: Runner, seqs: list[list[int]], aux_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """The target's features of each whole sequence (fp32, on the CPU), from its prefill forwards."""
    out = []
    for ids in seqs:
        runner.reset()
        prompt = Prompt(runner, ids)
        while not prompt.complete:
            prompt.put(runner.forward(prompt.next(), logits_rows=slice(-1, None), aux_layers=aux_layers))
        o = prompt.out()
        f = o.features if o.aux is None else torch.cat([o.features, o.aux], -1)
        out.append(f.float().cpu())
    runner.reset()
    return out


def target_features(model, aux_layers: tuple[int, ...] = ()) -> Features:
    """runner_features over the target `model` (loading.load_model's: a GGUF file on its own blocks) on the
    kernels it decodes with: the features a head reads while drafting."""
    runner = LeanRunner(model, exact=True)
    return lambda seqs: runner_features(runner, seqs, tuple(aux_layers))
