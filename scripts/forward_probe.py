"""Where a target forward's time goes on this machine (a measurement, not a test): issue 23.

    python scripts/forward_probe.py            # the embedded SmolLM2-135M-Instruct, 2 threads

Prints (1) the memory floor (weight bytes / streaming bandwidth), (2) one decode forward (N = 1) whole,
without its linears and the linears alone, (3) the same weights through several CPU GEMV/GEMM
kernels (ours and oneDNN's/MKL's) at N = 1 to 32, and (4) per `weights=` precision the lean runner's
forward at N = 1 and 8 and how far a row's logits move between an N = 8 forward and N = 1 steps (0:
the batch invariance lossless decoding at that precision needs).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from specdec.machine import memory_floor
from specdec.runtime.lean import LeanRunner
from specdec.runtime.loading import load_model
from specdec.runtime.packed import Linear


def median_ms(fn, reps: int = 20, warm: int = 4) -> float:
    ts = []
    for i in range(reps + warm):
        t = time.perf_counter()
        fn()
        if i >= warm:
            ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


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
    Linear.__call__ = lambda self, x, residual=None: (x.new_zeros(x.shape[:-1] + (self.out_features,))
                                                      if residual is None else residual)
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

    def ours(precision):
        return [Linear(w, None, precision=precision) for w in weights], lambda x, lin: lin(x)

    kernels = {
        "streaming fp32 (ours)": lambda: ours("fp32"),
        "streaming bf16 weights (ours)": lambda: ours("bf16"),
        "streaming int8 weights (ours)": lambda: ours("int8"),
        "oneDNN packed fp32": lambda: ([torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights],
                                       lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
        "F.linear fp32 (MKL)": lambda: (weights, F.linear),
        "oneDNN packed bf16 (bf16 activations)": lambda: (
            [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) for w in weights],
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), w, None, "none", [], "")),
    }
    for name, make in kernels.items():
        try:
            ws, fn = make()
        except Exception as e:  # e.g. an op this CPU lacks
            print(f"{name:40s} unavailable: {str(e).splitlines()[0][:80]}")
            continue
        row = []
        for n in (1, 2, 4, 8, 16, 32):
            inputs = [torch.randn(n, w.shape[1]) for w in weights]
            row.append(median_ms(lambda: [fn(x, w) for x, w in zip(inputs, ws)], reps=6, warm=2))
        print(f"{name:40s} " + " ".join(f"N={n}: {ms:5.1f}" for n, ms in zip((1, 2, 4, 8, 16, 32), row)) + " ms")


    def batch_variance(run: LeanRunner) -> float:
        """Largest logit change of a row between one N = 8 forward and eight N = 1 steps."""
        chunk = run.forward(ids[200:208]).logits
        run.rollback()
        single = []
        for i in range(200, 208):
            single.append(run.forward(ids[i:i + 1]).logits[-1])
            run.commit([0])
        return (chunk - torch.stack(single)).abs().max().item()

    for precision in ("fp32", "bf16", "fp16", "int8"):
        rr = prefilled(LeanRunner(model, weights=precision))
        one = median_ms(lambda run=rr: (run.forward(ids[200:201]), run.rollback()))
        eight = median_ms(lambda run=rr: (run.forward(ids[200:208]), run.rollback()))
        print(f"weights={precision}: forward N=1 {one:.1f} ms, N=8 {eight:.1f} ms ({rr.decode_kernel}); "
              f"max |logit, N=8 row - N=1| = {batch_variance(rr):.2e}")


if __name__ == "__main__":
    main()
