"""Greedy losslessness on the real SmolLM2-135M-Instruct (the embedded default target).

The draft is the target with 10% weight noise: it agrees often but not always (tau ~2), so both
accepted paths and rejections are exercised on real weights, with no extra download. The lean
runner's rows are bit-identical however many share a forward (runner.exact_rows), so its greedy
output must equal vanilla's exactly. Only a runner without that property (HF's) may diverge, and only
where vanilla's top-2 logit gap at that position is a numerical tie (< 1e-4), which the test computes.
"""

import copy

import pytest
import torch

from specdec.api import from_models
from specdec.runtime.loading import load_model
from tests import background

pytestmark = pytest.mark.slow  # every test here runs the real embedded SmolLM2

PROMPTS = [  # six kinds of answer (a fact, an explanation, code, arithmetic, a summary, a list): each decoded
    # once by vanilla for all the methods compared with it
    "What is the capital of France? Answer in one sentence.",
    "Explain recursion to a ten-year-old.",
    "Write a Python function that reverses a string.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Name the planets of the solar system in order.",
]
N_NEW = 40
# a fact, code and a summary: for the methods checked on other targets too (the default's shipped EAGLE head
# answers all six)
SOME = PROMPTS[::2]


@pytest.fixture(scope="module")
def smol():
    background.wait("smollm2-fp32")  # converted while the tests before ran
    model, tok, _ = load_model("smollm2", device="cpu", weights="fp32")  # the HF model, for HF's own generate
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std())
    return model, tok, draft


def top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_same_or_tie(model, prompt_ids, want, got):
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    gap = top2_gap(model, prompt_ids + want[:i])
    assert gap < 1e-4, f"divergence at new token {i} with a top-2 logit gap of {gap:.3g}: not a tie, a bug"


class Vanilla:
    """A vanilla decoder and its greedy answers, each decoded once for all the tests that compare with it."""

    def __init__(self, dec):
        self.dec, self.memo = dec, {}

    def answer(self, prompt: str):
        if prompt not in self.memo:
            self.memo[prompt] = self.dec.generate([{"role": "user", "content": prompt}], max_new_tokens=N_NEW)
        return self.memo[prompt]


@pytest.fixture(scope="module")
def vanilla(smol):
    model, tok, _ = smol
    return Vanilla(from_models(model, tok))


def mean_tau_if_lossless(model, vanilla: Vanilla, spec, prompts=PROMPTS) -> float:
    """Every prompt: spec's greedy output equals vanilla's (exactly when the runner's rows are exact,
    else up to a numerical tie); mean tau."""
    taus = []
    for p in prompts:
        want = vanilla.answer(p)
        got = spec.generate([{"role": "user", "content": p}], max_new_tokens=N_NEW)
        if spec.runner.exact_rows:
            assert got.token_ids == want.token_ids
        else:
            assert_same_or_tie(model, want.prompt_ids, want.token_ids, got.token_ids)
        taus.append(got.stats.tau)
    return sum(taus) / len(taus)


@pytest.mark.parametrize("weights", ["fp32", "int8", "gguf"])
def test_a_rows_bits_follow_neither_the_rows_beside_it_nor_the_thread_count(smol, smollm2_default, weights):
    """What lets the tests here run on one thread: on the real model, at each precision, every row of a
    forward of several has the bits it has alone, on one thread and on two (runners built at each count: the
    float GEMMs' reduction blocks are probed for the count at load)."""
    from specdec.runtime.loading import Runtime, build_runner

    model, tok = (smollm2_default[:2] if weights == "gguf" else smol[:2])
    prompt = torch.tensor(tok("The quick brown fox jumps over the lazy dog because")["input_ids"])
    more = torch.tensor(tok(" it wanted to see what was on the other side of the road")["input_ids"])
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            r = build_runner(model, Runtime(weights=None if weights == "gguf" else weights))
            r.forward(prompt)
            r.commit(range(len(prompt)))
            outs.append(r.forward(more).logits)
            r.rollback()
            for i in range(len(more)):
                outs.append(r.forward(more[i:i + 1]).logits)
                r.commit([0])
    finally:
        torch.set_num_threads(before)
    n = len(more)
    assert r.exact_rows >= n
    together = [outs[0], outs[n + 1]]
    alone = [torch.cat(outs[1:n + 1]), torch.cat(outs[n + 2:])]
    assert all(torch.equal(together[0], o) for o in together[1:] + alone)


def test_vanilla_equals_hf_generate(smol, vanilla):
    model, tok, _ = smol
    for p in PROMPTS[:3]:
        g = vanilla.answer(p)
        ids = torch.tensor([g.prompt_ids])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
        assert_same_or_tie(model, g.prompt_ids, hf[0, ids.shape[1]:].tolist(), g.token_ids)


@pytest.mark.parametrize(
    "method,opts", [("sps", {"gamma": 4}), ("sps-tree", {"gamma": 4, "topk": 3, "tree_tokens": 8})]
)
def test_speculative_greedy_equals_vanilla(smol, vanilla, method, opts):
    model, tok, draft = smol
    spec = from_models(model, tok, method, draft, tok, **opts)
    assert mean_tau_if_lossless(model, vanilla, spec, SOME) > 1.5  # deep paths really were accepted


def test_stop_string_and_streaming(vanilla):
    dec = vanilla.dec
    msgs = [{"role": "user", "content": PROMPTS[-1]}]
    full = vanilla.answer(PROMPTS[-1])
    words = full.text.split()
    stop = words[3]
    cut = dec.generate(msgs, max_new_tokens=N_NEW, stop=stop)
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text) and cut.token_ids == full.token_ids[: len(cut.token_ids)]
    chunks = list(dec.stream(msgs, max_new_tokens=N_NEW))
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].final.token_ids == full.token_ids


@pytest.mark.parametrize("method", ["eagle", "eagle2", "auto"])
def test_shipped_eagle_head_greedy_equals_vanilla(smol, vanilla, method, request):
    """The head shipped in the package: found for SmolLM2 by fingerprint, lossless, and really accepting.
    auto = adaptive: the shipped acceptance table's trees and a prompt-lookup chain, sized every step, here
    under fixed costs (this machine's measured ones would move tau with the machine)."""
    from specdec.heads.shipped import find_shipped_head

    model, tok, _ = smol
    assert find_shipped_head(model) is not None
    if method == "auto":
        request.getfixturevalue("fixed_costs")
    spec = from_models(model, tok, method)
    if method == "auto":  # the default uses the head, with the lookup chain the shipped tuning chose
        assert spec.method == "eagle2" and spec.drafter.name == "eagle2+pld adaptive"
        assert spec.drafter.costs_source == "fixed (tests)"
    assert mean_tau_if_lossless(model, vanilla, spec) > 1.5  # a trained head (measured ~1.8), not a stub (~1.1)


def test_shipped_medusa_heads_greedy_equal_vanilla(smol, vanilla):
    """The Medusa-1 heads shipped for SmolLM2 (fp16, the target's LM-head rows): found by fingerprint,
    lossless, and accepting something with a 6-node sparse tree (measured tau ~1.5 on MT-bench)."""
    from specdec.heads.shipped import find_shipped_head

    model, tok, _ = smol
    assert find_shipped_head(model, "medusa").name == "smollm2-135m-instruct-medusa"
    assert find_shipped_head(model).name == "smollm2-135m-instruct-eagle"  # the EAGLE head stays the default
    spec = from_models(model, tok, "medusa", tree_size=6)
    assert spec.drafter.name == "medusa"
    assert mean_tau_if_lossless(model, vanilla, spec, SOME) > 1.2  # untrained heads accept ~nothing


# fixed trees: the tuned / cost-sized ones move with the machine, and so would tau (measured on MT-bench:
# FSPAD 1.56 at 2 nodes, Hydra++ 1.78 at 10; untrained heads accept ~nothing)
@pytest.mark.parametrize("method,kind,most_mb,opts,least_tau", [
    ("fspad", "fspad", 16, {"depth": 2, "topk": 3, "tree_size": 4}, 1.3),
    ("hydra", "hydra", 20, {"tree_size": 10}, 1.4)])
def test_shipped_fspad_and_hydra_heads_greedy_equal_vanilla(smol, vanilla, method, kind, most_mb, opts, least_tau):
    """The FSPAD head and the Hydra heads shipped for SmolLM2 (fp16, no LM-head rows of their own): found by
    fingerprint under their own kind (eagle2 and auto keep the EAGLE head), lossless, and accepting."""
    from safetensors import safe_open

    from specdec.heads.shipped import find_shipped_head

    model, tok, _ = smol
    head = find_shipped_head(model, kind)
    assert head is not None and head.name == f"smollm2-135m-instruct-{method}"
    assert find_shipped_head(model).name == "smollm2-135m-instruct-eagle"
    st = head / "model.safetensors"
    assert st.stat().st_size <= most_mb * 2**20
    with safe_open(str(st), "pt") as f:
        names = list(f.keys())
        assert not any("lm_head" in k for k in names)
        assert {str(f.get_slice(k).get_dtype()) for k in names if k not in ("d2t", "t2d")} == {"F16"}
    spec = from_models(model, tok, method, **opts)
    assert spec.drafter.name == method
    assert mean_tau_if_lossless(model, vanilla, spec, SOME) > least_tau


def test_int8_target_auto_equals_int8_vanilla_exactly(smol, fixed_costs):
    """A reduced-precision target is a different model: auto must reproduce *its* greedy text."""
    model, tok, _ = smol
    vanilla = Vanilla(from_models(model, tok, weights="int8"))
    spec = from_models(model, tok, "auto", weights="int8")
    assert vanilla.dec.weights == spec.weights == "int8" and spec.runner.exact_rows
    assert mean_tau_if_lossless(model, vanilla, spec, SOME) > 1.1  # drafts accepted (its trees sized by fixed costs)


@pytest.fixture(scope="module")
def smol_gguf(smollm2_default):
    """The embedded file as a user gets it by default: its own Q4_1/Q8_0 blocks."""
    from specdec.runtime import stream

    if stream.kernel() is None:
        pytest.skip("needs the streaming kernels (x86-64, AVX2)")
    model, tok, _ = smollm2_default
    return model, tok, Vanilla(from_models(model, tok))


@pytest.mark.parametrize("method", ["auto", "pld", "medusa"])
def test_the_gguf_file_on_its_own_blocks_decodes_exactly(smol_gguf, vanilla, method, request):
    """The default load: no float copy; auto (with the shipped head, fingerprinted on the de-quantized
    table; fixed costs) and the others reproduce that target's greedy text exactly; and its text follows
    the fp32 conversion's closely (int8 activations are the only other difference)."""
    from specdec.runtime.gguf import GGUFModel

    model, tok, gguf_vanilla = smol_gguf
    assert isinstance(model, GGUFModel) and model.weight_types == {"Q8_0": 1, "Q4_1": 210}
    assert gguf_vanilla.dec.weights == "gguf" and gguf_vanilla.dec.runner.exact_rows
    if method == "auto":
        request.getfixturevalue("fixed_costs")
    spec = from_models(model, tok, method)
    if method == "auto":
        assert spec.drafter.name == "eagle2+pld adaptive"
    # drafts really were accepted; medusa's heads (fp16 rows beside the GGUF blocks) cost most per step
    assert mean_tau_if_lossless(model, gguf_vanilla, spec, SOME if method == "medusa" else PROMPTS) > 1.1
    if method == "auto":
        a, b = gguf_vanilla.answer(PROMPTS[0]).token_ids, vanilla.answer(PROMPTS[0]).token_ids
        assert a[:8] == b[:8]  # the same model up to activation rounding: the answers start alike


def test_auto_under_the_costs_measured_here_decodes_exactly(smol_gguf):
    """What a user runs by default (the GGUF file's blocks, `auto`): the drafts follow the costs measured on
    this machine at load and online, whatever they are; the text is vanilla's all the same."""
    model, tok, gguf_vanilla = smol_gguf
    spec = from_models(model, tok, "auto")
    assert spec.drafter.costs.target(1) > 0 and spec.drafter.clock is not None
    for p in PROMPTS[:3]:
        got = spec.generate([{"role": "user", "content": p}], max_new_tokens=N_NEW)
        assert got.token_ids == gguf_vanilla.answer(p).token_ids
