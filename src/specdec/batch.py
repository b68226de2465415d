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
(the forward is then split in two). Bits: within exact rows a row's bits are those it gets alone, whatever
shares its forward and however the prompt was split (test_prefill.py), so the chunked prompt's cache and first
token are those of its prefill alone. A runner without exact rows takes the prompt whole, in one step, as
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


@dataclass
class _Joining:
    seq: Sequence
    prompt: Prompt


class Batch:
    def __init__(self, runner: Runner, drafter: Drafter, eos_ids: set[int], prefill_chunk: int = PREFILL_CHUNK) -> None:
        """runner and drafter: the templates every sequence forks (their own state is never used).
        prefill_chunk: a step's rows; a prompt going in gets what the decoding rows leave of them."""
        if prefill_chunk < 1:
            raise SpecdecError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.runner, self.drafter, self.eos_ids = runner, drafter, eos_ids
        self.budget = min(prefill_chunk, runner.exact_rows) if runner.exact_rows else 0  # 0: prompts go in whole
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
        if joining is not None:  # the rows the decoding ones leave of the budget, a quarter of it at least
            decoding = sum(len(rows[0]) for _, rows in planned)
            parts.append((joining.seq.runner, joining.prompt.next(max(self.budget - decoding, self.budget // 4, 1)),
                          None, None))
            logits_rows.append(slice(-1, None))  # of the prompt, only its last row's: the first token's
        if not parts:
            return results
        outs = self.runner.forward_many(parts, self.drafter.aux_layers, logits_rows)
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
