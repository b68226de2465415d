"""The one interface every drafting method implements, and how a drafter follows a text (engine, costs, tune)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdec.sampling import Coupling, SamplingParams
from specdec.tree import Allowed, DraftTree, TreeBudget
from specdec.verify import Typical, Verdict

if TYPE_CHECKING:  # the runners import this module's types
    from specdec.runtime.base import ForwardOut, Runner


@dataclass
class DecodeContext:
    """What a drafter may read. `tokens` is prompt + everything emitted; its last token is the root
    of the next draft (emitted, but not yet in the target's KV cache)."""

    tokens: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    prompt_len: int  # tokens prefilled at begin() (after a resume: the prompt and all emitted but the root)
    features: torch.Tensor | None = None  # target features of the rows committed by the last forward
    aux_features: torch.Tensor | None = None  # [rows, k * H] of the same rows when the drafter has aux_layers
    max_nodes: int = field(default=1 << 30)  # room left in the target's context for this draft
    # seconds the last step's target forward took (at accept()); not its verification, whose cost at T > 0
    # grows with the tokens emitted (their noise), not with the rows verified
    forward_s: float = 0.0
    draft_s: float = 0.0  # seconds the last step's propose() took (at accept())
    # a seeded sampled request's draws (sampling.Coupling): the token at index i of `tokens` will be the
    # target's draw with coupling.gumbel(i); a drafter ranks by log q + that noise to match it
    coupling: Coupling | None = None
    eos_ids: frozenset[int] = frozenset()  # tokens that end the request: no draft token after one is emitted
    sharing: int = 1  # sequences whose rows share this step's verify forward (a batch's), this one included
    # the answer's grammar (structured output), or None: a drafter proposes under it (tree.Allowed); the
    # verify still masks every row, so a drafter that ignores it stays exact
    allowed: Allowed | None = None


@dataclass
class SideRows:
    """Rows a drafter adds to the verify forward after the tree's, for its own use (lookahead's Jacobi
    window). They see the committed cache, the root and the side rows `sees` names; the tree never sees
    them, so the verified rows are what they would be without them; the verifier never reads them, and
    the cache keeps none of them. Their logits go back to the drafter (Drafter.side_logits)."""

    tokens: torch.Tensor  # [M] long
    offsets: torch.Tensor  # [M] long: position minus the root's (>= 1)
    sees: torch.Tensor  # [M, M] bool: row i sees side row j (each row sees itself)

    def __len__(self) -> int:
        return self.tokens.numel()


class DraftForward(ABC):
    """One model forward a draft asks for (Drafter.drafting). Forwards whose `pack` keys are equal (forks
    of one model, the same kind of call) run as one packed forward in a batch (run_many), each getting
    exactly the output it gets run alone."""

    pack: Hashable

    @staticmethod
    @abstractmethod
    def run_many(forwards: list[DraftForward]) -> list[Any]:
        """The forwards' outputs, in order; one forward: run alone."""


# a proposal as a generator: it yields the model forwards it needs, is sent each one's output, returns the tree
Drafting = Generator[DraftForward, Any, "DraftTree"]


class Drafter(ABC):
    name: str = "drafter"
    draft_depth: int | None = None  # the deepest draft it proposes (for analysis; None: none or varies)
    # target layers whose input hidden states it reads (ctx.aux_features, e.g. EAGLE-3's low, middle and
    # high layers); () = none, and the target computes nothing extra
    aux_layers: tuple[int, ...] = ()
    # the tree a caller may size per call (TreeDrafter.propose's budget); None: its draft takes no budget
    budget: TreeBudget | None = None
    # the acceptance rule the verifier applies to its drafts: None = lossless; a Typical rule is LOSSY at T > 0
    acceptance: Typical | None = None

    @property
    def lead(self) -> Drafter:
        """The drafter doing the main drafting, for reports (what `auto` resolved to): a composite's
        model-based part, else itself."""
        return self

    @property
    def costs_source(self) -> str:
        """How the step costs it drafts by were obtained, for the stats ("": it uses none)."""
        return ""

    def fork(self) -> Drafter | None:
        """A drafter like this one with state of its own, sharing the heavy parts (weights): another
        sequence of a batch. Forks draft one at a time (they may share per-call scratch space). None: it
        cannot fork (its requests then decode one at a time)."""
        return None

    def prepare(self) -> None:
        """Before a request's prefill, with the target held: a drafter may use the target runner here
        (its cache is rebuilt right after), e.g. to update its costs."""

    def begin(self, ctx: DecodeContext) -> None:
        """A new generation, or a resumed one (another request used the drafter meanwhile): drop all
        state and start from ctx, whose features hold the target's features of the prefilled tokens."""

    @abstractmethod
    def propose(self, ctx: DecodeContext) -> DraftTree: ...

    def drafting(self, ctx: DecodeContext) -> Drafting:
        """propose() as a generator yielding each model forward it runs (a DraftForward) and sent its output,
        so that a batch packs the forwards of every sequence's draft at one depth into one (propose_many).
        A drafter that runs a model implements this and proposes through alone(); the default runs no
        forward of its own (n-gram lookups: nothing to pack)."""
        return self.propose(ctx)
        yield  # a generator

    def side_rows(self, ctx: DecodeContext) -> SideRows | None:
        """After propose: rows to ride in the same target forward as the draft (None: none)."""
        return None

    def side_logits(self, logits: torch.Tensor) -> None:
        """After that forward, before accept: the side rows' logits [M, V]. Not called when they did not
        fit (the context's end, or more rows than the runner keeps exact)."""

    def accept(self, ctx: DecodeContext, verdict: Verdict) -> None:
        """After verification: ctx.tokens already holds the new tokens, ctx.features the target
        features of the root and the accepted nodes."""

    def end(self, answer: list[int]) -> None:
        """The generation is over (done, stopped, or its client left); answer: every token it generated.
        A drafter may learn from it for later requests (it and its forks)."""


class TreeDrafter(Drafter):
    """A drafter whose tree a caller may size per call: adaptive `auto` picks a budget every step, cost
    measurement and `specdec tune` price many."""

    # drafts from the target's features (an EAGLE-style head), read lazily: a draft after plain steps first
    # reads their rows, which a caller pricing its drafts must price too (Costs.catch_row_s)
    reads_features: bool = False

    @abstractmethod
    def drafting(self, ctx: DecodeContext, budget: TreeBudget | None = None) -> Drafting:
        """budget: this call's tree instead of the drafter's own."""

    def propose(self, ctx: DecodeContext, budget: TreeBudget | None = None) -> DraftTree:
        return alone(self.drafting(ctx, budget))


def alone(drafting: Drafting) -> DraftTree:
    """A draft run by itself: each forward it asks for runs alone."""
    try:
        fwd = next(drafting)
        while True:
            fwd = drafting.send(fwd.run_many([fwd])[0])
    except StopIteration as done:
        return done.value


def propose_many(draftings: list[Drafting]) -> tuple[list[DraftTree | Exception], int]:
    """Several sequences' drafts stepped together: each round, the forwards they ask for run packed, one
    forward per pack key (DraftForward.run_many), so every draft is exactly what it is alone. Returns each
    draft's tree, or the exception it raised (the others go on), and the packed forwards run."""
    results: list[DraftTree | Exception | None] = [None] * len(draftings)
    asked: dict[int, DraftForward] = {}

    def advance(i: int, out: Any = None, first: bool = False) -> None:
        try:
            asked[i] = next(draftings[i]) if first else draftings[i].send(out)
        except StopIteration as done:
            results[i] = done.value
        except Exception as e:  # this sequence fails, the others go on
            results[i] = e

    for i in range(len(draftings)):
        advance(i, first=True)
    forwards = 0
    while asked:
        groups: dict[Hashable, list[int]] = {}
        for i, fwd in asked.items():
            groups.setdefault(fwd.pack, []).append(i)
        now, asked = asked, {}
        for ids in groups.values():
            fwds = [now[i] for i in ids]
            try:
                outs = type(fwds[0]).run_many(fwds)
            except Exception as e:
                for i in ids:
                    draftings[i].close()
                    results[i] = e
                continue
            forwards += 1
            for i, out in zip(ids, outs):
                advance(i, out)
    return results, forwards


class NoDrafter(Drafter):
    """Vanilla decoding: an empty tree, so every forward verifies nothing and samples one token."""

    name = "vanilla"

    def fork(self) -> NoDrafter:
        return NoDrafter()

    def propose(self, ctx: DecodeContext) -> DraftTree:
        return DraftTree.empty()


def follow(drafter: Drafter, ctx: DecodeContext, new: list[int], features: torch.Tensor,
           aux: torch.Tensor | None, verdict: Verdict) -> None:
    """After a verification: ctx gains the emitted tokens and the target features of the rows kept (the
    root and the accepted nodes), and the drafter follows, unless the sequence ended inside the verdict.
    Whatever drives a drafter outside decode (cost measurement, `specdec tune`) steps it through here."""
    ctx.tokens.extend(new)
    ctx.features, ctx.aux_features = features, aux
    if len(new) == len(verdict.tokens):  # the drafter only needs to follow a live sequence
        drafter.accept(ctx, verdict)


def begin_on(runner: Runner, drafter: Drafter, ids: list[int], prompt_len: int) -> tuple[DecodeContext, ForwardOut]:
    """A drafter begun on ids[:prompt_len] with the target's features of all of `ids` at hand (one forward,
    not kept in the runner's cache): how cost measurement and `specdec tune` replay a known text."""
    runner.reset()
    out = runner.forward(torch.tensor(ids), logits_rows=slice(-1, None), aux_layers=drafter.aux_layers)
    runner.reset()
    ctx = DecodeContext(list(ids[:prompt_len + 1]), SamplingParams(), None, prompt_len, out.features[:prompt_len],
                        aux_features=None if out.aux is None else out.aux[:prompt_len])
    drafter.begin(ctx)
    return ctx, out
