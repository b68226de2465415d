"""Plain helpers shared by the tests (fixtures live in conftest.py): tiny random models and tokenizers,
decoding and distribution checks, EAGLE heads and data, small GGUF files."""

import copy
import math
import string
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from scipy.stats import chisquare

from specdec.bench.data import Question
from specdec.drafters.base import NoDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.engine import decode
from specdec.heads.hydra import HydraHeads
from specdec.heads.medusa import MedusaHeads
from specdec.heads.model import Eagle3Head, EagleHead, head_config
from specdec.heads.runner import HeadRunner
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.stats import Stats
from specdec.training.datagen import eagle3_layers, generate_answers, pack_shard, teacher_force, write_shard
from specdec.tree import TreeBudget
from tests.tiny import tiny_model  # noqa: F401  (re-exported: the tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
SMALL_V = 5  # the distribution tests' vocabulary: 125 joints of the first 3 tokens

# ---- tiny models and tokenizers ----

def word_tokenizer(words):
    """A whitespace word-level tokenizer: ids 0 <unk>, 1 </s>, then the words."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
    t = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="</s>")



def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def ascii_tokenizer():
    """One token per printable ASCII character, space and newline, as byte-level tokens (the decoder llguidance
    reads, for structured output); the chat template of char_tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level space and newline
    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *chars])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")])
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = char_tokenizer().chat_template
    return tok


QS = [Question("81", "writing", ["Write a poem.", "Now shorter."]), Question("7", "qa", ["What is 2+2?"])]


def noisy_copy(model, scale=0.3, seed=1):
    """A draft that agrees with the target often but not always."""
    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return d


def flat_tiny(v: int = SMALL_V, seed: int = 5):
    """A tiny model over `v` tokens with a flattened head: every continuation likely enough to be sampled
    often, so every branch of the verifier runs in the distribution tests."""
    model = tiny_model("llama", vocab_size=v, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    return model


# ---- decoding and the distribution of its first tokens ----

PROMPTS = [[1, 2, 3], [5, 17, 33, 2, 9, 41, 60, 3], [88], list(range(10, 40))]


def run(runner, drafter, prompt, params, n, eos=()):
    stats = Stats()
    out = [t for step in decode(runner, drafter, prompt, params, n, set(eos), stats) for t in step]
    return out, stats


def first_tokens(steps, k: int = 3) -> list[int]:
    """A decode's tokens until k are out, the generator closed there: its later steps, whose tokens nothing
    counts, are not run."""
    toks = []
    with closing(steps):
        for new in steps:
            toks += new
            if len(toks) >= k:
                break
    return toks


def sample_first3(target, drafter, prompt, params, n=2000, coupled=True, whole=False):
    """Counts of the first 3 tokens over n seeds, and every draft size verified. 6 tokens are asked for
    so that whole trees get drafted (the engine drafts no more than it may still emit); the first 3
    must follow the target's exact joint (the steps after them are not run, unless `whole`: for a drafter
    that sizes its drafts from the answers it has seen, adaptive `auto`). coupled: seeded requests
    (sampling.Coupling); else unseeded ones (recursive rejection sampling) after seeding torch's global
    generator once."""
    # 2000 seeds: the verifier's bugs show far below the tests' 1e-3 (at 1500 already: a rejected draft's q
    # left in the residual, on a 3-token chain, p ~1e-5; a point-mass sibling not taken out, ~1e-40; seeded
    # draws sharing one position's noise, ~0)
    counts, sizes = np.zeros(SMALL_V**3), []
    torch.manual_seed(0)
    for seed in range(n):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed if coupled else None)
        st = Stats()
        toks = first_tokens(decode(target, drafter, prompt, p, 6, set(), st), 6 if whole else 3)
        counts[toks[0] * SMALL_V**2 + toks[1] * SMALL_V + toks[2]] += 1
        sizes += st.tree_sizes
    return counts, sizes


def exact_first3(model, prompt, params):
    """Exact joint of the first 3 tokens under vanilla sampling, by enumerating all continuations."""
    with torch.no_grad():
        p1 = probs_from_logits(model(torch.tensor([prompt])).logits[0, -1], params)
        ids2 = torch.tensor([prompt + [a] for a in range(SMALL_V)])
        p2 = probs_from_logits(model(ids2).logits[:, -1], params)  # [V, V]
        ids3 = torch.tensor([prompt + [a, b] for a in range(SMALL_V) for b in range(SMALL_V)])
        p3 = probs_from_logits(model(ids3).logits[:, -1], params).reshape(SMALL_V, SMALL_V, SMALL_V)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy().reshape(-1)


def runner_first3(runner, prompt, params, v):
    """Exact joint of the first 3 tokens of vanilla sampling from this runner (its own precision)."""
    def probs(ids):
        runner.reset()
        return probs_from_logits(runner.forward(torch.tensor(ids)).logits[-1], params)

    p1 = probs(prompt)
    out = np.zeros(v ** 3)
    for a in range(v):
        p2 = probs(prompt + [a])
        for b in range(v):
            p3 = probs(prompt + [a, b])
            out[a * v * v + b * v: a * v * v + b * v + v] = (p1[a] * p2[b] * p3).numpy()
    runner.reset()
    return out


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token with zero target probability was emitted"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def greedy_taus(target, drafter, prompts=PROMPTS, n=40) -> list[float]:
    """tau per prompt; asserts each greedy output equals vanilla's."""
    taus = []
    for prompt in prompts:
        want, _ = run(target, NoDrafter(), prompt, SamplingParams(), n)
        got, stats = run(target, drafter, prompt, SamplingParams(), n)
        assert got == want
        taus.append(stats.tau)
    return taus


# ---- EAGLE heads, drafters and self-distillation data ----

# the tiny training run's settings (conftest's `trained`, FSPAD's)
TRAIN_KW = dict(steps=100, batch_size=8, lr=3e-2, warmup=5, save_every=1000, log_every=10)

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
        with torch.random.fork_rng():  # HF's sampling draws from the global generator: seeded, whatever ran before
            torch.manual_seed(seed * 1_000_003 + shard)
            answers = generate_answers(model, prompts, answer_len, 1.0 if shard else 0.0, {v - 1}, 0)
        seqs = [p + a for p, a in zip(prompts, answers)]
        t = pack_shard(seqs, [len(p) for p in prompts], teacher_force(model, seqs))
        write_shard(out / f"shard-{shard:05d}.safetensors", t, {"source": "test"})


# ---- small GGUF files ----

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
              tokenizer: bool = False, **overrides):
    """(GGUF path, the HF model holding the same weights de-quantized). Hidden 256 so that K-quants fit.
    Gemma 3 as llama.cpp writes it: norms stored as 1 + w, four per layer and q/k's, the head tied.
    tokenizer: a vocabulary of one character per id (sentencepiece for Gemma, else BPE) and a chat template."""
    kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=vocab_size)
    model = tiny_model(family, seed=seed, **{**kw, **overrides})
    cfg = model.config
    qtype = GGMLQuantizationType[fmt]
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), family)
    gemma = family == "gemma3"
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": 10000.0}
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"] if gemma else rope["rope_theta"])
    if gemma:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
    sd = {}

    def quant(name: str, hf_name: str, weight: torch.Tensor, n_head: int | None = None, scale: float = 1.0):
        blocks = random_blocks(qtype, weight.shape[0], weight.shape[1], rng, scale)
        deq = dequantize(blocks, qtype).astype(np.float32)  # what the HF model gets, in HF's row order
        stored = blocks if n_head is None or family != "llama" else _interleave(blocks, n_head)
        w.add_tensor(name, stored, raw_dtype=qtype)
        sd[hf_name] = torch.from_numpy(deq)

    def f32(name: str, t: torch.Tensor):
        w.add_tensor(name, t.detach().float().numpy().copy())

    def norm(name: str, hf_name: str):
        if not gemma:
            return f32(name, sdm[hf_name])
        stored = sdm[hf_name].float() + 1
        f32(name, stored)
        sd[hf_name] = stored - 1  # what transformers' loader (and ours) read back

    sdm = model.state_dict()
    # tied (Gemma): the table is the head too, scaled so that sqrt(hidden) * a row is of unit size
    quant("token_embd.weight", "model.embed_tokens.weight", sdm["model.embed_tokens.weight"], scale=4 if gemma else 20)
    if not gemma:
        quant("output.weight", "lm_head.weight", sdm["lm_head.weight"], scale=head_scale)  # 8: greedy never ties
    norm("output_norm.weight", "model.norm.weight")
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
        norms = GEMMA3_NORMS if gemma else {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
        for gg, hf in norms.items():
            norm(b + gg + ".weight", p + hf + ".weight")
    if tokenizer:
        w.add_tokenizer_model("llama" if gemma else "gpt2")
        w.add_token_list([chr(0x100 + i) if i < 33 else chr(i) for i in range(cfg.vocab_size)])
        w.add_token_types([1] * cfg.vocab_size)
        w.add_token_scores([0.0] * cfg.vocab_size)
        if not gemma:
            w.add_token_merges([])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict(sd, strict=False)
    return path, model


GEMMA3_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def gguf_runner(path, model):
    """The lean runner on the GGUF file's own weights (model: for its config)."""
    from specdec.runtime.gguf import GGUFModel
    from specdec.runtime.lean import LeanRunner

    return LeanRunner(GGUFModel(path, model.config), weights="gguf")


def synthetic_gguf(path, cfg: dict, fmt: str, seed: int = 0):
    """A llama-shaped GGUF of random `fmt` blocks (no HF model behind it): for memory tests of large shapes.
    Written matrix by matrix, so writing it never holds more than one matrix."""
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


def make_head3(model, seed=0, draft_vocab=None, scale=0.2):
    """A random EAGLE-3 head over EAGLE-3's layers of `model`, with norms away from 1 so they matter."""
    torch.manual_seed(seed)
    head = Eagle3Head(head_config(model.config), eagle3_layers(model.config.num_hidden_layers)).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "lm_head" not in name:
                p.normal_(0, scale)
    if draft_vocab is not None:
        head.set_draft_vocab(torch.tensor(draft_vocab), model.lm_head.weight.detach())
    return head


def make_heads(model, k=3, layers=1, lm_head="own", vocab=None, seed=0, scale=0.3, lm_noise=0.05):
    """Random Medusa blocks (not Medusa's identity init: every head must differ from the target's own);
    "own" LM heads perturbed by lm_noise away from the target's rows (as trained heads would be)."""
    h = MedusaHeads(model.config.hidden_size, model.config.vocab_size, k, layers, lm_head)
    h.init_lm_heads(model.lm_head.weight.detach(), vocab)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in h.blocks:
            for lin in blk.layers:
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * scale / math.sqrt(lin.in_features))
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)
        for lm in (h.lm_heads or []) if lm_noise else []:
            lm.weight.add_(torch.randn(lm.weight.shape, generator=g) * lm_noise)
    return h.eval()


def make_hydra(model, k=3, layers=1, lm_head="target", vocab=None, seed=0, scale=0.5, prefix=False):
    """Random Hydra blocks (not the zero init: every head must read its path); prefix: with a random
    Hydra++ prefix layer (not the identity it starts as)."""
    sizes = {"prefix": HydraHeads.prefix_sizes(model.config)} if prefix else {}
    h = HydraHeads(model.config.hidden_size, model.config.vocab_size, k, layers, lm_head, **sizes)
    h.init_lm_heads(model.lm_head.weight.detach(), vocab)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blk in h.blocks:
            for lin in blk.layers:
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * scale / math.sqrt(lin.in_features))
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)
        if prefix:
            for name, w in h.prefix.named_parameters():
                if name.endswith("norm.weight"):
                    w.copy_(1 + 0.1 * torch.randn(w.shape, generator=g))
                else:
                    w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(w.shape[-1]))
    return h.eval()


def at_threads(n: int, scope: str = "module"):
    """An autouse fixture running its module's tests (and, at module scope, the module's own fixtures, which
    come after it) on n torch threads, then the count as it was."""
    @pytest.fixture(scope=scope, autouse=True)
    def threads():
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        yield
        torch.set_num_threads(before)

    return threads


def same_bits_on_any_thread_count(lin, x) -> bool:
    """A linear's rows give the same bits at 1, 2 and 3 threads, whole or one row alone: threads split a
    call's outputs, never a row's reduction."""
    before, got = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append((lin(x), lin(x[5:6])))
    finally:
        torch.set_num_threads(before)
    return all(torch.equal(y, got[0][0]) and torch.equal(one, got[0][0][5:6]) for y, one in got)


# ---- the CLI in this process ----

def cli_fed(argv, stdin, monkeypatch, capsys):
    """`specdec ARGV` through main() in this process with stdin a real descriptor, as a shell gives it: a pipe
    holding `stdin` and then closed, or /dev/null for None (what the CLI looks at: isatty, select, read).
    (exit code, stdout, stderr). For what does not depend on being a fresh process: library noise at start-up,
    signals and exit codes of the process itself are checked on a subprocess."""
    import os
    import sys

    from specdec.cli import main

    if stdin is None:
        r = os.open(os.devnull, os.O_RDONLY)
    else:
        r, w = os.pipe()
        os.write(w, stdin.encode())
        os.close(w)
    with os.fdopen(r) as f:
        monkeypatch.setattr(sys, "stdin", f)
        code = main(argv)
    got = capsys.readouterr()
    return code, got.out, got.err


def assert_tree_rows_are_steps(new_runner) -> None:
    """Exact rows: each row of a verify forward (a 7-node tree after a 13-token prompt) has the bits of the
    one-token decode step at its point. new_runner() -> a fresh runner of the model under test."""
    from specdec.runtime.base import tree_mask
    from specdec.tree import DraftTree

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (13,), generator=g).tolist()
    tree = DraftTree(torch.randint(0, 97, (7,), generator=g), torch.tensor([-1, 0, 0, -1, 1, 3, 4]))

    def prefilled():
        r = new_runner()
        r.forward(torch.tensor(prompt))
        r.commit(range(len(prompt)))
        return r

    r = prefilled()
    toks = torch.cat([torch.tensor([5]), tree.tokens])
    out = r.forward(toks, r.length + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth]),
                    tree_mask(r.length, tree.ancestor_mask()))
    for node in range(-1, len(tree)):
        ref = prefilled()
        for t in [5] + ([] if node < 0 else tree.tokens[tree.path_to(node)].tolist()):
            last = ref.forward(torch.tensor([t])).logits[0]
            ref.commit([0])
        assert torch.equal(out.logits[node + 1], last), f"node {node}"
