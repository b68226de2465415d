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

pytestmark = pytest.mark.slow  # every test here runs the real embedded SmolLM2

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a ten-year-old.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, my friend' into Spanish.",
    "Write a Python function that reverses a string.",
    "Give me two tips for sleeping better.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why do cats purr?",
    "Name the planets of the solar system in order.",
]
N_NEW = 40


@pytest.fixture(scope="module")
def smol():
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


def mean_tau_if_lossless(model, vanilla, spec) -> float:
    """Every prompt: spec's greedy output equals vanilla's (exactly when the runner's rows are exact,
    else up to a numerical tie); mean tau."""
    taus = []
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        want = vanilla.generate(msgs, max_new_tokens=N_NEW)
        got = spec.generate(msgs, max_new_tokens=N_NEW)
        if spec.runner.exact_rows:
            assert got.token_ids == want.token_ids
        else:
            assert_same_or_tie(model, want.prompt_ids, want.token_ids, got.token_ids)
        taus.append(got.stats.tau)
    return sum(taus) / len(taus)


def test_vanilla_equals_hf_generate(smol):
    model, tok, _ = smol
    dec = from_models(model, tok)
    for p in PROMPTS[:3]:
        g = dec.generate([{"role": "user", "content": p}], max_new_tokens=N_NEW)
        ids = torch.tensor([g.prompt_ids])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
        assert_same_or_tie(model, g.prompt_ids, hf[0, ids.shape[1]:].tolist(), g.token_ids)


@pytest.mark.parametrize(
    "method,opts", [("sps", {"gamma": 4}), ("sps-tree", {"gamma": 4, "topk": 3, "tree_tokens": 8})]
)
def test_speculative_greedy_equals_vanilla(smol, method, opts):
    model, tok, draft = smol
    vanilla = from_models(model, tok)
    spec = from_models(model, tok, method, draft, tok, **opts)
    assert mean_tau_if_lossless(model, vanilla, spec) > 1.5  # deep paths really were accepted


def test_stop_string_and_streaming(smol):
    model, tok, _ = smol
    dec = from_models(model, tok)
    msgs = [{"role": "user", "content": PROMPTS[10]}]
    full = dec.generate(msgs, max_new_tokens=N_NEW)
    words = full.text.split()
    stop = words[3]
    cut = dec.generate(msgs, max_new_tokens=N_NEW, stop=stop)
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text) and cut.token_ids == full.token_ids[: len(cut.token_ids)]
    chunks = list(dec.stream(msgs, max_new_tokens=N_NEW))
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].final.token_ids == full.token_ids


@pytest.mark.parametrize("method", ["eagle", "eagle2", "auto"])
def test_shipped_eagle_head_greedy_equals_vanilla(smol, method):
    """The head shipped in the package: found for SmolLM2 by fingerprint, lossless, and really accepting.
    auto = adaptive: the shipped acceptance table's trees and a prompt-lookup chain, sized every step."""
    from specdec.heads.shipped import find_shipped_head

    model, tok, _ = smol
    assert find_shipped_head(model) is not None
    vanilla = from_models(model, tok)
    spec = from_models(model, tok, method)
    if method == "auto":  # the default uses the head, with the lookup chain the shipped tuning chose
        assert spec.method == "eagle2" and spec.drafter.name == "eagle2+pld adaptive"
    assert mean_tau_if_lossless(model, vanilla, spec) > 1.5  # a trained head (measured ~1.8), not a stub (~1.1)


def test_shipped_medusa_heads_greedy_equal_vanilla(smol):
    """The Medusa-1 heads shipped for SmolLM2 (fp16, the target's LM-head rows): found by fingerprint,
    lossless, and accepting something with a 6-node sparse tree (measured tau ~1.5 on MT-bench)."""
    from specdec.heads.shipped import find_shipped_head

    model, tok, _ = smol
    assert find_shipped_head(model, "medusa").name == "smollm2-135m-instruct-medusa"
    assert find_shipped_head(model).name == "smollm2-135m-instruct-eagle"  # the EAGLE head stays the default
    spec = from_models(model, tok, "medusa", tree_size=6)
    assert spec.drafter.name == "medusa"
    assert mean_tau_if_lossless(model, from_models(model, tok), spec) > 1.2  # untrained heads accept ~nothing


# fixed trees: the tuned / cost-sized ones move with the machine, and so would tau (measured on MT-bench:
# FSPAD 1.56 at 2 nodes, Hydra++ 1.78 at 10; untrained heads accept ~nothing)
@pytest.mark.parametrize("method,kind,most_mb,opts,least_tau", [
    ("fspad", "fspad", 16, {"depth": 2, "topk": 3, "tree_size": 4}, 1.3),
    ("hydra", "hydra", 20, {"tree_size": 10}, 1.4)])
def test_shipped_fspad_and_hydra_heads_greedy_equal_vanilla(smol, method, kind, most_mb, opts, least_tau):
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
    assert mean_tau_if_lossless(model, from_models(model, tok), spec) > least_tau


def test_int8_target_auto_equals_int8_vanilla_exactly(smol):
    """A reduced-precision target is a different model: auto must reproduce *its* greedy text."""
    model, tok, _ = smol
    vanilla = from_models(model, tok, weights="int8")
    spec = from_models(model, tok, "auto", weights="int8")
    assert vanilla.weights == spec.weights == "int8" and spec.runner.exact_rows
    assert mean_tau_if_lossless(model, vanilla, spec) > 1.1  # drafts accepted (its tree is sized by measured costs)


@pytest.fixture(scope="module")
def smol_gguf():
    """The embedded file as a user gets it by default: its own Q4_1/Q8_0 blocks."""
    from specdec.runtime import stream

    if stream.kernel() is None:
        pytest.skip("needs the streaming kernels (x86-64, AVX2)")
    model, tok, _ = load_model("smollm2", device="cpu")
    return model, tok


@pytest.mark.parametrize("method", ["auto", "pld", "medusa"])
def test_the_gguf_file_on_its_own_blocks_decodes_exactly(smol_gguf, smol, method):
    """The default load: no float copy; auto (with the shipped head, fingerprinted on the de-quantized
    table) and the others reproduce that target's greedy text exactly; and its text follows the fp32
    conversion's closely (int8 activations are the only other difference)."""
    from specdec.runtime.gguf import GGUFModel

    model, tok = smol_gguf
    assert isinstance(model, GGUFModel) and model.weight_types == {"Q8_0": 1, "Q4_1": 210}
    vanilla = from_models(model, tok)
    assert vanilla.weights == "gguf" and vanilla.runner.exact_rows
    spec = from_models(model, tok, method)
    if method == "auto":
        assert spec.drafter.name == "eagle2+pld adaptive"
    assert mean_tau_if_lossless(model, vanilla, spec) > 1.1  # drafts really were accepted
    if method == "auto":
        fp32 = from_models(smol[0], smol[1])
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        a = vanilla.generate(msgs, max_new_tokens=N_NEW).token_ids
        b = fp32.generate(msgs, max_new_tokens=N_NEW).token_ids
        assert a[:8] == b[:8]  # the same model up to activation rounding: the answers start alike
