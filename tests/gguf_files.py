"""Small GGUF files for tests: a tiny HF model's weights in one GGUF block format, written with the `gguf`
package in llama.cpp's layout (llama's q/k rows interleaved as its converter does)."""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tests.conftest import tiny_model

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def random_blocks(qtype: GGMLQuantizationType, rows: int, k: int, rng: np.random.Generator, scale: float = 1.0):
    """Random valid blocks [rows, bytes]. Legacy formats quantize a random matrix (the package has their
    quantizers); K-quant codes and sub-scales are random bytes with finite fp16 super-block scales."""
    if qtype.name not in K_QUANTS:
        return quantize((rng.standard_normal((rows, k)) * 0.05 * scale).astype(np.float32), qtype)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // elems, nbytes), dtype=np.uint8)
    f16 = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)  # noqa: E731

    def set_d(d: float) -> None:
        if qtype.name == "Q6_K":
            raw[..., 208:210] = f16(d)
        else:  # the min's scale makes the mean code cancel (codes average 7.5 or 15.5)
            raw[..., 0:2] = f16(d)
            raw[..., 2:4] = f16(d * (7.5 if qtype.name == "Q4_K" else 15.5))

    set_d(1e-3)
    std = float(dequantize(raw.reshape(rows, -1), qtype).std())
    set_d(1e-3 * 0.05 * scale / std)  # weights of std ~0.05 * scale
    return raw.reshape(rows, -1)


def _interleave(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for the llama architecture."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_gguf(path, fmt: str, family: str = "llama", seed: int = 0, vocab_size: int = 97, head_scale: float = 8,
              **overrides):
    """(GGUF path, the HF model holding the same weights de-quantized). Hidden 256 so that K-quants fit."""
    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=vocab_size)
    model = tiny_model(family, seed=seed, **{**kw, **overrides})
    cfg = model.config
    qtype = GGMLQuantizationType[fmt]
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), family)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else 10000.0)
    sd = {}

    def quant(name: str, hf_name: str, weight: torch.Tensor, n_head: int | None = None, scale: float = 1.0):
        blocks = random_blocks(qtype, weight.shape[0], weight.shape[1], rng, scale)
        deq = dequantize(blocks, qtype).astype(np.float32)  # what the HF model gets, in HF's row order
        stored = blocks if n_head is None or family != "llama" else _interleave(blocks, n_head)
        w.add_tensor(name, stored, raw_dtype=qtype)
        sd[hf_name] = torch.from_numpy(deq)

    def f32(name: str, t: torch.Tensor):
        w.add_tensor(name, t.detach().float().numpy().copy())

    sdm = model.state_dict()
    quant("token_embd.weight", "model.embed_tokens.weight", sdm["model.embed_tokens.weight"], scale=20)
    quant("output.weight", "lm_head.weight", sdm["lm_head.weight"], scale=head_scale)  # 8: greedy never ties
    f32("output_norm.weight", sdm["model.norm.weight"])
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg in names.items():
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(hf)
            quant(b + gg + ".weight", p + f"self_attn.{hf}.weight", sdm[p + f"self_attn.{hf}.weight"], heads)
            if p + f"self_attn.{hf}.bias" in sdm:
                f32(b + gg + ".bias", sdm[p + f"self_attn.{hf}.bias"])
        for hf, gg in {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}.items():
            quant(b + gg + ".weight", p + f"mlp.{hf}.weight", sdm[p + f"mlp.{hf}.weight"])
        f32(b + "attn_norm.weight", sdm[p + "input_layernorm.weight"])
        f32(b + "ffn_norm.weight", sdm[p + "post_attention_layernorm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict(sd, strict=False)
    return path, model


def gguf_runner(path, model):
    """The lean runner on the GGUF file's own weights (model: for its config)."""
    from specdec.target.gguf import GGUFModel
    from specdec.target.lean import LeanRunner

    return LeanRunner(GGUFModel(path, model.config), weights="gguf")


def synthetic_gguf(path, cfg: dict, fmt: str, seed: int = 0):
    """A llama-shaped GGUF of random `fmt` blocks (no HF model behind it): for memory tests of large shapes.
    Written matrix by matrix, so writing it never holds more than one matrix."""
    from gguf import GGUFWriter

    qtype = GGMLQuantizationType[fmt]
    rng = np.random.default_rng(seed)
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kvd = cfg["num_key_value_heads"] * hd
    shapes = {"token_embd.weight": (v, h), "output.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        shapes.update({b + "attn_q.weight": (h, h), b + "attn_k.weight": (kvd, h), b + "attn_v.weight": (kvd, h),
                       b + "attn_output.weight": (h, h), b + "ffn_gate.weight": (f, h), b + "ffn_up.weight": (f, h),
                       b + "ffn_down.weight": (h, f)})
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}_norm.weight" for i in range(cfg["num_hidden_layers"])
                                      for n in ("attn", "ffn")]
    for name in norms:
        w.add_tensor(name, np.ones(h, np.float32))
    for name, (o, k) in shapes.items():
        w.add_tensor_info(name, (o, k // elems * nbytes), np.dtype(np.uint8), o * (k // elems) * nbytes,
                          raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _ in norms:
        w.write_tensor_data(np.ones(h, np.float32))
    for o, k in shapes.values():
        blocks = rng.integers(0, 256, size=(o, k // elems, nbytes), dtype=np.uint8)
        d = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
        if fmt == "Q6_K":
            blocks[..., 208:210] = d
        else:
            blocks[..., 0:2] = d
            if fmt in K_QUANTS or fmt in ("Q4_1", "Q5_1"):
                blocks[..., 2:4] = d
        w.write_tensor_data(blocks.reshape(o, -1))
    w.close()
    return path
