"""The server's counters, as Prometheus text. The speculation counters are named as vLLM names its own
(`vllm:spec_decode_*` there, `specdec:spec_decode_*` here), so dashboards built for one read the other."""

from __future__ import annotations

import threading
from collections import Counter

from specdec.engine import Stats


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

    def render(self, running: int, waiting: int, batch_size: int = 0) -> str:
        with self._lock:
            rows = [
                ("num_requests_running", "gauge", "requests decoding now", [("", running)]),
                ("num_requests_waiting", "gauge", "requests in the queue", [("", waiting)]),
                ("batch_size", "gauge", "sequences decoding together now (--max-batch at most)", [("", batch_size)]),
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
        out = []
        for name, kind, help, samples in rows:
            out += [f"# HELP specdec:{name} {help}", f"# TYPE specdec:{name} {kind}"]
            out += [f"specdec:{name}{labels} {value}" for labels, value in samples]
        return "\n".join(out) + "\n"
