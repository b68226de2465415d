"""Our methods in the benchmark: a Decoder timed over its own decoding steps, whole or a step at a time
beside other methods (lockstep)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from specdec.api import GenerationParams
from specdec.bench.methods import MethodSpec
from specdec.bench.metrics import calibration_pairs
from specdec.stats import Stats


class OurMethod:
    def __init__(self, spec: MethodSpec, dec, precision: str, target: str | None = None) -> None:
        self.spec, self.dec = spec, dec
        self.precision = precision  # the target's linear weights this method ran (fp32, int8, ...)
        self.target = target  # its own target's dir (None: the run's model)
        self.gamma = dec.drafter.draft_depth  # draft steps per tree, for the Leviathan analysis

    def run(self, prompt_ids: list[int], temperature: float, seed: int, max_new: int, learn: bool = True,
            json_schema: str | None = None) -> dict:
        """learn: the drafter may keep this answer for later prompts (engine.decode's); json_schema: the
        answer's constraint (its text), or None."""
        return lockstep({0: self.start(prompt_ids, temperature, seed, max_new, learn, json_schema)})[0]

    def start(self, prompt_ids: list[int], temperature: float, seed: int, max_new: int,
              learn: bool = True, json_schema: str | None = None) -> Iterator[None]:
        """run() a step at a time: yields after each decoding step and returns the record. Its wall time is
        the time spent inside its own steps, so other methods may step in between (`lockstep`), and the
        grammar's setup for this request (a fresh matcher)."""
        dec, stats, trace = self.dec, Stats(), []

        def on_verify(tree, verdict):  # references only: the arithmetic happens after the clock stops
            if tree.scores is not None and len(tree):
                trace.append((tree.scores, tree.parents, verdict.path))

        params = GenerationParams(temperature=temperature, seed=seed, json_schema=json_schema)
        tokens: list[int] = []
        t0 = time.perf_counter()
        # the prefill's forwards are steps too: a long prompt's ~0.6 s prefill timed whole drifted +-8% between methods
        steps = dec.steps(prompt_ids, params, max_new, stats, on_verify=on_verify, learn=learn, prefill_steps=True)
        wall = time.perf_counter() - t0
        while True:
            t0 = time.perf_counter()
            step = next(steps, None)
            wall += time.perf_counter() - t0
            if step is None:
                break
            tokens += step
            yield
        stats.total_time = wall  # the engine's clock also ran while other methods stepped
        s = stats.summary()
        rec_stats = {
            "target_forwards": stats.target_forwards, "accept_histogram": stats.accept_histogram(),
            "depth_tries": list(stats.depth_tries), "depth_accepts": list(stats.depth_accepts),
            "time": s["time"], "gamma": self.gamma, "tau": stats.tau, "mean_tree_size": s["mean_tree_size"],
            "tree_sizes": list(stats.tree_sizes),
            "finish_reason": stats.finish_reason, "accept_lengths": list(stats.accept_lengths),
        }
        return {"tokens": tokens, "wall_time": wall, "stats": rec_stats, "calibration": calibration_pairs(trace)}


def lockstep(runs: dict) -> dict:
    """Advance each of `runs` (OurMethod.start generators) by one step in turn until all are done; their
    records by key. Why: the host's speed drifts over seconds (another VM's load: one prompt's
    back-to-back ratio swung by +-10%), and methods stepping in turn see the same drift."""
    live, out = dict(runs), {}
    while live:
        for k in list(live):
            try:
                next(live[k])
            except StopIteration as done:
                out[k] = done.value
                del live[k]
    return out
