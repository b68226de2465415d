"""The load benchmark's report: one row per server run, and each method's throughput over the first
method's, paired within a round."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Result:
    method: str
    max_batch: int
    requests: int
    completed: int
    errors: int
    tokens_per_s: float
    p50_latency_s: float | None
    p99_latency_s: float | None
    p50_ttft_s: float | None
    mean_batch: float | None
    rss_before_mb: float
    rss_after_mb: float
    soak: dict = field(default_factory=dict)
    round: int = 1  # --repeat: which round (each runs every limit, the methods in turn at each)
    # the run's drafts, from the server's counters: 1 + accepted / drafts (vLLM's mean acceptance length),
    # and accepted / drafted tokens; None when it drafted nothing
    mean_acceptance_length: float | None = None
    acceptance_rate: float | None = None
    long_requests: int = 0  # of `requests`, those with a long prompt
    p99_ttft_s: float | None = None
    # waits between successive pieces of one answer, over every answer: a stall while a long prompt joins
    # shows in the p99 and the largest
    p50_itl_s: float | None = None
    p99_itl_s: float | None = None
    max_itl_s: float | None = None


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def ratios(results: list[Result]) -> list[tuple[int, str, list[float], float | None]]:
    """Per limit and method after the first (the baseline): (limit, method, its tok/s over the baseline's in
    each round, the median of its p50 latency over the baseline's). Why paired by round: the methods of a
    round ran one after another at each limit, so they saw the same machine; rounds apart in time differ more
    (2 cores, the clients on them too) than the methods do."""
    by = {(r.round, r.max_batch, r.method): r for r in results}
    methods = list(dict.fromkeys(r.method for r in results))
    out = []
    for limit in dict.fromkeys(r.max_batch for r in results):
        for m in methods[1:]:
            pairs = [(by[(k, limit, m)], by[(k, limit, methods[0])]) for k, lim, mm in by
                     if lim == limit and mm == m and (k, limit, methods[0]) in by]
            tps = [a.tokens_per_s / b.tokens_per_s for a, b in pairs if b.tokens_per_s > 0]
            lat = [a.p50_latency_s / b.p50_latency_s for a, b in pairs if a.p50_latency_s and b.p50_latency_s]
            if tps:
                out.append((limit, m, tps, statistics.median(lat) if lat else None))
    return out


def markdown(results: list[Result]) -> str:
    soak = any(r.soak for r in results)
    rounds = max(r.round for r in results) > 1
    head = ["round"] * rounds + ["method", "max batch", "requests", "long", "completed", "errors", "tok/s",
                                 "p50 latency s", "p99 latency s", "p50 / p99 TTFT s",
                                 "p50 / p99 / max inter-token s", "mean batch", "acceptance length", "acceptance rate",
                                 "RSS before MB", "RSS after MB"]
    head += ["left", "malformed rejected", "mismatched", "server up"] if soak else []
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [str(r.round)] * rounds + [
            r.method, str(r.max_batch), str(r.requests), str(r.long_requests), str(r.completed), str(r.errors),
            f"{r.tokens_per_s:.1f}", _fmt(r.p50_latency_s, ".2f"), _fmt(r.p99_latency_s, ".2f"),
            f"{_fmt(r.p50_ttft_s, '.3f')} / {_fmt(r.p99_ttft_s, '.2f')}",
            f"{_fmt(r.p50_itl_s, '.3f')} / {_fmt(r.p99_itl_s, '.3f')} / {_fmt(r.max_itl_s, '.2f')}",
            _fmt(r.mean_batch, ".2f"), _fmt(r.mean_acceptance_length, ".2f"), _fmt(r.acceptance_rate, ".2f"),
            f"{r.rss_before_mb:.0f}", f"{r.rss_after_mb:.0f}"]
        if soak:
            s = r.soak
            cells += [str(s["left"]), str(s["malformed_rejected"]), str(s["mismatched"]), str(s["server_alive"])]
        rows.append("| " + " | ".join(cells) + " |")
    paired = ratios(results)
    if paired and not soak:
        base = results[0].method
        rows += ["", f"| max batch | method | tok/s × {base}, per round | median | p50 latency × {base}, median |",
                 "|---|---|---|---|---|"]
        rows += [f"| {limit} | {m} | {', '.join(f'{x:.2f}' for x in tps)} | {statistics.median(tps):.2f} | "
                 f"{_fmt(lat, '.2f')} |" for limit, m, tps, lat in paired]
    return "\n".join(rows) + "\n"
