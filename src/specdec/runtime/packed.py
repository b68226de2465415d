"""The lean runners' linear layers: weights in the precision the user chose, activations and accumulation
in the model's own dtype (fp32 on the CPU), and every row's output independent of the call's other rows
(docs/design.md, "Batch invariance").

Precisions: the weight is stored as fp32, bf16, fp16 or int8 (symmetric, one fp32 scale per output
channel). The model that decodes is the target with its weights rounded so, and decoding is lossless
relative to it: the precision changes the weights, never how a row is computed.

Kernels, best first:
1. the streaming kernel (stream.py; CPU, fp32 activations): reads each weight once in its stored
   precision, widens it in registers, and is batch-invariant by construction at every row count;
2. oneDNN pre-packed GEMMs on the rounded weight (docs/design.md, "CPU costs": t(8)/t(1) ~ 1.5 against ~2.1 for MKL).
   oneDNN's GEMMs are row-independent up to some reduction length and not beyond (measured: K <= 1024
   on a Xeon, 2 threads), so a long reduction is split into blocks whose partial products are summed in
   a fixed order; the longest invariant block is probed once per shape on this machine, never assumed;
3. F.linear (CUDA; no oneDNN).

The oneDNN ops are private (inductor's freezing path uses them), so everything here checks they exist
and work, and falls back to plain torch ops otherwise.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F

from specdec.errors import SpecdecError
from specdec.runtime import stream
from specdec.runtime.gguf import QuantTensor, QuantWeight

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
GGUF = "gguf"  # a GGUF file's own quantized blocks (runtime/gguf.py), read by kernels/quant.cpp
FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCKS = (1024, 512, 256, 128)  # reduction blocks tried, longest first (longer ones were never invariant)


def precision_name(dtype: torch.dtype) -> str:
    return {v: n for n, v in FLOAT.items()}.get(dtype, str(dtype).removeprefix("torch."))


INT4 = "int4"  # Q4_1 blocks of 32 (4-bit codes, fp16 scale and minimum) quantized at load: kernels/quant.cpp
# Q8_0 blocks of 32 (8-bit codes, fp16 scale) quantized at load: draft heads over an fp32 target
# (Runner.head_weights), where the rounding moves draft scores, never what is accepted; a linear whose input
# size is not a multiple of 32 stays fp16
Q8 = "q8_0"


def weight_bytes(precision: str) -> float:
    """Bytes per stored weight at that precision (int8's per-row scales aside)."""
    return {"int8": 1, INT4: 20 / 32, Q8: 34 / 32}.get(precision) or FLOAT[precision].itemsize


def quantize_blocks(w: torch.Tensor, precision: str) -> QuantTensor:
    """w [O, K] as Q4_1 (INT4) or Q8_0 (Q8) blocks (the gguf package's quantizer), for the quantized kernel."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if w.shape[1] % 32:
        raise SpecdecError(f"weights={precision} needs every linear's input size to be a multiple of 32, "
                           f"got {w.shape[1]}")
    kind = GGMLQuantizationType.Q4_1 if precision == INT4 else GGMLQuantizationType.Q8_0
    blocks = quantize(w.detach().float().cpu().numpy(), kind)
    return QuantTensor(torch.from_numpy(blocks), int(kind), w.shape[1])


def round_weight(w: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the stored weight, its per-output scale or None): int8 codes in [-127, 127] with w ~ codes * scale,
    else w in that float type."""
    if precision != "int8":
        return w.to(FLOAT[precision]), None
    scale = (w.float().abs().amax(1) / 127).clamp_min(1e-12)
    return torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    try:
        w, x = torch.randn(8, 4), torch.randn(2, 3, 4)
        pw = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
        y = torch.ops.mkldnn._linear_pointwise(x.to(dtype), pw, None, "none", [], "")
        return torch.allclose(y.float(), F.linear(x, w), atol=1e-5 if dtype == torch.float32 else 0.05)
    except Exception:
        return False


class _Float:
    """One weight block in the activations' float type; packed for oneDNN on the CPU."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype, pack: bool) -> None:
        self.dtype = dtype
        w = w.to(dtype).contiguous()
        self.packed = pack and w.device.type == "cpu" and onednn_available(dtype)
        self.w = torch.ops.mkldnn._reorder_linear_weight(w, None) if self.packed else w

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, bias, "none", [], "")
        return F.linear(x, self.w, bias)


class Linear:
    """y = x W^T + b with W rounded to `precision` (PRECISIONS; None = the weight's own dtype); x, y and
    the accumulation in the weight's original dtype.

    invariant=True makes a row's output independent of the call's other rows (the streaming kernel, or
    blocked oneDNN reductions). invariant=False allows a faster path where the streaming kernel is
    missing: one block, and a single row (a decode step) through MKL's GEMV when the runner's probe
    finds it faster (`gemv`); the streaming kernel is invariant anyway and is used either way.

    block: reduce in blocks of this many inputs on the general kernel, as given (no streaming kernel, no
    probe, no GEMV): what invariant_block probes."""

    def __init__(self, weight: torch.Tensor | QuantTensor | list[QuantTensor], bias: torch.Tensor | None = None,
                 pack: bool = True, precision: str | None = None, invariant: bool = True, *,
                 block: int | None = None) -> None:
        if isinstance(weight, (QuantTensor, list)):  # quantized blocks: their kernel, batch-invariant as well
            self.stream = QuantWeight(weight if isinstance(weight, list) else [weight], bias)
            self.out_features, self.precision, self.invariant = self.stream.out_features, GGUF, True
            self.bias, self.scale, self.gemv, self.parts, self.slices = self.stream.bias, None, None, [], []
            return
        kernel = weight.device.type == "cpu" and stream.kernel() is not None
        if precision == Q8 and not (kernel and weight.shape[1] % 32 == 0):
            precision = "fp16"
        if precision in (INT4, Q8) and kernel:
            self.__init__(quantize_blocks(weight, precision), bias)
            self.precision = precision
            return
        weight = weight.detach()
        precision = None if precision == GGUF else precision  # a float matrix in a GGUF file: as stored
        self.bias = None if bias is None else bias.detach()
        self.out_features, k = weight.shape
        self.precision = precision or precision_name(weight.dtype)
        act = weight.dtype
        stored, self.scale = round_weight(weight, self.precision)
        self.stream = self.gemv = None
        self.parts, self.slices = [], []
        cpu = pack and weight.device.type == "cpu"
        if block is None and cpu and act == torch.float32 and stream.kernel() is not None:
            self.stream = stream.StreamWeight(stored, self.bias, self.scale)
            self.invariant = True
            return
        rounded = stored.to(act)  # the same model on a general kernel: the rounded weights, widened
        given, probe = block is not None, cpu and invariant and block is None
        if not given:
            block = invariant_block(self.out_features, k, precision_name(act), torch.get_num_threads()) if probe \
                else k
        # else rows may differ in the last bits between one-row and many-row calls (greedy ties can flip)
        self.invariant = probe and block > 0
        block = block or k
        self.slices = [slice(i, min(i + block, k)) for i in range(0, k, block)]
        self.parts = [_Float(rounded[:, s], act, pack) for s in self.slices]
        # the GEMV weight: the caller's tensor itself (no copy) when nothing was rounded
        self.gemv = weight if cpu and not (invariant or given) and self.scale is None and stored.dtype == act else None

    @property
    def packed(self) -> bool:
        return self.stream is not None or self.parts[0].packed

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus `residual` when given (added last: the same bits as adding it afterwards)."""
        if self.stream is not None:
            return self.stream(x, residual)
        y = self._linear(x)
        return y if residual is None else residual + y

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.numel() == x.shape[-1]:
            return F.linear(x, self.gemv, self.bias)
        one = len(self.parts) == 1 and self.scale is None
        y = self.parts[0].matmul(x if len(self.parts) == 1 else x[..., self.slices[0]].contiguous(),
                                 self.bias if one else None)
        for s, p in zip(self.slices[1:], self.parts[1:]):  # fixed order: the sum is the same for every row
            y = y + p.matmul(x[..., s].contiguous())
        if self.scale is not None:
            y = y * self.scale.to(y.dtype)
        if not one and self.bias is not None:
            y = y + self.bias
        return y


PROBE_ROWS = 64  # = lean.EXACT_ROWS: the most rows a batch-invariant forward may use
PROBE_COUNTS = (2, 3, 5, 8, 13, 16, 17, 31, 33, 64)  # row counts compared against single rows


@functools.cache
def invariant_block(n: int, k: int, precision: str, threads: int) -> int:
    """The longest reduction block (k itself if k <= 1024, else from BLOCKS) whose float GEMM gives every
    row the same bits alone as among PROBE_COUNTS rows, probed with random data of this shape on this
    machine (tests/test_precision.py checks every count). 0 if none does: rows may then differ in the
    last bits, as with any other kernel."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(PROBE_ROWS, k, generator=g)
    for block in (k,) * (k <= BLOCKS[0]) + tuple(b for b in BLOCKS if b < k):
        lin = Linear(w.to(FLOAT[precision]), block=block)
        alone = torch.cat([lin(x[r:r + 1]) for r in range(PROBE_ROWS)])
        if all(torch.equal(lin(x[:m]), alone[:m]) for m in PROBE_COUNTS):
            return block
    return 0


class HeadRows:
    """An LM head over some token ids only (a draft's reduced vocabulary): a fixed set on the linear kernels,
    plus a few more rows de-quantized to fp32 (the request's own tokens outside the set, which a draft is
    likely to copy). Column j of its logits is token `ids[j]`."""

    def __init__(self, weight, bias: torch.Tensor | None, ids: torch.Tensor, args: tuple) -> None:
        ids = ids.to(torch.long).cpu()
        rows = weight.take_rows(ids) if isinstance(weight, QuantTensor) else weight.detach()[ids.to(weight.device)]
        self.weight, self.bias, self.fixed = weight, bias, ids
        self.linear = Linear(rows, None if bias is None else bias[ids.to(bias.device)], *args)
        self.extra_ids = torch.empty(0, dtype=torch.long)
        self.extra: torch.Tensor | None = None  # [m, H] fp32 rows of extra_ids (None: none)

    @property
    def ids(self) -> torch.Tensor:
        return self.fixed if self.extra is None else torch.cat([self.fixed, self.extra_ids])

    def with_extra(self, ids: list[int]) -> HeadRows:
        """The same head that also scores `ids` (none of them in the fixed set); [] scores the fixed set only."""
        out = copy.copy(self)  # the fixed rows shared
        out.extra_ids = torch.tensor(ids, dtype=torch.long)
        if not ids:
            out.extra = None
            return out
        have = self.extra_ids.numel() if self.extra is not None else 0
        if have > len(ids) or self.extra_ids.tolist() != ids[:have]:
            have = 0  # not an extension of the rows held: all of them anew
        new, w = out.extra_ids[have:], self.weight
        rows = (w.rows(new) if isinstance(w, QuantTensor) else w.detach()[new.to(w.device)]).float()
        out.extra = torch.cat([self.extra, rows]) if have else rows  # only the new ids are de-quantized
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.extra is None:
            return y
        z = x @ self.extra.to(x.dtype).T
        if self.bias is not None:
            z = z + self.bias[self.extra_ids.to(self.bias.device)]
        return torch.cat([y, z], dim=-1)
