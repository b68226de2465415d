"""A GGUF file's weights as the file stores them: quantized matrices stay in their block format, read
from the file into one huge-page mapping (never de-quantized to a float copy), and run on
kernels/quant.cpp.

`GGUFModel` stands where an HF model stands for the lean runner (config, decoder layers, embeddings,
norms, rotary module), with `QuantTensor`s in place of the quantized weight tensors. The decoded model
is the file's weights with every activation row quantized to int8 before each linear (as llama.cpp
computes it); decoding is lossless relative to that model, bit for bit.
"""

from __future__ import annotations

import functools
import mmap
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from specdec.errors import SpecdecError
from specdec.runtime import stream
from specdec.runtime.gguf_header import read_header

# the GGML block formats kernels/quant.cpp reads (gguf.GGMLQuantizationType names; ids and block sizes are
# the gguf package's), and those kernels/interleaved.cpp re-lays 16 rows at a time
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
X16_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ARCHS = ("llama", "qwen2", "mistral", "gemma3_text")  # the HF model types of the archs it loads
# HF norm -> the file's tensor, per layer: llama.cpp names the MLP's input norm ffn_norm in both families
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
GEMMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


@functools.cache
def quant_types() -> dict[int, tuple[str, int, int]]:
    """GGML type id -> (name, elements, bytes) per block of each format the kernels read, from the gguf
    package (imported here, on first use: it takes ~0.2 s)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in (GGMLQuantizationType[n] for n in KERNEL_TYPES)}


class QuantTensor:
    """A quantized matrix [O, K]: `data` uint8 [O, K / block * bytes], rows in GGUF's block layout, or after
    interleave() (x16) in records of 16 rows per block, the same bytes re-ordered."""

    def __init__(self, data: torch.Tensor, qtype: int, k: int) -> None:
        self.data, self.qtype, self.shape = data, qtype, (data.shape[0], k)
        self.x16 = False

    def interleave(self) -> QuantTensor:
        """Re-lay the rows in place for the x16 kernel where the format and row count allow (idempotent)."""
        if not self.x16 and self.type_name in X16_TYPES and self.shape[0] % 16 == 0:
            self.data.copy_(stream.kernel().repack16(self.data, self.qtype))
            self.x16 = True
        return self

    @property
    def type_name(self) -> str:
        return quant_types()[self.qtype][0]

    @property
    def family(self) -> int:  # activation block size the kernel pairs it with
        return quant_types()[self.qtype][1]

    @property
    def op(self) -> str:
        """The kernel op that reads it."""
        return "qlinear16" if self.x16 else "qlinear"

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """These rows de-quantized to fp32 [len(ids), K] (an embedding lookup)."""
        k = stream.kernel()
        return (k.qdequant16 if self.x16 else k.qdequant)(self.data, self.qtype, self.shape[1], ids.reshape(-1).cpu())

    def dequantize(self) -> torch.Tensor:
        """The whole matrix in fp32 (heads that need the float embedding; tests)."""
        return self.rows(torch.arange(self.shape[0]))

    def take_rows(self, ids: torch.Tensor) -> QuantTensor:
        """A new matrix of these rows, in the file's layout (a draft's LM head over a reduced vocabulary)."""
        data = stream.kernel().unpack16(self.data, self.qtype) if self.x16 else self.data
        return QuantTensor(data[ids.reshape(-1).cpu()].contiguous(), self.qtype, self.shape[1])

    def permute_rows(self, perm: torch.Tensor) -> QuantTensor:
        """The rows in this order, in place (the bytes stay where the loader put them)."""
        if self.x16:
            raise SpecdecError("an interleaved tensor's rows cannot be permuted: permute before the kernel sees it")
        self.data.copy_(self.data[perm])
        return self


class QuantWeight:
    """y = x W^T + b over one or more QuantTensors side by side (fused q/k/v may mix formats); every
    call quantizes x once per activation block size. Same call shape as stream.StreamWeight. The parts the
    x16 kernel reads are re-laid for it here (QuantTensor.interleave)."""

    def __init__(self, parts: list[QuantTensor], bias: torch.Tensor | None) -> None:
        self.parts = [p.interleave() for p in parts]
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.groups: list[tuple[list[torch.Tensor], list[int], str]] = []  # (weights, types, kernel op)
        for p in self.parts:  # consecutive parts one op reads with one activation block size share a call
            key = f"{p.op}/{p.family}"
            if self.groups and self.groups[-1][2] == key:
                self.groups[-1][0].append(p.data)
                self.groups[-1][1].append(p.qtype)
            else:
                self.groups.append(([p.data], [p.qtype], key))
        self._kernel = stream.kernel()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def call(self, key: str):
        """The kernel op of a group."""
        return getattr(self._kernel, key.split("/")[0])

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.groups) == 1:
            ws, ts, key = self.groups[0]
            return self.call(key)(x, ws, ts, self.bias, residual)
        y = torch.cat([self.call(key)(x, ws, ts) for ws, ts, key in self.groups], dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y


def float_weight(w):
    """A weight as a float tensor (a head reads rows of the target's LM head): quantized ones de-quantized."""
    return w.dequantize() if isinstance(w, QuantTensor) else w


def cat_rows(weights: list) -> torch.Tensor | list[QuantTensor]:
    """Matrices stacked along their outputs: a tensor for float weights, the parts for quantized ones."""
    if any(isinstance(w, QuantTensor) for w in weights):
        if not all(isinstance(w, QuantTensor) for w in weights):
            raise SpecdecError("a fused linear mixes quantized and float weights in this GGUF file")
        return list(weights)
    return torch.cat(weights)


class _Embedding:
    """get_input_embeddings() of a GGUFModel: `.weight` de-quantized on first use only (an EAGLE head
    reads the float table; the runner itself looks rows up in the quantized one)."""

    def __init__(self, table) -> None:
        self.table = table

    @functools.cached_property
    def weight(self) -> torch.Tensor:
        return self.table.dequantize() if isinstance(self.table, QuantTensor) else self.table


class GGUFModel:
    """What the lean runner and the drafters read from a model, over a GGUF file's own tensors."""

    def __init__(self, path: Path, config, generation_config=None) -> None:

        if stream.kernel() is None:
            raise SpecdecError("weights=gguf needs the streaming kernels (x86-64 with AVX2 and a C++ compiler); "
                               "use weights=fp32 or int8")
        self.path, self.config, self.generation_config = path, config, generation_config
        self.name_or_path = str(path)
        try:
            tensors = read_header(path)[1]
        except Exception as e:
            raise SpecdecError(f"could not read GGUF file {path}: {type(e).__name__}: {e}") from None
        arch = str(config.model_type)
        if arch not in ARCHS:
            raise SpecdecError(f"weights=gguf runs {', '.join(ARCHS)} models; {path} is {arch!r} (use weights=fp32)")
        self.n_params = sum(int(t.n_elements) for t in tensors)
        kinds = Counter(t.tensor_type.name for t in tensors if int(t.tensor_type) in quant_types())
        self.block_types = ", ".join(k for k, _ in kinds.most_common())  # e.g. "Q4_K, Q6_K" (most used first)
        arena = _Arena(path, [t for t in tensors if int(t.tensor_type) in quant_types()])
        get = functools.partial(_tensor, {t.name: t for t in tensors}, path, arena)
        cfg = config
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        permute = arch in ("llama", "mistral")  # llama.cpp's converter interleaves these archs' q/k rows
        is_gemma = arch == "gemma3_text"
        # llama.cpp stores Gemma's norm weights as 1 + w: back to HF's w, as transformers' loader does
        offset = 1.0 if is_gemma else 0.0

        def layer(i: int) -> SimpleNamespace:
            p = f"blk.{i}."
            q, k = get(p + "attn_q.weight"), get(p + "attn_k.weight")
            if permute:
                q = _unpermute(q, cfg.num_attention_heads)
                k = _unpermute(k, cfg.num_key_value_heads)
            proj = lambda w, b=None: SimpleNamespace(weight=w, bias=b)  # noqa: E731
            attn = SimpleNamespace(
                head_dim=hd, q_proj=proj(q, get(p + "attn_q.bias", True)), k_proj=proj(k, get(p + "attn_k.bias", True)),
                v_proj=proj(get(p + "attn_v.weight"), get(p + "attn_v.bias", True)),
                o_proj=proj(get(p + "attn_output.weight"), get(p + "attn_output.bias", True)))
            mlp = SimpleNamespace(gate_proj=proj(get(p + "ffn_gate.weight")), up_proj=proj(get(p + "ffn_up.weight")),
                                  down_proj=proj(get(p + "ffn_down.weight")))
            norm = lambda n: SimpleNamespace(weight=get(p + n + ".weight") - offset)  # noqa: E731
            if is_gemma:
                attn.scaling = cfg.query_pre_attn_scalar ** -0.5
                attn.q_norm, attn.k_norm = norm("attn_q_norm"), norm("attn_k_norm")
            return SimpleNamespace(self_attn=attn, mlp=mlp,
                                   **{hf: norm(g) for hf, g in (GEMMA_NORMS if is_gemma else NORMS).items()})

        embed = get("token_embd.weight")
        out = get("output.weight", True)
        self._embed = _Embedding(embed)
        self._head = SimpleNamespace(weight=out if out is not None else embed, bias=None)
        self._norm = get("output_norm.weight") - offset
        self._decoder = SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed),
                                        layers=[layer(i) for i in range(cfg.num_hidden_layers)],
                                        norm=SimpleNamespace(weight=self._norm), rotary_emb=_rotary(cfg))

    def get_decoder(self):
        return self._decoder

    def get_input_embeddings(self) -> _Embedding:
        return self._embed

    def get_output_embeddings(self):
        return self._head

    def parameters(self):
        """The float tensors (norms): what callers read device and dtype from."""
        yield self._norm

    def eval(self) -> GGUFModel:
        return self

    def streamed_bytes(self) -> int:
        """Bytes of weights a decode step reads: every matrix of the decoder and the head once, the norms
        (the embedding table only by one row, unless it is also the head)."""
        mats = [self._head.weight] + [w for lay in self._decoder.layers for w in _matrices(lay)]
        return sum(w.nbytes if isinstance(w, QuantTensor) else w.numel() * w.element_size() for w in mats)

    @property
    def weight_types(self) -> dict[str, int]:
        """How many matrices of each format the file's decoder and head use."""
        out: dict[str, int] = {}
        for w in [self._head.weight] + [w for lay in self._decoder.layers for w in _matrices(lay)]:
            name = w.type_name if isinstance(w, QuantTensor) else str(w.dtype).removeprefix("torch.")
            out[name] = out.get(name, 0) + 1
        return out


def _matrices(layer) -> tuple:
    a, m = layer.self_attn, layer.mlp
    return (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, m.gate_proj.weight,
            m.up_proj.weight, m.down_proj.weight)


def _huge_pages(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over one anonymous mapping, backed by huge pages where the OS offers them (it holds the
    mapping while views of it live)."""
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8)


def requantized(parts: list[QuantTensor], qtype: int) -> list[QuantTensor]:
    """These matrices re-quantized to another block format from their de-quantized values (gguf's quantizer),
    in the file's layout, their bytes together in one huge-page mapping as the loader's (_Arena: 4 KB pages
    stop the hardware prefetcher at every page)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = [torch.from_numpy(quantize(p.dequantize().numpy(), GGMLQuantizationType(qtype))) for p in parts]
    whole, at, out = _huge_pages(sum(b.numel() for b in blocks)), 0, []
    for b, p in zip(blocks, parts):
        data = whole[at:at + b.numel()].view(b.shape)
        data.copy_(b)
        out.append(QuantTensor(data, qtype, p.shape[1]))
        at += b.numel()
    return out


class _Arena:
    """The quantized tensors' bytes read from the file into one anonymous mapping, backed by huge pages
    where the OS offers them. Why not the file's own mapping: its 4 KB page-cache pages cost a decode
    step ~25% (Qwen2.5-1.5B Q4_K_M, 73 vs 56 ms: the hardware prefetcher stops at each 4 KB page). Read
    tensor by tensor, resident memory stays one copy of the weights (page cache is not counted)."""

    ALIGN = 64

    def __init__(self, path: Path, tensors: list) -> None:
        self.path = path
        self.offsets, total = {}, 0
        for t in tensors:
            self.offsets[t.name] = total
            total += -(-int(t.n_bytes) // self.ALIGN) * self.ALIGN
        self.whole = _huge_pages(total)

    def read(self, t) -> torch.Tensor:
        """Tensor `t`'s bytes, shaped as the reader shapes them (rows of blocks)."""
        a, n = self.offsets[t.name], int(t.n_bytes)
        with open(self.path, "rb") as fh:
            fh.seek(int(t.data_offset))
            if fh.readinto(memoryview(self.whole.numpy())[a:a + n]) != n:
                raise SpecdecError(f"{self.path} ends inside tensor {t.name}: the file is truncated")
        return self.whole[a:a + n].view(tuple(int(d) for d in t.data.shape))


def _tensor(tensors: dict, path: Path, arena: _Arena, name: str, optional: bool = False):
    t = tensors.get(name)
    if t is None:
        if optional:
            return None
        raise SpecdecError(f"{path} has no tensor {name!r}: not a supported Llama/Qwen2/Gemma 3 GGUF file")
    qtype = int(t.tensor_type)
    if qtype in quant_types():
        k = int(t.shape[0])  # GGUF lists dimensions innermost first
        if len(t.data.shape) != 2:
            raise SpecdecError(f"{path}: {name} is not a matrix")
        return QuantTensor(arena.read(t), qtype, k)
    with warnings.catch_warnings():  # the file is mapped read-only, and nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.asarray(t.data))
    if t.tensor_type.name in FLOAT_TYPES:
        return data.to(torch.float32).clone()  # norms, biases, small float matrices
    raise SpecdecError(f"{path}: {name} is stored as {t.tensor_type.name}, which weights=gguf does not read "
                       f"(it reads {', '.join(KERNEL_TYPES + tuple(FLOAT_TYPES))}); use weights=fp32")


def _unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row interleaving (transformers' reverse permutation, as a row order)."""
    rows = w.shape[0]
    perm = torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)
    return w.permute_rows(perm) if isinstance(w, QuantTensor) else w[perm]


def _rotary(cfg) -> nn.Module:
    """The family's rotary tables for this config. Static RoPE types as transformers' rotary modules compute
    them (_Rotary); dynamic ones from the family's own module, whose model code alone costs a process
    ~130 MB and ~1.6 s to import."""
    params = cfg.rope_parameters
    per_type = "rope_type" not in params  # Gemma 3: one set of parameters per layer type
    types = [t for t in sorted(set(cfg.layer_types)) if params[t] is not None] if per_type else [None]
    if all((params[t] if per_type else params)["rope_type"] not in DYNAMIC_ROPE for t in types):
        return _Rotary(cfg, types)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    return type(skeleton.get_decoder().rotary_emb)(config=cfg)


DYNAMIC_ROPE = ("dynamic", "longrope")  # tables that change with the sequence's length (dynamic_rope_update)


class _Rotary(nn.Module):
    """LlamaRotaryEmbedding's (and Qwen2's, Mistral's, Gemma3RotaryEmbedding's) tables, the same operations in
    the same order, so the same bits: inverse frequencies from the config (rope_init_fn), then cos and sin of
    position x frequency, times the type's attention scaling. types: Gemma 3's layer types (forward takes
    one), or [None]."""

    def __init__(self, cfg, types: list[str | None]) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        super().__init__()
        self.tables: dict[str | None, tuple[torch.Tensor, float]] = {}
        for t in types:
            p = cfg.rope_parameters[t] if t is not None else cfg.rope_parameters
            if p["rope_type"] == "default":
                dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
                inv_freq = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
                self.tables[t] = (inv_freq, 1.0)
            else:
                fn = ROPE_INIT_FUNCTIONS[p["rope_type"]]
                self.tables[t] = fn(cfg, None, layer_type=t) if t is not None else fn(cfg)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        inv_freq, scaling = self.tables[layer_type]
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)
