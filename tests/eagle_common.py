"""Helpers shared by the EAGLE tests: tiny heads, drafters and self-distillation data."""

from pathlib import Path

import torch

from specdec.drafters.eagle import EagleDrafter
from specdec.heads.model import EagleHead, head_config
from specdec.heads.runner import HeadRunner
from specdec.training.datagen import generate_answers, pack_shard, teacher_force, write_shard
from specdec.tree import TreeBudget

ROOT = Path(__file__).resolve().parents[1]


# the four heads of FSPAD's ablation (Table 3): name -> (connector, pad)
VARIANTS = {"eagle": ("fc", False), "fs": ("sampler", False), "pad": ("fc", True), "fspad": ("sampler", True)}


def make_head(model, seed=0, draft_vocab=None, layers=1, variant="eagle", sampler_size=None):
    torch.manual_seed(seed)
    connector, pad = VARIANTS[variant]
    head = EagleHead(head_config(model.config, num_hidden_layers=layers), connector=connector, pad=pad,
                     sampler_size=sampler_size).eval()
    if draft_vocab is not None:
        head.set_draft_vocab(torch.tensor(draft_vocab), model.lm_head.weight.detach())
    return head


def drafter_for(model, head, dynamic, depth=5, topk=4, tree_size=10, **kw):
    emb, lm = model.get_input_embeddings().weight, model.lm_head.weight
    return EagleDrafter(HeadRunner(head, emb, lm), TreeBudget(depth, topk, tree_size) if dynamic else None, **kw)


def make_data(model, out: Path, n_seq=96, answer_len=32, seed=0):
    """Self-distillation shards for a tiny model (no tokenizer: random token prompts)."""
    g = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    v = model.config.vocab_size
    for shard in range(2):
        prompts = [torch.randint(3, v, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n_seq // 2)]
        answers = generate_answers(model, prompts, answer_len, 1.0 if shard else 0.0, {model.config.vocab_size - 1}, 0)
        seqs = [p + a for p, a in zip(prompts, answers)]
        t = pack_shard(seqs, [len(p) for p in prompts], teacher_force(model, seqs))
        write_shard(out / f"shard-{shard:05d}.safetensors", t, {"source": "test"})


def greedy_taus(target, drafter, prompts, n=40) -> list[float]:
    """tau per prompt; asserts each greedy output equals vanilla's."""
    from specdec.drafters.base import NoDrafter
    from specdec.sampling import SamplingParams
    from tests.test_engine import run

    taus = []
    for prompt in prompts:
        want, _ = run(target, NoDrafter(), prompt, SamplingParams(), n)
        got, stats = run(target, drafter, prompt, SamplingParams(), n)
        assert got == want
        taus.append(stats.tau)
    return taus
