"""Continuous batching (batch.py): every sequence of a batch emits what it emits decoded alone, whoever
joins or leaves meanwhile; sampled sequences follow the target's distribution."""

import socket
import threading
import time

import numpy as np
import pytest
import torch

from specdec.api import from_models
from specdec.batch import MIN_CHUNK, Batch, PromptRows
from specdec.drafters.adaptive import AdaptiveDrafter
from specdec.drafters.auto import draft_menu
from specdec.drafters.base import Drafter, NoDrafter
from specdec.drafters.clock import StepClock
from specdec.drafters.costs import Costs
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.medusa import MedusaDrafter, sparse_choices
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.union import UnionDrafter
from specdec.errors import SpecdecError
from specdec.heads.medusa import MedusaRunner
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from specdec.stats import Stats
from specdec.tree import DraftTree, TreeBudget
from tests.helpers import (
    SMALL_V,
    chi2_pvalue,
    drafter_for,
    exact_first3,
    flat_tiny,
    make_head,
    make_heads,
    noisy_copy,
    run,
    tiny_model,
    word_tokenizer,
)

# (prompt, max_new_tokens): mixed lengths, so sequences leave at different steps and others join
REQUESTS = [([1, 2, 3], 24), ([5, 17, 33, 2, 9, 41, 60, 3], 6), ([88], 31), (list(range(10, 40)), 12),
            ([4, 5, 6, 4, 5, 6, 4, 5, 6, 4], 20), ([7, 8, 7, 8, 7], 3), ([50, 51, 52, 53], 17)]
EOS = {96}


def drive(batch: Batch, requests, params, max_batch: int) -> list[list[int]]:
    """Decode every request, at most max_batch at a time: a queued request joins as soon as one leaves
    (between steps), and one more joins after the first step even when that leaves the batch full."""
    out = [[] for _ in requests]
    stats = [Stats() for _ in requests]
    owner: dict = {}
    queue = list(range(len(requests)))

    def admit(limit):
        while queue and len(batch) < limit:
            i = queue.pop(0)
            p = params[i] if isinstance(params, list) else params
            owner[batch.join(requests[i][0], p, requests[i][1], stats[i])] = i

    admit(max_batch - 1)
    while len(batch) or queue:
        for seq, new in batch.step():
            assert not isinstance(new, Exception), new
            out[owner[seq]] += new
        admit(max_batch)
    return out, stats


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=2)


def drafters(model) -> dict[str, Drafter]:
    return {"vanilla": NoDrafter(), "pld": PromptLookupDrafter(chain_len=4),
            "eagle2": drafter_for(model, make_head(model, seed=1), dynamic=True),
            "eagle+pld": UnionDrafter(drafter_for(model, make_head(model, seed=1), dynamic=False),
                                      PromptLookupDrafter(chain_len=3))}


B4, B8 = TreeBudget(2, 2, 4), TreeBudget(3, 3, 8)


def unit_costs(slope: float, menu) -> Costs:
    """t(N) = 1 + slope * (N - 1) (a unit forward): drafting pays on some steps and not on others."""
    return Costs({n: 1 + slope * (n - 1) for n in (1, 2, 3, 5, 9, 13, 17, 25, 33)},
                 {b: 0.02 * b.tree_size for b, _ in menu}, 0.01, 0.001)


def auto_drafters(model) -> dict[str, Drafter]:
    """`auto` with a tiny head (and lookup chain), without one (n-gram draft, and a draft model), Medusa."""
    menu = [(B4, 0.9), (B8, 1.3)]
    head = drafter_for(model, make_head(model, seed=1), True, depth=3, topk=3, tree_size=8)
    draft = DraftModelDrafter(LeanRunner(noisy_copy(model, 0.1), exact=True), model.config.vocab_size)
    return {"auto": AdaptiveDrafter(unit_costs(0.1, menu), head, menu, PromptLookupDrafter(chain_len=4)),
            "auto-headless": AdaptiveDrafter(unit_costs(0.05, []), ngram=NgramDrafter(8, 2)),
            "auto-headless+sps": AdaptiveDrafter(unit_costs(0.05, draft_menu()), draft, draft_menu(),
                                                 NgramDrafter(8, 2)),
            "medusa": MedusaDrafter(MedusaRunner(make_heads(model, 3), model.lm_head.weight),
                                    sparse_choices([[0.6, 0.2, 0.1]] * 3, 8))}





@pytest.mark.parametrize("method", ["auto", "auto-headless", "auto-headless+sps", "medusa"])
def test_greedy_batch_of_auto_equals_each_request_alone(model, method):
    """Each sequence's controller is its own: what it chooses follows only its own verdicts (the choices
    differ from the template's between requests only by what the template learned across them)."""
    runner = LeanRunner(model, exact=True)
    drafter = auto_drafters(model)[method]
    alone = [run(runner, drafter, p, SamplingParams(), n, EOS) for p, n in REQUESTS]
    got, stats = drive(Batch(runner, drafter, EOS), REQUESTS, SamplingParams(), max_batch=4)
    assert got == [want for want, _ in alone]
    sizes = {n for s in stats for n in s.tree_sizes}
    assert any(sum(s.accept_lengths) > len(s.accept_lengths) for s in stats)  # drafts were accepted
    if method.startswith("auto"):
        assert len(sizes) >= 3  # drafts of several sizes (or none), chosen per sequence


def test_forks_of_auto_never_teach_the_clock(model):
    """In a batch a sequence's verify time is the packed forward's: the forks price by the template's
    costs and observe nothing, so the template's clock stays as it was."""
    menu = [(B4, 0.9), (B8, 1.3)]
    clock = StepClock()
    head = drafter_for(model, make_head(model, seed=1), True, depth=3, topk=3, tree_size=8)
    drafter = AdaptiveDrafter(unit_costs(0.1, menu), head, menu, PromptLookupDrafter(chain_len=4), clock=clock)
    fork = drafter.fork()
    assert fork.clock is None and fork.costs is drafter.costs and fork.model.runner is not drafter.model.runner
    drive(Batch(LeanRunner(model, exact=True), drafter, EOS), REQUESTS, SamplingParams(), max_batch=4)
    assert clock.steps == 0 and not clock.log and not drafter.choices


def test_a_batch_tells_each_drafter_how_many_sequences_share_the_forward(model):
    """ctx.sharing is the batch's size at each step (what `auto` prices its rows by), and one alone."""
    seen: list[int] = []

    class Counting(NoDrafter):
        def fork(self):
            return Counting()

        def propose(self, ctx):
            seen.append(ctx.sharing)
            return super().propose(ctx)

    runner = LeanRunner(model, exact=True)
    drive(Batch(runner, Counting(), EOS), REQUESTS[:3], SamplingParams(), max_batch=3)
    assert max(seen) == 3 and set(seen) <= {1, 2, 3} and seen[-1] == 1
    seen.clear()
    run(runner, Counting(), REQUESTS[0][0], SamplingParams(), 4, EOS)
    assert seen and set(seen) == {1}


@pytest.mark.parametrize("method", ["vanilla", "pld", "eagle2", "eagle+pld"])
def test_greedy_batch_equals_each_request_alone(model, method):
    runner = LeanRunner(model, exact=True)
    assert runner.exact_rows > 0  # packed forwards (else each sequence runs alone)
    drafter = drafters(model)[method]
    alone = [run(runner, drafter, p, SamplingParams(), n, EOS) for p, n in REQUESTS]
    got, stats = drive(Batch(runner, drafter, EOS), REQUESTS, SamplingParams(), max_batch=4)
    for (want, want_stats), g, s in zip(alone, got, stats):
        assert g == want
        assert s.accept_lengths == want_stats.accept_lengths and s.tree_sizes == want_stats.tree_sizes
    if method != "vanilla":
        assert any(sum(s.accept_lengths) > len(s.accept_lengths) for s in stats)  # drafts were accepted


def test_packed_forward_splits_past_the_exact_rows(model):
    """More rows than exact_rows in one step: forwards of at most exact_rows rows, the same tokens."""
    runner = LeanRunner(model, exact=True)
    runner.exact_rows = 6  # a budget the 4-row chains of 4 sequences overflow
    drafter = PromptLookupDrafter(chain_len=4)
    reqs = REQUESTS[:5]
    alone = [run(runner, drafter, p, SamplingParams(), n, EOS)[0] for p, n in reqs]
    got, _ = drive(Batch(runner, drafter, EOS), reqs, SamplingParams(), max_batch=4)
    assert got == alone


LONG = [(7 * i + 3) % 90 for i in range(300)]  # a prompt of many chunks


def test_running_streams_keep_decoding_while_a_long_prompt_joins(model):
    """Three streams decode; a 300-token prompt joins: it goes in a chunk per step, every step also gives
    each running stream its tokens, and every answer (the newcomer's too) is its answer alone."""
    runner = LeanRunner(model, exact=True)
    drafter = NoDrafter()  # a token a step: the streams outlive the newcomer's prefill
    short = [([1, 2, 3], 40), ([5, 17, 33, 2, 9], 40), ([4, 5, 6, 4, 5, 6], 40)]
    alone = [run(runner, drafter, p, SamplingParams(), n)[0] for p, n in short + [(LONG, 20)]]
    batch = Batch(runner, drafter, set(), prefill_chunk=16, stall=0)  # chunks of the step's rows, as timed or not
    out: dict = {}
    for p, n in short:
        out[batch.join(p, SamplingParams(), n)] = []
    while batch.joining:  # the three prompts go in
        for seq, new in batch.step():
            out[seq] += new
    newcomer = batch.join(LONG, SamplingParams(), 20)
    out[newcomer], steps = [], 0
    while not out[newcomer]:
        got = dict(batch.step())
        steps += 1
        assert all(got.get(seq) for seq in out if seq is not newcomer)  # every running stream got tokens
        for seq, new in got.items():
            out[seq] += new
    assert steps >= len(LONG) / 16  # a chunk a step, at most a step's rows
    while len(batch):
        for seq, new in batch.step():
            out[seq] += new
    assert list(out.values()) == alone


def test_prompt_rows_keep_a_chunk_step_within_the_stall_budget():
    """Scripted step times: a plain step 10 ms (its forward 8), each prompt row adds 2 ms to the forward.
    The chunk settles where the step takes 2.5 plain steps; nobody decoding: the whole room; no budget
    (stall 0): the room as before; a prompt row dearer than the budget: MIN_CHUNK still goes in."""
    rows = PromptRows(64, 2.5)
    assert rows.rows(decoding=4, running=False) == 60  # nobody waits for this step
    assert rows.rows(decoding=60, running=False) == 16  # a quarter at least, as before
    first = rows.rows(decoding=4, running=True)
    assert first == 16  # nothing measured yet: a small chunk that prices a row
    for _ in range(3):
        rows.observe(0.010, 0.008, 0, running=True)
    n = first
    for _ in range(20):
        rows.observe(0.010 + 0.002 * n, 0.008 + 0.002 * n, n, running=True)
        n = rows.rows(decoding=4, running=True)
    assert n == 7 and 0.010 + 0.002 * n <= 2.5 * 0.010  # (2.5 - 1) * 10 ms / 2 ms
    assert PromptRows(64, 0).rows(decoding=4, running=True) == 60
    dear = PromptRows(64, 2.5)
    dear.observe(0.010, 0.008, 0, running=True)
    dear.observe(1.0, 1.0, 16, running=True)
    assert dear.rows(decoding=4, running=True) == MIN_CHUNK
    alone = PromptRows(64, 2.5)  # the prompt alone prices its rows too: the first step beside others is sized
    alone.observe(0.128, 0.128, 64, running=False)
    alone.observe(0.010, 0.008, 0, running=True)
    assert alone.rows(decoding=4, running=True) == 7
    with pytest.raises(SpecdecError, match="stall"):
        Batch(LeanRunner(tiny_model("llama"), exact=True), NoDrafter(), set(), stall=0.5)


def test_prompts_in_chunks_join_and_leave_mid_decode_each_as_alone(model):
    """Long and short prompts joining as others leave, chunks sized by what the decoding rows leave of a
    small budget (odd splits of every prompt): each answer is its answer alone, drafts and all."""
    runner = LeanRunner(model, exact=True)
    drafter = PromptLookupDrafter(chain_len=4)
    reqs = REQUESTS[:3] + [(LONG[:150], 9)] + REQUESTS[3:5] + [(LONG[100:], 14)] + REQUESTS[5:]
    alone = [run(runner, drafter, p, SamplingParams(), n, EOS) for p, n in reqs]
    got, stats = drive(Batch(runner, drafter, EOS, prefill_chunk=11), reqs, SamplingParams(), max_batch=4)
    for (want, want_stats), g, s in zip(alone, got, stats):
        assert g == want
        assert s.accept_lengths == want_stats.accept_lengths
    assert any(sum(s.accept_lengths) > len(s.accept_lengths) for s in stats)  # drafts were accepted


def test_a_runner_without_exact_rows_takes_a_prompt_whole(model):
    """Without exact rows a split would change the prompt's bits: it goes in whole, in one step, as alone."""
    runner = LeanRunner(model, exact=True)
    runner.exact_rows = 0
    batch = Batch(runner, NoDrafter(), set(), prefill_chunk=8)
    first = batch.join(REQUESTS[0][0], SamplingParams(), 30)
    while batch.joining:
        batch.step()
    seq = batch.join(LONG[:100], SamplingParams(), 5)
    got = dict(batch.step())
    assert got[first] and got[seq]  # the whole prompt in the one step, beside the running stream
    out = got[seq]
    while seq in batch.active:
        out += dict(batch.step()).get(seq, [])
    assert out == run(runner, NoDrafter(), LONG[:100], SamplingParams(), 5)[0]


def test_a_client_that_leaves_while_its_prompt_goes_in_frees_its_forks(model):
    runner = LeanRunner(model, exact=True)
    batch = Batch(runner, NoDrafter(), set(), prefill_chunk=16)
    seq = batch.join(LONG, SamplingParams(), 5)
    batch.step()
    assert seq in [j.seq for j in batch.joining] and 0 < seq.runner.length < len(LONG)
    batch.leave(seq)
    assert len(batch) == 0 and batch.step() == []
    again = batch.join(LONG[:20], SamplingParams(), 4)
    assert again.runner is seq.runner  # its fork, its cache emptied for the next prompt
    out = []
    while len(batch):
        out += dict(batch.step()).get(again, [])
    assert out == run(runner, NoDrafter(), LONG[:20], SamplingParams(), 4)[0]


def test_a_failing_sequence_leaves_alone(model):
    class Breaks(NoDrafter):
        def fork(self):
            return Breaks()

        def propose(self, ctx):
            if ctx.prompt_len == 1 and len(ctx.tokens) > 3:
                raise RuntimeError("drafter broke")
            return DraftTree.empty()

    runner = LeanRunner(model, exact=True)
    batch = Batch(runner, Breaks(), EOS)
    a = batch.join([88], SamplingParams(), 10)
    b = batch.join([1, 2, 3], SamplingParams(), 10)
    out, errors = [], []
    while len(batch):
        for seq, new in batch.step():
            if isinstance(new, Exception):
                assert seq is a
                errors.append(str(new))
            elif seq is b:
                out += new
    assert errors == ["drafter broke"]
    assert out == run(runner, NoDrafter(), [1, 2, 3], SamplingParams(), 10, EOS)[0]


def test_a_drafter_that_cannot_fork_is_refused_in_one_line(model):
    class Solo(NoDrafter):
        name = "solo"

        def fork(self):
            return None

    with pytest.raises(SpecdecError, match="drafter 'solo' cannot decode several sequences at once"):
        Batch(LeanRunner(model), Solo(), EOS)


@pytest.mark.slow
def test_sampled_batch_follows_the_target_distribution():
    """Sequences of two sampling settings (and a greedy one) in one batch, drafted by an EAGLE-2 head with
    sampled children: each setting's first 3 tokens follow the target's exact joint."""
    model = flat_tiny()
    runner = LeanRunner(model, exact=True)
    drafter = drafter_for(model, make_head(model, seed=3), dynamic=True, depth=3, topk=2, tree_size=4,
                          children="sample")
    settings = [SamplingParams(1.0), SamplingParams(0.7, top_p=0.8)]
    prompts = [[1, 3, 0, 2, 1], [2, 2, 4, 0]]
    n = 300
    reqs, params = [], []
    for i in range(n):
        for k in range(2):
            reqs.append((prompts[k], 6 if i % 2 else 4))  # lengths differ: sequences join mid-decode
            params.append(settings[k])
    reqs.append(([1, 2, 3], 8))
    params.append(SamplingParams())
    torch.manual_seed(0)
    got, _ = drive(Batch(runner, drafter, set()), reqs, params, max_batch=4)
    for k in range(2):
        counts = np.zeros(SMALL_V ** 3)
        for t in got[k:2 * n:2]:
            counts[t[0] * SMALL_V ** 2 + t[1] * SMALL_V + t[2]] += 1
        assert chi2_pvalue(counts, exact_first3(model, prompts[k], settings[k])) > 1e-3


# ---- behind `specdec serve --max-batch 4` ----

@pytest.fixture(scope="module")
def served():
    from tests.test_serve import MODEL, WORDS, Server

    tok = word_tokenizer(WORDS)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    dec = from_models(tiny_model("llama"), tok, "pld")
    server = Server(dec, max_batch=4)
    engine = server.app.state.engine
    sizes, step = [], engine.batch.step

    def slow_step():  # steps slow enough that requests overlap, and a record of each step's batch size
        sizes.append(len(engine.batch))
        time.sleep(0.01)
        return step()

    engine.batch.step = slow_step
    yield dec, server, MODEL, sizes
    server.stop()


def test_server_batches_concurrent_requests_each_as_alone(served):
    import openai

    from specdec.serve.engine import BatchEngine

    dec, server, model, sizes = served
    assert isinstance(server.app.state.engine, BatchEngine)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    prompts = ["w3 w7 w1 w9 w3 w7 w2", "w5", "w1 w2 w3 w1 w2 w3 w1 w2", "w40 w41 w42", "w9 w8 w7 w6 w5", "w11 w12"]
    kws = [dict(max_tokens=30, temperature=0), dict(max_tokens=5, temperature=0),
           dict(max_tokens=24, temperature=0.9, top_p=0.9, seed=3), dict(max_tokens=17, temperature=0),
           dict(max_tokens=40, temperature=0.7, seed=11), dict(max_tokens=9, temperature=0)]
    full = dec.generate(prompts[3], max_new_tokens=17).text
    kws[3]["stop"] = full.split()[2]  # a stop string ends one answer early
    want = [dec.generate(p, max_new_tokens=k["max_tokens"], temperature=k["temperature"], top_p=k.get("top_p", 1.0),
                         seed=k.get("seed"), stop=k.get("stop")) for p, k in zip(prompts, kws)]
    got = [None] * len(prompts)

    def ask(i):
        if i % 2:  # streamed and whole responses mixed
            parts = [c.choices[0].text for c in client.completions.create(model=model, prompt=prompts[i],
                                                                          stream=True, **kws[i]) if c.choices]
            got[i] = "".join(parts)
        else:
            got[i] = client.completions.create(model=model, prompt=prompts[i], **kws[i]).choices[0].text

    steps0, rows0 = server.metric("batch_steps_total"), server.metric("batch_sequences_total")
    sizes.clear()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == [w.text for w in want]
    assert max(sizes) == 4  # four at a time, the others queued until a slot freed
    # the step that retires the last sequence may end just after its answer went out: the gauges within 10 s
    deadline, idle = time.monotonic() + 10, lambda: (server.metric("batch_size"), server.metric("num_requests_running"))
    while idle() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle() == (0, 0)
    # the step counters: every step and the sequences it carried, so their ratio is the mean batch size
    assert server.metric("batch_steps_total") - steps0 == len(sizes)
    assert server.metric("batch_sequences_total") - rows0 == sum(sizes)


def test_a_client_that_leaves_frees_its_slot(served):
    from tests.test_serve import stream_request

    dec, server, model, _ = served
    before = server.metric("generation_tokens_total")
    c, r = stream_request(server, "/v1/completions", {"model": model, "prompt": "w3 w7 w1 w9", "max_tokens": 400,
                                                      "temperature": 0})
    r.readline()
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    deadline = time.time() + 10
    while server.metric("num_requests_running") and time.time() < deadline:
        time.sleep(0.02)
    assert server.metric("num_requests_running") == 0
    assert server.metric('requests_total{outcome="cancelled"}') >= 1
    assert server.metric("generation_tokens_total") - before < 400


def test_a_method_that_cannot_batch_is_served_one_at_a_time(served, capsys):
    import dataclasses

    from specdec.serve.engine import SerialEngine, make_engine

    class Solo(NoDrafter):
        name = "solo"

        def fork(self):
            return None

    dec = dataclasses.replace(served[0], drafter=Solo())
    engine = make_engine(dec, max_batch=4)
    try:
        assert isinstance(engine, SerialEngine)
        assert "drafter 'solo' cannot decode several sequences at once yet: requests decode one at a time" \
            in capsys.readouterr().err
    finally:
        engine.close()
