"""The tiny random-weight models, apart from helpers.py: a process that needs only a model (a torchrun worker
of test_datagen_ranks) imports this alone, not helpers' scipy, GGUF and head imports (~3 s a process)."""

import torch
import transformers

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, vocab_size=97, tie_word_embeddings=False,
)
_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "gemma3": "Gemma3TextConfig"}


_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, vocab_size=97, tie_word_embeddings=False,
)


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A random-weight model built from a config: fast, and every family we claim to support."""
    cls = getattr(transformers, _CONFIGS[family])
    kw = dict(_COMMON, **overrides)
    if family == "mistral":
        kw.setdefault("sliding_window", 4096)
    if family == "gemma3":
        kw = dict(_gemma3(kw), **overrides)
    cfg = cls(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # random init gives near-uniform logits; scale the head so greedy choices are not ties
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        if family == "gemma3":  # Gemma's norms start at w = 0 (a scale of 1): random ones test the 1 + w
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
    return model


def _gemma3(kw: dict) -> dict:
    """A tiny Gemma 3: local (window 8) and global layers alternating, the global RoPE base and a linear
    scaling of their own (as the 4B model has), an attention scale other than head_dim's, tied embeddings."""
    n = kw["num_hidden_layers"]
    return dict(kw, head_dim=kw["hidden_size"] // kw["num_attention_heads"], sliding_window=8,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}},
                query_pre_attn_scalar=24, tie_word_embeddings=True)
