"""Continuous batching: sequences decoded together, each accepting its own number of tokens every step
(iteration-level scheduling, as in Orca and vLLM). Sequences join and leave between steps.

A step: every sequence's drafter proposes (engine.Sequence.draft, then Sequence.rows), the drafts stepped
together so that the draft models' and heads' forwards of all sequences at one depth run as one packed
forward (drafters.base.propose_many; n-gram lookups stay per sequence), ONE target forward verifies all
their rows (Runner.forward_many: the linears run once on every row, each sequence attends over its own
cache), then each sequence verifies and commits its own rows (Sequence.apply). Each sequence owns a fork of
the target runner (its KV cache) and of the drafter (its state) over shared weights; a row's bits are those
it gets decoded alone, the draft models' and heads' rows too, so every sequence drafts and emits what it
would alone.

A joining sequence's prompt goes in a chunk a step (chunked prefill, as in Sarathi and vLLM), packed into the
same forward_many as the decoding rows, so a long prompt no longer stalls the running streams for its whole
prefill (a 3,000-token prompt stalled three streams 8.5 s). The chunk is what the decoding rows leave of the
step's `prefill_chunk` rows (at most the runner's exact rows): decoding rows and chunk then make one forward,
the weights read once. It is a quarter of them at least, so a prompt keeps going in when drafts fill the step
(the forward is then split in two). While sequences decode, the chunk is also held to what keeps the step
within `stall` plain steps (Sarathi-Serve's token budget, priced from the steps' times: PromptRows), so the
running streams wait at most that long between two tokens; with none decoding it fills the step.

Bits: within exact rows a row's bits are those it gets alone, whatever shares its forward and however the
prompt was split (test_prefill.py), so the chunked prompt's cache and first token are those of its prefill
alone. A runner without exact rows takes the prompt whole, in one step, as
alone. Prompts go in one at a time, in order of arrival; a sequence decodes from the step after its prompt is in.

A sequence's ctx.forward_s here spans the packed forward and its neighbours' drafting and verification,
not a price of its own rows: drafters that learn prices from it (adaptive `auto`) fork without their clock,
drafting by the costs they had, each row priced as its share of the packed forward (ctx.sharing)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.drafters.base import Drafter, propose_many
from specdec.engine import Prompt, Sequence
from specdec.errors import SpecdecError
from specdec.grammar import Constraint
from specdec.runtime import threads
from specdec.runtime.base import ForwardOut, Runner
from specdec.sampling import SamplingParams
from specdec.stats import Stats

PREFILL_CHUNK = 64  # = lean.EXACT_ROWS: a step's rows, decoding and prompt together
STALL = 2.5  # a step carrying a prompt's chunk takes at most this many plain steps: inter-token p99 <= 3x p50
MIN_CHUNK = 4  # prompt rows a step carries at least: a long prompt keeps going in, however slow its rows
EMA = 0.25  # weight of the newest step time in PromptRows' running means


class PromptRows:
    """How many rows of a joining prompt a step carries beside the decoding rows: as many as keep the step
    within `stall` times a plain step, from running means of a plain step's time and of what each prompt
    row adds to the forward (a row's cost grows with its position: attention). Why: 64-row chunks of 2-4k
    token prompts made SmolLM2's inter-token p99 at batch 2 12x its p50."""

    def __init__(self, budget: int, stall: float) -> None:
        self.budget, self.stall = budget, stall
        self.step_s: float | None = None  # a plain step, what a running stream waits between two tokens
        self.forward_s: float | None = None  # its forward
        self.row_s: float | None = None  # what a prompt row adds to the forward

    def rows(self, decoding: int, running: bool) -> int:
        """The chunk for a step with `decoding` rows of `running` sequences (none: nobody waits)."""
        room = max(self.budget - decoding, self.budget // 4, 1)
        if not running or not self.stall:
            return room
        if self.step_s is None or self.row_s is None:  # a small first chunk measures a row
            return min(room, max(MIN_CHUNK, self.budget // 4))
        fit = int((self.stall - 1) * self.step_s / max(self.row_s, 1e-9))
        return min(room, max(fit, MIN_CHUNK))

    def observe(self, step_s: float, forward_s: float, rows: int, running: bool) -> None:
        """A step took `step_s`, its forward `forward_s`, with `rows` prompt rows (0: a plain step) beside
        `running` sequences' rows."""
        def mean(old: float | None, new: float) -> float:
            return new if old is None else old + EMA * (new - old)
        if not rows:
            self.step_s, self.forward_s = mean(self.step_s, step_s), mean(self.forward_s, forward_s)
        elif not running:  # the prompt alone: its rows are the forward
            self.row_s = mean(self.row_s, forward_s / rows)
        elif self.forward_s is not None:
            self.row_s = mean(self.row_s, max(forward_s - self.forward_s, 0.0) / rows)


@dataclass
class _Joining:
    seq: Sequence
    prompt: Prompt


class Batch:
    def __init__(self, runner: Runner, drafter: Drafter, eos_ids: set[int], prefill_chunk: int = PREFILL_CHUNK,
                 stall: float = STALL) -> None:
        """runner and drafter: the templates every sequence forks (their own state is never used).
        prefill_chunk: a step's rows; a prompt going in gets what the decoding rows leave of them.
        stall: a step with a prompt's chunk takes at most this many plain steps (PromptRows; 0: no limit)."""
        if prefill_chunk < 1:
            raise SpecdecError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if stall != 0 and not stall >= 1:  # NaN too
            raise SpecdecError(f"stall must be 0 or >= 1, got {stall}")
        self.runner, self.drafter, self.eos_ids = runner, drafter, eos_ids
        self.budget = min(prefill_chunk, runner.exact_rows) if runner.exact_rows else 0  # 0: prompts go in whole
        self.prompt_rows = PromptRows(self.budget, stall)
        self.active: list[Sequence] = []  # decoding
        self.joining: list[_Joining] = []  # their prompts going in, in order of arrival
        self._free: list[tuple[Runner, Drafter]] = []  # forks of sequences that left, for the next to join
        self._start: dict[Sequence, float] = {}
        self.draft_forwards = 0  # the last step's draft-model and head forwards, every sequence's packed
        r, d = runner.fork(), drafter.fork()
        if r is None:
            raise SpecdecError(f"this target's runner ({runner.kernel_path}) cannot decode several sequences at once")
        if d is None:
            raise SpecdecError(f"drafter {drafter.name!r} cannot decode several sequences at once yet")
        self._free.append((r, d))

    def __len__(self) -> int:
        """Sequences in the batch, decoding or joining."""
        return len(self.active) + len(self.joining)

    def join(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
             stats: Stats | None = None, constraint: Constraint | None = None) -> Sequence:
        """A new sequence: its prompt goes in over the next steps; the step that completes it gives the first
        tokens (step()). Bad input raises here. constraint: the grammar its answer follows (grammar.py)."""
        runner, drafter = self._free.pop() if self._free else (self.runner.fork(), self.drafter.fork())
        t0 = time.perf_counter()
        try:
            seq = Sequence(runner, drafter, prompt_ids, params, max_new_tokens, self.eos_ids, stats or Stats(),
                           constraint=constraint)
            prompt = seq.prefill_start()
        except BaseException:
            self._free.append((runner, drafter))
            raise
        self._start[seq] = t0
        self.joining.append(_Joining(seq, prompt))
        return seq

    def leave(self, seq: Sequence) -> None:
        """The sequence stops (done, or its client left, also while joining): its forks serve the next to join."""
        if seq in self.active:
            self.active.remove(seq)
        elif any(j.seq is seq for j in self.joining):
            self.joining = [j for j in self.joining if j.seq is not seq]
        else:
            return
        seq.finish()
        seq.stats.total_time = time.perf_counter() - self._start.pop(seq)
        self._free.append((seq.runner, seq.drafter))

    def step(self) -> list[tuple[Sequence, list[int] | Exception]]:
        """One step of every decoding sequence, and a chunk of the first prompt going in: each sequence's new
        tokens ([] if it ran out of context; a joining one's first tokens once its prompt is in), or the
        exception its drafting or verification raised (it has left). Done sequences leave."""
        threads.tick()  # between forwards: the thread count follows the machine (runtime/threads.py)
        t0 = time.perf_counter()
        results: list[tuple[Sequence, list[int] | Exception]] = []
        drafting = []
        for seq in list(self.active):
            seq.ctx.sharing = len(self.active)  # drafters price their rows as a share of the packed forward
            try:
                draft = seq.draft()
            except Exception as e:  # this sequence fails, the others go on
                self.leave(seq)
                results.append((seq, e))
                continue
            if draft is None:
                self.leave(seq)
                results.append((seq, []))
            else:
                drafting.append((seq, draft))
        t = time.perf_counter()
        trees, self.draft_forwards = propose_many([d for _, d in drafting])
        share = (time.perf_counter() - t) / max(len(drafting), 1)  # each sequence's draft time: its share
        planned = []
        for (seq, _), tree in zip(drafting, trees):
            try:
                if isinstance(tree, Exception):
                    raise tree
                planned.append((seq, seq.rows(tree, share)))
            except Exception as e:
                self.leave(seq)
                results.append((seq, e))
        parts = [(seq.runner, *rows) for seq, rows in planned]
        logits_rows: list[slice | None] = [None] * len(parts)
        joining = self.joining[0] if self.joining else None
        chunk = 0
        if joining is not None:
            tokens = joining.prompt.next(self.prompt_rows.rows(sum(len(rows[0]) for _, rows in planned),
                                                               bool(planned)))
            chunk = 0 if self.budget == 0 else len(tokens)  # a prompt that goes in whole measures nothing
            parts.append((joining.seq.runner, tokens, None, None))
            logits_rows.append(slice(-1, None))  # of the prompt, only its last row's: the first token's
        if not parts:
            return results
        t1 = time.perf_counter()
        outs = self.runner.forward_many(parts, self.drafter.aux_layers, logits_rows)
        forward_s = time.perf_counter() - t1
        for (seq, _), out in zip(planned, outs):
            try:
                results.append((seq, seq.apply(out)))
            except Exception as e:
                results.append((seq, e))
                self.leave(seq)
                continue
            if seq.done:
                self.leave(seq)
        if joining is not None:
            self._joined(joining, outs[-1], results)
        if chunk or (planned and joining is None):
            self.prompt_rows.observe(time.perf_counter() - t0, forward_s, chunk, bool(planned))
        return results

    def _joined(self, joining: _Joining, out: ForwardOut, results: list) -> None:
        """A prompt's chunk is in: when it was the last, the sequence's first tokens, and it decodes."""
        seq, prompt = joining.seq, joining.prompt
        try:
            prompt.put(out)
            if not prompt.complete:
                return
            first = seq.prefill_end(prompt.out())
        except Exception as e:
            results.append((seq, e))
            self.leave(seq)
            return
        seq.stats.prefill_time = time.perf_counter() - self._start[seq]  # from joining: the steps it shared
        self.joining.remove(joining)
        self.active.append(seq)
        results.append((seq, first))
        if seq.done:
            self.leave(seq)
