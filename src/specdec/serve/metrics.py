"""The server's counters, as Prometheus text. The speculation counters and the latency histograms are named
as vLLM names its own (`vllm:spec_decode_*`, `vllm:time_to_first_token_seconds` there, `specdec:...` here), so
dashboards built for one read the other."""

from __future__ import annotations

import threading
from collections import Counter

from specdec.stats import Stats

# vLLM's buckets for the same histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)


class Histogram:
    """Observations counted into cumulative buckets, as Prometheus histograms are (plus +Inf, sum, count)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, x: float) -> None:
        self.sum += x
        self.count += 1
        for i, b in enumerate(self.bounds):
            if x <= b:
                self.counts[i] += 1

    def samples(self) -> list[tuple[str, str, float]]:
        """(name suffix, labels, value) of each line."""
        out = [("_bucket", f'{{le="{b}"}}', n) for b, n in zip(self.bounds, self.counts)]
        return out + [("_bucket", '{le="+Inf"}', self.count), ("_sum", "", self.sum), ("_count", "", self.count)]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by outcome: finished, cancelled, failed, rejected
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos: list[int] = []
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def first_token(self, seconds: float) -> None:
        """A request's first tokens reached its reader, `seconds` after it arrived."""
        with self._lock:
            self.ttft.observe(seconds)

    def next_tokens(self, seconds: float) -> None:
        """More of a request's tokens reached its reader, `seconds` after its previous ones (what a reader
        waits between two pieces of the answer: a step, or a step that carried another prompt's chunk)."""
        with self._lock:
            self.itl.observe(seconds)

    def request(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def tokens(self, prompt: int, generated: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated

    def speculation(self, s: Stats) -> None:
        with self._lock:
            self.drafts += sum(1 for n in s.tree_sizes if n)
            self.draft_tokens += sum(s.tree_sizes)
            self.accepted += sum(a - 1 for a in s.accept_lengths)
            for k, n in enumerate(s.depth_accepts):
                if k == len(self.accepted_per_pos):
                    self.accepted_per_pos.append(0)
                self.accepted_per_pos[k] += n

    def render(self, running: int, waiting: int, batch_size: int = 0, steps: tuple[int, int] = (0, 0)) -> str:
        with self._lock:
            rows = [
                ("num_requests_running", "gauge", "requests decoding now", [("", running)]),
                ("num_requests_waiting", "gauge", "requests in the queue", [("", waiting)]),
                ("batch_size", "gauge", "sequences decoding together now (--max-batch at most)", [("", batch_size)]),
                ("batch_steps_total", "counter", "decode steps", [("", steps[0])]),
                ("batch_sequences_total", "counter",
                 "sequences the decode steps carried, summed (over batch_steps_total: the mean batch size)",
                 [("", steps[1])]),
                ("requests_total", "counter", "requests by outcome",
                 [(f'{{outcome="{k}"}}', n) for k, n in sorted(self.requests.items())]),
                ("prompt_tokens_total", "counter", "prompt tokens of finished requests", [("", self.prompt_tokens)]),
                ("generation_tokens_total", "counter", "tokens generated", [("", self.generation_tokens)]),
                ("spec_decode_num_drafts_total", "counter", "verify forwards that checked a draft",
                 [("", self.drafts)]),
                ("spec_decode_num_draft_tokens_total", "counter", "draft tokens verified", [("", self.draft_tokens)]),
                ("spec_decode_num_accepted_tokens_total", "counter", "draft tokens accepted", [("", self.accepted)]),
                ("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                 "draft tokens accepted at each position of the draft (0: its first token)",
                 [(f'{{position="{k}"}}', n) for k, n in enumerate(self.accepted_per_pos)]),
            ]
            hists = [
                ("time_to_first_token_seconds", "time from a request's arrival to its first tokens", self.ttft),
                ("inter_token_latency_seconds", "time between successive pieces of a request's tokens", self.itl),
            ]
            hists = [(name, help, h.samples()) for name, help, h in hists]
        out = []
        for name, kind, help, samples in rows:
            out += [f"# HELP specdec:{name} {help}", f"# TYPE specdec:{name} {kind}"]
            out += [f"specdec:{name}{labels} {value}" for labels, value in samples]
        for name, help, samples in hists:
            out += [f"# HELP specdec:{name} {help}", f"# TYPE specdec:{name} histogram"]
            out += [f"specdec:{name}{suffix}{labels} {value}" for suffix, labels, value in samples]
        return "\n".join(out) + "\n"
