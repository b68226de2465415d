"""Where a target forward's time goes on this machine (a measurement, not a test): issue 23.

    python scripts/forward_probe.py            # the embedded SmolLM2-135M-Instruct, 2 threads

Prints (1) the memory floor (weight bytes / streaming bandwidth), (2) one decode forward (N = 1) whole,
without its linears and the linears alone, (3) the same weights through several CPU GEMV/GEMM
kernels at N = 1 and N = 8, and (4) for reduced-precision linears (bf16/fp16 weights and activations
through oneDNN) the speed of a forward and how far a row's logits move between an N = 8 forward and
N = 1 steps: the batch variance that decides whether such a target can be decoded losslessly.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from specdec.machine import memory_floor
from specdec.target.lean import LeanRunner
from specdec.target.loading import load_model
from specdec.target.packed import Linear


def median_ms(fn, reps: int = 20, warm: int = 4) -> float:
    ts = []
    for i in range(reps + warm):
        t = time.perf_counter()
        fn()
        if i >= warm:
            ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


class Reduced:
    """A packed linear whose weight and input are in `dtype` (oneDNN), output cast back to fp32."""

    def __init__(self, lin: Linear, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.w = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous(), None)
        self.b = None if lin.bias is None else lin.bias.to(dtype)
        self.dtype, self.out_features = dtype, lin.out_features

    def __call__(self, x):
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.w, self.b, "none", [], "").to(x.dtype)


def reduced_runner(model, dtype: torch.dtype) -> LeanRunner:
    r = LeanRunner(model)
    for layer, b in zip(model.get_decoder().layers, r.layers):
        a, m = layer.self_attn, layer.mlp
        b.qkv = Reduced(b.qkv, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(), dtype)
        b.o = Reduced(b.o, a.o_proj.weight.detach(), dtype)
        b.gate_up = Reduced(b.gate_up, torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), dtype)
        b.down = Reduced(b.down, m.down_proj.weight.detach(), dtype)
    r.lm_head = Reduced(r.lm_head, model.get_output_embeddings().weight.detach(), dtype)
    return r


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    model, _, _ = load_model(None, "cpu")
    fl = memory_floor(model)
    print(f"floor: {fl['weight_mb']:.0f} MB / {fl['bandwidth_gb_s']:.1f} GB/s = {fl['ms_per_forward']:.1f} ms "
          "per forward")
    ids = torch.randint(0, 40000, (260,), generator=torch.Generator().manual_seed(0))

    def prefilled(r):
        r.reset()
        r.forward(ids[:200], logits_rows=slice(-1, None))
        r.commit(range(200))
        return r

    r = prefilled(LeanRunner(model))
    step = lambda run=r: (run.forward(ids[200:201]), run.rollback())  # noqa: E731
    whole = median_ms(step)
    orig = Linear.__call__
    Linear.__call__ = lambda self, x: x.new_zeros(x.shape[:-1] + (self.out_features,))
    no_lin = median_ms(step)
    Linear.__call__ = orig
    xs = {576: torch.randn(1, 1, 576), 1536: torch.randn(1, 1, 1536)}
    alone = median_ms(lambda: [lin(xs[1536 if lin is b.down else 576])
                               for b in r.layers for lin in (b.qkv, b.o, b.gate_up, b.down)] + [r.lm_head(xs[576])])
    print(f"forward N=1: {whole:.1f} ms | without linears {no_lin:.1f} ms | linears alone {alone:.1f} ms "
          f"({fl['weight_mb'] / alone:.1f} GB/s) | floor {fl['ms_per_forward']:.1f} ms")

    weights = [lin_w for b in model.get_decoder().layers for lin_w in (
        torch.cat([b.self_attn.q_proj.weight, b.self_attn.k_proj.weight, b.self_attn.v_proj.weight]),
        b.self_attn.o_proj.weight, torch.cat([b.mlp.gate_proj.weight, b.mlp.up_proj.weight]), b.mlp.down_proj.weight)]
    weights = [w.detach().contiguous() for w in weights] + [model.get_output_embeddings().weight.detach()]
    for n in (1, 8):
        packed = lambda dt: [torch.ops.mkldnn._reorder_linear_weight(w.to(dt), None) for w in weights]  # noqa: E731
        onednn = lambda dt: lambda x, w: torch.ops.mkldnn._linear_pointwise(x.to(dt), w, None, "none", [], "")  # noqa
        kernels = {
            "oneDNN packed fp32": (packed(torch.float32), onednn(torch.float32)),
            "F.linear fp32 (MKL)": (weights, F.linear),
            "x @ W^T pre-transposed": ([w.t().contiguous() for w in weights], lambda x, w: x @ w),
            "oneDNN packed bf16": (packed(torch.bfloat16), onednn(torch.bfloat16)),
            "oneDNN packed fp16": (packed(torch.float16), onednn(torch.float16)),
        }
        for name, (ws, fn) in kernels.items():
            inputs = [torch.randn(n, w.shape[1]) for w in weights]
            ms = median_ms(lambda: [fn(x, w) for x, w in zip(inputs, ws)], reps=6, warm=2)
            print(f"N={n} {name:24s} {ms:6.1f} ms")

    def batch_variance(run: LeanRunner) -> float:
        """Largest logit change of a row between one N = 8 forward and eight N = 1 steps."""
        chunk = run.forward(ids[200:208]).logits
        run.rollback()
        single = []
        for i in range(200, 208):
            single.append(run.forward(ids[i:i + 1]).logits[-1])
            run.commit([0])
        return (chunk - torch.stack(single)).abs().max().item()

    for dtype in (torch.bfloat16, torch.float16):
        rr = prefilled(reduced_runner(model, dtype))
        ms = median_ms(lambda run=rr: (run.forward(ids[200:201]), run.rollback()))
        print(f"{str(dtype):15s} linears: forward N=1 {ms:.1f} ms (fp32 {whole:.1f}); "
              f"max |logit, N=8 row - N=1| = {batch_variance(rr):.2e}")
    print(f"fp32 linears: max |logit, N=8 row - N=1| = {batch_variance(prefilled(LeanRunner(model))):.2e}")

if __name__ == "__main__":
    main()
