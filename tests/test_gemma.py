"""Gemma 3 as a target: a tiny random model with a local layer (window 8) and a global one, on prompts and
answers longer than the window. Our runners equal HF transformers; every training-free method gives
vanilla's tokens; its GGUF file (norms stored as 1 + w, tied head) runs natively like the float model."""

import numpy as np
import pytest
import torch

from specdec.drafters import registry
from specdec.drafters.base import NoDrafter
from specdec.runtime import stream
from specdec.runtime.hf import HFRunner
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams
from tests import test_runner
from tests.helpers import (
    PROMPTS,
    assert_tree_rows_are_steps,
    gguf_runner,
    noisy_copy,
    run,
    tiny_gguf,
    tiny_model,
    word_tokenizer,
)
from tests.test_engine import hf_greedy

RUNNERS = {"lean": LeanRunner, "lean-exact": lambda m: LeanRunner(m, exact=True), "hf": HFRunner}
WINDOW = 8
LONG = [p for p in PROMPTS if len(p) > 1]  # with 24 new tokens: past the window


@pytest.fixture(scope="module")
def model():
    m = tiny_model("gemma3")
    assert m.config.sliding_window == WINDOW and set(m.config.layer_types) == {"sliding_attention", "full_attention"}
    return m


@pytest.mark.parametrize("backend", RUNNERS)
def test_vanilla_greedy_equals_hf_generate(model, backend):
    runner = RUNNERS[backend](model)
    for prompt in LONG:
        ours, _ = run(runner, NoDrafter(), prompt, SamplingParams(), 24)
        assert ours == hf_greedy(model, prompt, 24)


def test_the_window_and_the_local_rope_matter(model):
    """The tests above can fail: without its window, or with the global RoPE table on every layer, the lean
    runner's logits move away from HF's."""
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids[None]).logits[0]

    def logits(runner):
        return runner.forward(ids).logits

    torch.testing.assert_close(logits(LeanRunner(model)), want, atol=1e-4, rtol=1e-4)
    no_window = LeanRunner(model)
    no_window.windows = [None] * no_window.n_layers
    assert (logits(no_window) - want).abs().max() > 1e-2
    one_rope = LeanRunner(model)
    one_rope.rope_kinds = ["full_attention"] * one_rope.n_layers
    assert (logits(one_rope) - want).abs().max() > 1e-2


@pytest.mark.parametrize("backend", RUNNERS)
def test_final_logit_softcapping_as_hf_applies_it(backend):
    model = tiny_model("gemma3", final_logit_softcapping=3.0)
    ids = torch.arange(3, 23)
    got = RUNNERS[backend](model).forward(ids).logits
    with torch.no_grad():
        want = model(ids[None]).logits[0]
    assert want.abs().max() < 3.0 and (got.abs() - 3.0).abs().min() > 0  # capped, not clipped
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("runner_name", [*RUNNERS, "lean-unpacked"])
def test_tree_forward_equals_per_path(runner_name, monkeypatch):
    """test_runner's checks on Gemma 3 (its prompt of 11 and trees of depth 4 cross the window)."""
    monkeypatch.setitem(test_runner.RUNNERS, "lean-exact", RUNNERS["lean-exact"])
    test_runner.test_tree_forward_equals_per_path("gemma3", runner_name)
    test_runner.test_compaction_then_continue_equals_fresh("gemma3", runner_name)


def test_a_tree_row_equals_decoding_its_path_bitwise(model):
    """Exact rows: a verify row has the bits of the one-token step at its point, past the window too."""
    assert_tree_rows_are_steps(lambda: LeanRunner(model, exact=True))


HEAD_METHODS = {"eagle", "eagle2", "fspad", "eagle3", "medusa", "hydra"}  # need a trained head
TRAINING_FREE = {"vanilla": {}, "pld": {}, "ngram": {}, "lookahead": {}, "auto": {}, "sps": {"draft": True},
                 "sps-tree": {"draft": True}}


def test_the_training_free_methods_are_these():
    assert set(registry.names()) - HEAD_METHODS == set(TRAINING_FREE)  # a new method is classed here


@pytest.fixture(scope="module")
def vanilla(model):
    prompts = [PROMPTS[1], [4, 5, 6, 7, 8] * 3]  # the repeats: lookups get drafts accepted
    target = LeanRunner(model)
    return [(p, run(target, NoDrafter(), p, SamplingParams(), 32)[0]) for p in prompts]


@pytest.mark.parametrize("name", TRAINING_FREE)
def test_a_training_free_method_gives_vanillas_tokens(model, vanilla, name, tmp_path, monkeypatch):
    from specdec.api import from_models

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # auto measures its costs into the cache
    draft = noisy_copy(model, 0.1) if TRAINING_FREE[name].get("draft") else None
    dec = from_models(model, None, name, draft_model=draft)
    accepted = 0
    for p, want in vanilla:
        got, stats = run(dec.runner, dec.drafter, p, SamplingParams(), 32)
        assert got == want
        accepted += sum(stats.accept_lengths)
    assert accepted > 0 or name in ("vanilla", "auto", "lookahead")


needs_kernel = pytest.mark.skipif(stream.kernel() is None, reason="needs the streaming kernels (x86-64, AVX2)")


@pytest.fixture(scope="module", params=["Q4_K", "Q8_0"])
def tiny(request, tmp_path_factory):
    """Attention scaled by head_dim ** -0.5, as the released Gemma 3 files are: its layers take the fused
    kernels (the float `model` above, scaled otherwise, keeps the torch ops)."""
    return tiny_gguf(tmp_path_factory.mktemp("gemma") / "g.gguf", request.param, "gemma3", query_pre_attn_scalar=64)


@needs_kernel
def test_the_fused_layers_give_exact_rows_near_the_torch_ops(tiny):
    """On the fused kernels (their RMSNorm on every norm, q/k normalized before the kernels' RoPE and attention)
    a tree row has the bits of its decode step, past the window, and the logits stay within float rounding of
    the same layers on torch ops."""
    path, model = tiny
    r = gguf_runner(path, model)
    assert r.fused is not None and all(b.fused is not None for b in r.layers) and r.stack is not None
    assert_tree_rows_are_steps(lambda: gguf_runner(path, model))
    stack = r.stack  # the layers in one native call (llama.native_stack): the layer loop's bits
    for n in (1, 3, 8, 17):
        outs = []
        for native in (stack, None):
            r.stack = native
            r.reset()
            r.forward(torch.arange(40, 51))
            r.commit(range(11))
            outs.append(r.forward(torch.arange(3, 3 + n), aux_layers=(1,)))
        assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].aux, outs[1].aux), n
    r.stack = stack
    r.reset()
    ids = torch.arange(3, 30)
    got = r.forward(ids).logits
    off = gguf_runner(path, model)
    for b in off.layers:
        b.fused = None
    off.fused = None
    ref = off.forward(ids).logits
    assert ((got - ref).norm() / ref.norm()).item() < 1e-4
    # a batch's forward (forks of one runner, past the window): each sequence's rows as in its own forward
    forks = [r.fork() for _ in range(2)]
    for f, n in zip(forks, (11, 4)):
        f.forward(ids[:n])
        f.commit(range(n))
    many = r.forward_many([(f, ids[20:20 + n], None, None) for f, n in zip(forks, (1, 5))])
    for f, n, out in zip(forks, (1, 5), many):
        f.rollback()
        assert torch.equal(f.forward(ids[20:20 + n]).logits, out.logits)


@needs_kernel
def test_the_gguf_file_decodes_as_the_float_model_on_its_weights(tiny):
    """The native path reads every Gemma tensor where llama.cpp put it (norms as 1 + w, q/k rows as HF's,
    the head tied): logits within activation-quantization error of the HF-layout model on the same weights."""
    path, model = tiny
    ids = torch.arange(3, 40)
    got = gguf_runner(path, model).forward(ids).logits
    ref = LeanRunner(model).forward(ids).logits
    with torch.no_grad():
        torch.testing.assert_close(ref, model(ids[None]).logits[0], atol=1e-4, rtol=1e-4)
    assert ((got - ref).norm() / ref.norm()).item() < 0.03
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@needs_kernel
def test_speculative_greedy_on_the_gguf_file_equals_vanilla(tiny):
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.tree import TreeBudget

    path, model = tiny
    target = gguf_runner(path, model)
    # the float model on the same weights drafts: close to the target, not equal to it
    drafter = DraftModelDrafter(LeanRunner(model), target.vocab_size, 4, TreeBudget(4, 3, 10))
    want, _ = run(target, NoDrafter(), PROMPTS[3], SamplingParams(), 24)
    got, stats = run(target, drafter, PROMPTS[3], SamplingParams(), 24)
    assert got == want and np.mean(stats.accept_lengths) > 0.5


def test_a_gemma_tokenizer_without_a_chat_template_gets_gemmas():
    from specdec.runtime.gemma import chat_ready

    tok = word_tokenizer(["<start_of_turn>", "<end_of_turn>", "hi", "there"])
    tok.bos_token = "<s>"
    cfg = tiny_model("gemma3").config
    cfg.eos_token_id = 1
    chat_ready(tok, cfg)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "there"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == ("<s><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nthere<end_of_turn>\n"
                    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    assert cfg.eos_token_id == [1, tok.convert_tokens_to_ids("<end_of_turn>")]
    llama = tiny_model("llama").config
    other = word_tokenizer(["<end_of_turn>"])
    chat_ready(other, llama)  # not Gemma: left as it is
    assert other.chat_template is None
