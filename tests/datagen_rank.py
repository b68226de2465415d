"""One process of a datagen run across processes (started by tests/test_datagen_ranks.py under torchrun):
a tiny model (same seed in every process) with the converted SmolLM2 tokenizer given as argv[1]."""

import sys

import torch

from specdec.training.datagen import Plan, run_ranks
from tests.tiny import tiny_model

PLAN = Plan(shard_size=3, sources=["gsm8k", "self"], temperatures=[0.0, 1.0], max_new_tokens=8, self_prompt_tokens=8)


def main(tok_dir: str, out: str, n_shards: int) -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    run_ranks(model, tok, out, n_shards, PLAN, batch_size=3, progress=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
