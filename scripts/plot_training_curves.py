"""Training curves of several head runs side by side (FSPAD's Figure 3): top-1 agreement and feature
loss (SmoothL1) against the step, one line per run, read from each run's log.jsonl.

    python scripts/plot_training_curves.py ~/.cache/specdec/runs/ablate-{eagle,eagle-w002,fs,pad,fspad} \\
        --out docs/fspad-training-curves.png [--labels "EAGLE,EAGLE w=0.02,EAGLE+FS,EAGLE+PAD,FSPAD"]

A run is a `specdec train` --out dir (or its log.jsonl); with --chain, a run warm-started from another run's
head continues that run's curve. Logged values are means over the steps since the
previous line (--log-every), on noisy training batches; --smooth N averages N lines more.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# the right panel's choices: log field -> (axis label, title)
RIGHT = {"feature_loss": ("SmoothL1(f̂, f)", "feature loss"), "loss": ("training loss", "loss"),
         "t1_accept": ("1 − TV(p, q) at T = 1 (training batches)", "sampled acceptance")}


def read_log(run: str) -> list[dict]:
    path = Path(run)
    path = path / "log.jsonl" if path.is_dir() else path
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    if not rows:
        raise SystemExit(f"{path}: no log lines")
    return rows


def run_config(run: str) -> dict:
    """The settings the run wrote (<run>/config.json), else {}."""
    cfg_file = Path(run) / "config.json"
    return json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}


def read_chain(run: str) -> list[dict]:
    """The run's log after the logs of the runs it was warm-started from (`--init-from <run>/head`), its
    steps counted on from theirs: one curve for a head trained in several legs."""
    rows = read_log(run)
    parent = Path(run_config(run).get("init_from") or "")
    if parent.name != "head" or not (parent.parent / "log.jsonl").is_file():
        return rows
    before = read_chain(str(parent.parent))
    offset = before[-1]["step"]
    return before + [{**r, "step": r["step"] + offset} for r in rows]


def label_of(run: str) -> str:
    """The run's own settings when it wrote them (<run>/config.json), else its directory name."""
    cfg = run_config(run)
    if not cfg:
        return Path(run).name
    parts = ["EAGLE"]
    if cfg.get("connector") == "sampler":
        parts.append("FS")
    if cfg.get("pad"):
        parts.append("PAD")
    name = "FSPAD" if parts == ["EAGLE", "FS", "PAD"] else "+".join(parts)
    return f"{name} (w={cfg.get('ce_weight', 0.1):g})"


def smooth(ys: list[float], n: int) -> list[float]:
    if n <= 1:
        return ys
    return [sum(ys[max(0, i - n + 1) : i + 1]) / len(ys[max(0, i - n + 1) : i + 1]) for i in range(len(ys))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run dirs (or log.jsonl files)")
    ap.add_argument("--labels", default=None, help="comma-separated, one per run (default: from each run's config)")
    ap.add_argument("--out", default="training-curves.png")
    ap.add_argument("--chain", action="store_true",
                    help="prepend the logs of the runs each run was warm-started from (--init-from <run>/head)")
    ap.add_argument("--smooth", type=int, default=1, help="moving average over this many log lines")
    ap.add_argument("--right", choices=sorted(RIGHT) + ["auto"], default="auto",
                    help="the right panel; auto: the feature loss, or for heads trained without one (EAGLE-3) "
                         "the sampled acceptance 1 - TV")
    a = ap.parse_args()
    labels = a.labels.split(",") if a.labels else None
    if labels is not None and len(labels) != len(a.runs):
        raise SystemExit(f"--labels has {len(labels)} names for {len(a.runs)} runs")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, feat_ax) = plt.subplots(1, 2, figsize=(11, 4))
    runs = [read_chain(run) if a.chain else read_log(run) for run in a.runs]
    right = a.right
    if right == "auto":
        right = "feature_loss" if any(r.get("feature_loss") for rows in runs for r in rows) else "t1_accept"
    for i, (run, rows) in enumerate(zip(a.runs, runs)):
        name = labels[i] if labels else label_of(run)
        steps = [r["step"] for r in rows]
        acc_ax.plot(steps, smooth([r["top1_acc"] for r in rows], a.smooth), label=name)
        feat_ax.plot(steps, smooth([r.get(right, 0.0) for r in rows], a.smooth), label=name)
        last = rows[-1]
        print(f"{name}: step {last['step']}, top-1 {last['top1_acc']:.3f}, {right} {last.get(right, 0.0):.4f}")
    acc_ax.set(xlabel="step", ylabel="top-1 agreement with the target (training batches)", title="accuracy")
    feat_ax.set(xlabel="step", ylabel=RIGHT[right][0], title=RIGHT[right][1])
    for ax in (acc_ax, feat_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
