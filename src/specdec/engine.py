"""The one decoding loop: draft, verify in one target forward, compact the cache, emit."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from typing import TypeVar

import torch

from specdec.drafters.base import DecodeContext, Drafter, Drafting, alone, follow
from specdec.errors import SpecdecError
from specdec.grammar import Constraint
from specdec.runtime import stream, threads
from specdec.runtime.base import ForwardOut, Runner, side_mask, tree_mask
from specdec.sampling import SamplingParams
from specdec.slot import Lease, Slot
from specdec.stats import Stats
from specdec.tree import DraftTree
from specdec.verify import Verdict, verify

T = TypeVar("T")
Rows = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]  # tokens, positions, mask: Runner.forward's


def _clock(device: torch.device) -> float:
    if device.type == "cuda":  # timings must include queued kernels
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Sequence:
    """One request's decoding: prefill, then steps split around the target forward. plan() has the
    drafter propose and gives the rows to verify; apply(out) verifies them, commits the accepted rows,
    keeps the stats, has the drafter follow, and gives the new tokens. decode() runs one sequence; a batch
    (batch.py) runs every sequence's draft() together, rows() for each, one packed forward, then apply for each.

    on_verify(tree, verdict), if given, sees every verified draft (e.g. the benchmark's calibration of
    tree scores vs acceptance); it runs outside the draft/verify timers."""

    def __init__(self, runner: Runner, drafter: Drafter, prompt_ids: list[int], params: SamplingParams,
                 max_new_tokens: int, eos_ids: set[int], stats: Stats,
                 on_verify: Callable[[DraftTree, Verdict], None] | None = None,
                 constraint: Constraint | None = None) -> None:
        if not prompt_ids:
            raise SpecdecError("the prompt is empty")
        if max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt_ids) >= runner.max_length:
            raise SpecdecError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is {runner.max_length}: "
                "no room to generate"
            )
        self.runner, self.drafter, self.prompt_ids, self.params = runner, drafter, prompt_ids, params
        self.max_new_tokens, self.eos_ids, self.stats, self.on_verify = max_new_tokens, eos_ids, stats, on_verify
        self.constraint = constraint  # a grammar the answer must follow (grammar.py), or None
        self.dev = runner.device
        self.gen = params.generator(self.dev)
        self.coupling = params.coupling(runner.vocab_size, stream.kernel())
        self.typical = drafter.acceptance
        if self.typical is not None and not params.greedy:
            stats.acceptance = f"LOSSY {self.typical}"
        self.aux = drafter.aux_layers
        stats.prompt_tokens = len(prompt_ids)
        stats.drafter = drafter.name
        stats.kernels = runner.kernel_path
        self.n = 0  # tokens emitted
        self.ended = False  # out of context
        self.ctx: DecodeContext | None = None
        self._tree, self._t = DraftTree.empty(), 0.0
        self._finished = False

    @property
    def done(self) -> bool:
        return self.ended or self.stats.finish_reason == "stop" or self.n >= self.max_new_tokens

    def prefill(self) -> list[int]:
        """The prompt into the target's cache, the first token, the drafter begun; with the runner held."""
        return _advance(self.prefill_parts())

    def prefill_parts(self) -> Generator[None, None, list[int]]:
        """prefill() a forward at a time (_fill's): yields between them, returns the first tokens."""
        out = yield from _fill(self.prefill_start(), self.aux)
        return self.prefill_end(out)

    def prefill_start(self) -> Prompt:
        """The drafter prepared, the target's cache emptied: the prompt to put in (its caller runs the forwards,
        e.g. a batch's, packed with other sequences' rows), then prefill_end."""
        self.drafter.prepare()
        self.stats.costs = self.drafter.costs_source
        self.runner.reset()
        return Prompt(self.runner, self.prompt_ids)

    def prefill_end(self, out: ForwardOut) -> list[int]:
        """The prompt is in (`out`: Prompt.out()): the first token, the drafter begun."""
        stats = self.stats
        logits = out.logits
        if self.constraint is not None:
            self.constraint.plan(DraftTree.empty(), 0)
            logits = self.constraint.mask(logits)
        first = verify(DraftTree.empty(), logits, self.params, self.gen, coupling=self.coupling,
                       position=len(self.prompt_ids)).bonus
        if self.constraint is not None:
            self.constraint.consume([first])
        self.ctx = DecodeContext(list(self.prompt_ids) + [first], self.params, self.gen, len(self.prompt_ids),
                                 out.features, aux_features=out.aux, coupling=self.coupling,
                                 eos_ids=frozenset(self.eos_ids),
                                 allowed=None if self.constraint is None else self.constraint.allowed)
        self.drafter.begin(self.ctx)
        self.n = stats.new_tokens = 1
        stats.finish_reason = "stop" if first in self.eos_ids else "length"
        return [first]

    def finish(self) -> None:
        """The sequence is over: its drafter sees the whole answer (once; nothing if never prefilled)."""
        if self.ctx is not None and not self._finished:
            self._finished = True
            self.drafter.end(self.ctx.tokens[len(self.prompt_ids):])

    def resume(self) -> None:
        """Rebuild the target cache and drafter state after another request used them (engine._resume)."""
        t = _clock(self.dev)
        _resume(self.runner, self.drafter, self.ctx, len(self.prompt_ids))
        self.stats.resumes += 1
        self.stats.prefill_time += _clock(self.dev) - t

    def plan(self) -> Rows | None:
        """The drafter proposes; the rows to verify (tokens, positions, mask: Runner.forward's), or None
        when the context is full (the sequence is then done)."""
        t = _clock(self.dev)
        drafting = self.draft()
        return None if drafting is None else self.rows(alone(drafting), _clock(self.dev) - t)

    def draft(self) -> Drafting | None:
        """This step's draft, for its caller to run (alone, or with other sequences': drafters.base.propose_many),
        then rows(); None when the context is full (the sequence is then done)."""
        runner, ctx = self.runner, self.ctx
        room = runner.max_length - runner.length - 1  # rows left after the root
        if room < 0:
            self.stats.finish_reason, self.ended = "length", True
            return None
        # drafting past what we may still emit (the bonus is always free) is wasted work
        ctx.max_nodes = min(room, self.max_new_tokens - self.n - 1)
        return self.drafter.drafting(ctx) if ctx.max_nodes > 0 else _nothing()

    def rows(self, tree: DraftTree, draft_s: float) -> Rows:
        """The rows to verify `tree`, the draft(), which took draft_s seconds (in a batch: its share)."""
        runner, ctx = self.runner, self.ctx
        t = _clock(self.dev)
        if len(tree) > ctx.max_nodes:  # nodes are topologically ordered: a prefix is a tree
            tree = tree.select(torch.arange(ctx.max_nodes))
        if self.constraint is not None:
            tree = self.constraint.plan(tree, ctx.max_nodes)
        self._t = _clock(self.dev)
        draft_s += self._t - t
        self.stats.draft_time += draft_s
        ctx.draft_s = draft_s
        self._tree = tree
        start, n = runner.length, 1 + len(tree)
        tokens = torch.cat([torch.tensor([ctx.tokens[-1]]), tree.tokens.cpu()])
        positions = start + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
        side = self.drafter.side_rows(ctx)
        rows = n + (len(side) if side is not None else 0)
        # side rows past the context's end, or past the rows a runner keeps exact (tree rows would change bits)
        self._side = side is not None and len(side) > 0 and start + rows <= runner.max_length and \
            start + int(side.offsets.max()) < runner.max_length and rows <= (runner.exact_rows or rows)
        if not self._side:
            return tokens, positions, tree_mask(start, tree.ancestor_mask()) if len(tree) else None
        return (torch.cat([tokens, side.tokens.cpu()]), torch.cat([positions, start + side.offsets.cpu()]),
                side_mask(start, tree.ancestor_mask(), side.sees))

    def apply(self, out: ForwardOut) -> list[int]:
        """Verify the planned rows' forward: commit the accepted ones; the new tokens (cut at EOS and
        max_new_tokens)."""
        stats, ctx, tree = self.stats, self.ctx, self._tree
        ctx.forward_s = _clock(self.dev) - self._t
        if self._side:  # the drafter's side rows: their logits go back to it, and they are never committed
            n = 1 + len(tree)
            self.drafter.side_logits(out.logits[n:])
            out = ForwardOut(out.logits[:n], out.features[:n], None if out.aux is None else out.aux[:n])
        logits = out.logits if self.constraint is None else self.constraint.mask(out.logits)
        verdict = verify(tree, logits, self.params, self.gen, self.typical, self.coupling, len(ctx.tokens))
        keep = [0] + [i + 1 for i in verdict.path]
        self.runner.commit(keep)
        t2 = _clock(self.dev)
        stats.verify_time += t2 - self._t
        stats.record(tree, verdict.path)
        if self.on_verify is not None:
            self.on_verify(tree, verdict)
        new = verdict.tokens[: self.max_new_tokens - self.n]
        for i, tok in enumerate(new):
            if tok in self.eos_ids:
                new = new[: i + 1]
                stats.finish_reason = "stop"
                break
        self.n += len(new)
        stats.new_tokens = self.n
        if self.constraint is not None:
            self.constraint.consume(new)
            stats.mask_time, stats.pruned = self.constraint.mask_s, self.constraint.pruned
        rows = torch.tensor(keep, device=out.features.device)
        follow(self.drafter, ctx, new, out.features[rows], None if out.aux is None else out.aux[rows], verdict)
        return new


def decode(
    runner: Runner,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams,
    max_new_tokens: int,
    eos_ids: set[int],
    stats: Stats,
    on_verify: Callable[[DraftTree, Verdict], None] | None = None,
    lease: Lease | None = None,
    learn: bool = True,
    prefill_steps: bool = False,
    constraint: Constraint | None = None,
) -> Iterator[list[int]]:
    """Yields the new tokens of each step. Closing the generator early (a stop string) is fine.

    on_verify: Sequence's. lease: this request's claim on a runner and drafter that other requests share
    (slot.py); without one, the caller promises that nothing else uses them until the generator is done.
    learn: the drafter may learn from the answer for later requests (Drafter.end); the benchmark's
    warm-up and repeats of one prompt do not teach it. prefill_steps: each of the prefill's forwards but
    the last is a step of its own that yields no token (the benchmark steps methods in turn through it).
    constraint: the grammar the answer must follow (grammar.Constraint), fresh for this request."""
    seq = Sequence(runner, drafter, prompt_ids, params, max_new_tokens, eos_ids, stats, on_verify, constraint)
    dev = runner.device
    lease = lease or Slot().lease()
    t0 = _clock(dev)
    try:
        first, parts, done = None, None, 0
        while first is None:
            threads.tick()  # between forwards: the thread count follows the machine (runtime/threads.py)
            t = _clock(dev)
            with lease.hold() as lost:
                t1 = _clock(dev)
                stats.wait_time += t1 - t
                if lost or parts is None:  # the cache holds another request's rows: redo the forwards done, go on
                    parts = seq.prefill_parts()
                    for _ in range(done):
                        next(parts)
                first = _advance(parts, whole=not prefill_steps)
                done += 1
                stats.prefill_time += _clock(dev) - t1  # its own forwards: others may step in between
            if first is None:
                yield []
        yield first
        while not seq.done:
            threads.tick()
            t = _clock(dev)
            with lease.hold() as lost:
                stats.wait_time += _clock(dev) - t
                if lost:  # another request used the runner and drafter since our last step: rebuild ours
                    seq.resume()
                rows = seq.plan()
                if rows is None:
                    return
                new = seq.apply(runner.forward(*rows, aux_layers=seq.aux))
            yield new  # outside the hold: a suspended request holds no step in progress
    finally:
        lease.release()
        if learn:
            seq.finish()
        stats.total_time = _clock(dev) - t0


def _nothing() -> Drafting:
    return DraftTree.empty()
    yield  # a generator


def _advance(parts: Generator[None, None, T], whole: bool = True) -> T | None:
    """Runs the generator to its next yield (to its end if `whole`): its result when done, else None."""
    try:
        next(parts)
        while whole:
            next(parts)
    except StopIteration as done:
        return done.value
    return None


def _prefill(runner: Runner, ids: list[int], aux_layers: tuple[int, ...] = ()) -> Generator[None, None, ForwardOut]:
    """The cache reset, then `ids` in forwards of at most runner.exact_rows rows (_forwards). Why in parts:
    each row then has the bits it gets in any forward of exact rows (a resumed request's rebuild, a step's),
    and one forward of all rows costs the same (SmolLM2, 767 rows: 0.590 s whole, 0.595 s in 64-row parts)."""
    runner.reset()
    return (yield from _forwards(runner, ids, aux_layers))


def _forwards(runner: Runner, ids: list[int], aux_layers: tuple[int, ...]) -> Generator[None, None, ForwardOut]:
    """`ids` committed after the cache in forwards of at most runner.exact_rows rows (Prompt), yielding between
    them: the logits of the last row, the features of all."""
    return (yield from _fill(Prompt(runner, ids), aux_layers))


def _fill(prompt: Prompt, aux_layers: tuple[int, ...]) -> Generator[None, None, ForwardOut]:
    """The prompt's forwards run on its runner, yielding between them; Prompt.out() at the end."""
    while True:
        tokens = prompt.next()
        prompt.put(prompt.runner.forward(tokens, logits_rows=slice(-1, None), aux_layers=aux_layers))
        if prompt.complete:
            return prompt.out()
        yield


class Prompt:
    """Tokens going into a runner's cache after its rows, in forwards its caller runs: next(rows) gives a
    forward's tokens, at most `rows` and never more than runner.exact_rows (all of them on a runner without
    exact rows: a split would change their bits), and put(out) commits that forward's output, whose logits
    are its last row's. Within exact rows every split gives each row the bits it gets alone (test_prefill.py)."""

    def __init__(self, runner: Runner, ids: list[int]) -> None:
        self.runner, self.ids, self.done = runner, ids, 0
        self._outs: list[ForwardOut] = []

    @property
    def complete(self) -> bool:
        return self.done == len(self.ids)

    def next(self, rows: int = 0) -> torch.Tensor:
        exact = self.runner.exact_rows
        n = min(rows or exact, exact) if exact else len(self.ids)
        return torch.tensor(self.ids[self.done:self.done + n])

    def put(self, out: ForwardOut) -> None:
        n = out.features.shape[0]
        self.runner.commit(range(n))
        self.done += n
        self._outs.append(out)

    def out(self) -> ForwardOut:
        """The logits of the last row, the features (and aux_layers' states) of all."""
        outs = self._outs
        if len(outs) == 1:
            return outs[0]
        return ForwardOut(outs[-1].logits, torch.cat([o.features for o in outs]),
                          None if outs[0].aux is None else torch.cat([o.aux for o in outs]))


def _resume(runner: Runner, drafter: Drafter, ctx: DecodeContext, n_prompt: int) -> None:
    """Rebuild a request's target cache and drafter state from its tokens: the prompt as at the start, then
    what it emitted but the root the same way, whose rows equal the original steps' bit for bit (forwards
    of exact rows). The sampling generator lives in ctx: it continues as is."""
    done, aux = ctx.tokens[:-1], drafter.aux_layers
    outs = [_advance(_prefill(runner, done[:n_prompt], aux))]
    if len(done) > n_prompt:
        outs.append(_advance(_forwards(runner, done[n_prompt:], aux)))
    ctx.prompt_len, ctx.features = len(done), torch.cat([o.features for o in outs])
    ctx.aux_features = torch.cat([o.aux for o in outs]) if aux else None
    drafter.begin(ctx)
