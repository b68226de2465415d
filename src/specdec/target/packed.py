"""The lean runners' linear layers: oneDNN pre-packed weights on the CPU (DESIGN.md §7: t(8)/t(1) ~ 1.5
instead of ~2.1 with MKL), in the precision the user chose, and batch-invariant (§7b).

Precisions: fp32 (the default), bf16 and fp16 (weights and the GEMM's input in that type, output back
in the activations' dtype), int8 (per-output-channel int8 weights, per-row 7-bit activations, integer
accumulation: the int8 target is a different, smaller model, and decoding is lossless relative to it).

Batch invariance: a row's output must not depend on the other rows of the call, or a verify forward of
N rows and N one-token decode steps drift apart (reduced precision amplifies 1e-6 into other tokens).
oneDNN's GEMMs are row-independent up to some reduction length and not beyond (measured: K <= 1024 on a
Xeon, 2 threads), so a long reduction is split into blocks whose partial products are summed in a
fixed order. The largest invariant block is probed once per shape on this machine, never assumed.

The ops are private (inductor's freezing and quantization paths use them), so everything here checks
they exist and work, and falls back to plain torch ops otherwise.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACT_LEVELS = 63  # int8 activations use 7 bits: u8*s8 pairs cannot saturate AVX2's 16-bit sums
BLOCKS = (1024, 512, 256, 128)  # reduction blocks tried, longest first (longer ones were never invariant)


def precision_name(dtype: torch.dtype) -> str:
    return {v: n for n, v in FLOAT.items()}.get(dtype, str(dtype).removeprefix("torch."))


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    try:
        w, x = torch.randn(8, 4), torch.randn(2, 3, 4)
        pw = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
        y = torch.ops.mkldnn._linear_pointwise(x.to(dtype), pw, None, "none", [], "")
        return torch.allclose(y.float(), F.linear(x, w), atol=1e-5 if dtype == torch.float32 else 0.05)
    except Exception:
        return False


@functools.cache
def int8_available() -> bool:
    try:
        w, x = torch.randn(8, 4), torch.randn(3, 4)
        lin = _Int8(w)
        xq, s = quantize_rows(x)
        exact = F.linear(xq.float() - 128, torch.round(w / lin.scale[:, None]))
        return torch.equal(lin.matmul(xq), exact)
    except Exception:
        return False


class _Float:
    """One weight block in a float precision; packed for oneDNN on the CPU."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype, pack: bool) -> None:
        self.dtype = dtype
        w = w.to(dtype).contiguous()
        self.packed = pack and w.device.type == "cpu" and onednn_available(dtype)
        self.w = torch.ops.mkldnn._reorder_linear_weight(w, None) if self.packed else w

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xin = x.to(self.dtype)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(xin, self.w, bias, "none", [], "").to(x.dtype)
        # (the packed kernel takes an fp32 bias with any input; F.linear wants one dtype)
        return F.linear(xin, self.w, None if bias is None else bias.to(self.dtype)).to(x.dtype)


class _Int8:
    """A weight as symmetric per-output-channel int8 codes (oneDNN's u8 x s8 GEMM on the CPU).

    The GEMM runs with unit scales, so it returns the int32 accumulator converted to float: exact, and
    the same integer on every kernel path. (With the real scales folded in, oneDNN's rounding of the
    product differs between one row and many: measured 1e-5.) The scales are applied afterwards,
    row by row, as plain elementwise products."""

    def __init__(self, w: torch.Tensor, pack: bool = True) -> None:
        w = w.float()
        self.scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        q = torch.round(w / self.scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.onednn = pack and w.device.type == "cpu"
        if self.onednn:
            self.w = torch.ops.onednn.qlinear_prepack(q, [1, w.shape[1]])
            self.ones, self.zero = torch.ones(w.shape[0]), torch.zeros(w.shape[0], dtype=torch.long)
        else:  # the same integer products in float (exact while partial sums stay below 2^24)
            self.w = q.float()

    def matmul(self, xq: torch.Tensor) -> torch.Tensor:
        """xq: uint8 codes with zero point 128 -> the integer dot products with the codes, as float."""
        if self.onednn:
            return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, self.w, self.ones, self.zero, None, 1.0, 0,
                                                      torch.float32, "none", [], "")
        return F.linear(xq.float() - 128, self.w)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, per-row scale): each row on its own 7-bit grid, so rows never affect each other."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / ACT_LEVELS
    return (torch.round(x / s) + 128).to(torch.uint8), s


class Linear:
    """y = x W^T + b. `precision` (PRECISIONS; None = the weight's own dtype) sets how W is stored and
    multiplied; the output has x's dtype.

    invariant=True makes a row's output independent of the call's other rows (blocked reductions, one
    kernel for every row count). invariant=False is the fastest path instead: one block, and a single
    row (a decode step) through MKL's GEMV on the unpacked weight, which kept in the forward's flow
    beat oneDNN's packed GEMM by ~25% (scripts/forward_probe.py); many rows stay on oneDNN."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 precision: str | None = None, invariant: bool = True) -> None:
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features, k = weight.shape
        self.precision = precision or precision_name(weight.dtype)
        self.int8 = self.precision == "int8"
        if self.int8 and not int8_available():
            pack = False
        dtype = FLOAT.get(self.precision, weight.dtype)
        cpu = pack and weight.device.type == "cpu"
        # integer sums are exact in any order: int8 needs no blocks
        probe = cpu and not self.int8 and invariant
        block = invariant_block(self.out_features, k, self.precision, torch.get_num_threads()) if probe else k
        # else rows may differ in the last bits between one-row and many-row calls (greedy ties can flip)
        self.invariant = self.int8 or (probe and block > 0)
        block = block or k
        self.slices = [slice(i, min(i + block, k)) for i in range(0, k, block)]

        def part(w):
            return _Int8(w, cpu) if self.int8 else _Float(w, dtype, pack)

        self.parts = [part(weight[:, s]) for s in self.slices]
        # the GEMV weight: the caller's tensor itself (no copy) when it already has the right dtype
        self.gemv = weight if cpu and not invariant and not self.int8 and weight.dtype == dtype else None

    @property
    def packed(self) -> bool:
        p = self.parts[0]
        return p.onednn if self.int8 else p.packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8:
            xq, s = quantize_rows(x)
            y = self.parts[0].matmul(xq) * self.parts[0].scale * s
            return (y if self.bias is None else y + self.bias).to(x.dtype)
        if self.gemv is not None and x.numel() == x.shape[-1]:
            return F.linear(x, self.gemv, self.bias)
        one = len(self.parts) == 1
        y = self.parts[0].matmul(x if one else x[..., self.slices[0]].contiguous(), self.bias if one else None)
        for s, p in zip(self.slices[1:], self.parts[1:]):  # fixed order: the sum is the same for every row
            y = y + p.matmul(x[..., s].contiguous())
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
        lin = Linear.__new__(Linear)
        lin.bias, lin.out_features, lin.precision, lin.int8, lin.gemv = None, n, precision, False, None
        lin.slices = [slice(i, min(i + block, k)) for i in range(0, k, block)]
        lin.parts = [_Float(w[:, s], FLOAT[precision], True) for s in lin.slices]
        alone = torch.cat([lin(x[r:r + 1]) for r in range(PROBE_ROWS)])
        if all(torch.equal(lin(x[:m]), alone[:m]) for m in PROBE_COUNTS):
            return block
    return 0
