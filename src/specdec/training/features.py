"""Datagen's model work on the serving engine: answers from continuous batching (batch.Batch, vanilla steps),
and the target's features of whole sequences from prefill forwards of exact rows, which give each row the bits
it gets while decoding. Datagen stores those features, or training computes them per batch from shards that
hold token ids only (online, as SpecForge's online mode), once per sequence with a feature cache."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdec.batch import Batch
from specdec.drafters.base import NoDrafter
from specdec.engine import Prompt
from specdec.files import atomic_file
from specdec.heads.shipped import target_fingerprint
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


def target_features(model, aux_layers: tuple[int, ...] = (), cache: str | os.PathLike | None = None) -> Features:
    """runner_features over the target `model` (loading.load_model's: a GGUF file on its own blocks) on the
    kernels it decodes with: the features a head reads while drafting. cache: a FeatureCache's directory."""
    runner = LeanRunner(model, exact=True)
    features = lambda seqs: runner_features(runner, seqs, tuple(aux_layers))  # noqa: E731
    if cache is None:
        return features
    # what the features' bits depend on: the target, its weights, the layers read, the kernels (a fallback's differ)
    identity = {"target": target_fingerprint(model), "weights": runner.weights, "aux_layers": list(aux_layers),
                "kernels": runner.kernel_path}
    return FeatureCache(Path(cache), identity, features)


class FeatureCache:
    """Features, each sequence's computed once and kept in `root` (one safetensors file per sequence, fp32 as
    computed: a run's numbers do not depend on what was kept; named by a hash of the target's identity and the
    token ids), read back in later epochs and runs. Why: on 2 cores a training step of Qwen2.5-1.5B spent
    ~60% of its time recomputing the target's prefill (18.5 of 30.5 s). A row's features do not depend on
    the machine (exact rows, AVX2 = AVX-512), so a cache moves between machines."""

    def __init__(self, root: Path, identity: dict, features: Features) -> None:
        self.root, self.features = root, features
        self.salt = json.dumps(identity, sort_keys=True).encode()
        self.hits = self.misses = 0

    def path(self, ids: list[int]) -> Path:
        key = hashlib.sha256(self.salt + torch.tensor(ids, dtype=torch.int32).numpy().tobytes()).hexdigest()[:32]
        return self.root / key[:2] / f"{key}.safetensors"

    def _read(self, path: Path, n: int) -> torch.Tensor | None:
        try:
            f = load_file(path)["features"]
        except (OSError, SafetensorError, KeyError):  # absent, or damaged: computed again
            return None
        return f if f.shape[0] == n else None

    def __call__(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        out = [self._read(self.path(ids), len(ids)) for ids in seqs]
        todo = [i for i, f in enumerate(out) if f is None]
        self.hits, self.misses = self.hits + len(seqs) - len(todo), self.misses + len(todo)
        for i, f in zip(todo, self.features([seqs[i] for i in todo]) if todo else []):
            with atomic_file(self.path(seqs[i])) as tmp:
                save_file({"features": f.contiguous()}, str(tmp))
            out[i] = f
        return out
