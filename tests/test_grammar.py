"""Structured output: constrained answers fit their grammar, every method gives vanilla's tokens under the
constraint, sampling follows the target's distribution renormalised over the allowed tokens (chains and
trees, top-k/top-p), and a draft token the grammar forbids is never verified."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdec.api import GenerationParams
from specdec.drafters.base import NoDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.engine import decode
from specdec.errors import SpecdecError
from specdec.grammar import Vocabulary, compile_grammar
from specdec.runtime.lean import LeanRunner
from specdec.sampling import SamplingParams, probs_from_logits
from specdec.stats import Stats
from specdec.tree import DraftTree, TreeBudget
from tests.helpers import SMALL_V, chi2_pvalue, first_tokens, flat_tiny, noisy_copy

LETTERS = "abc"  # ids 2, 3, 4 (0 <unk>, 1 </s>)
A, B, C, EOS = 2, 3, 4, 1
REGEX = "(a|c)(b|c)[abc]*"  # first a or c, then b or c, then anything (or the end)


def letters_tokenizer():
    vocab = {t: i for i, t in enumerate(["<unk>", "</s>", *LETTERS])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary(letters_tokenizer(), SMALL_V, {EOS})


def constrained_run(runner, drafter, prompt, params, n, vocab, regex=REGEX, on_verify=None, greedy=None, first=None):
    """first: only the steps until that many tokens are out (first_tokens)."""
    stats = Stats()
    c = vocab.constraint(compile_grammar("regex", regex), params.greedy if greedy is None else greedy)
    steps = decode(runner, drafter, prompt, params, n, {EOS}, stats, on_verify=on_verify, constraint=c)
    out = [t for step in steps for t in step] if first is None else first_tokens(steps, first)
    return out, stats


def allowed_after(prefix: list[int]) -> list[int]:
    """REGEX's allowed next tokens, by hand."""
    if not prefix:
        return [A, C]
    if len(prefix) == 1:
        return [B, C]
    return [A, B, C, EOS]


def exact_masked_first3(model, prompt, params):
    """The joint of the first 3 tokens under vanilla sampling renormalised over REGEX's allowed tokens."""
    def probs(ids, prefix):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed_after(prefix)] = 0
        return probs_from_logits(logits + mask, params)

    out = np.zeros(SMALL_V ** 3)
    p1 = probs(prompt, [])
    for a in range(SMALL_V):
        if p1[a] == 0 or a == EOS:
            continue
        p2 = probs(prompt + [a], [a])
        for b in range(SMALL_V):
            if p2[b] == 0:
                continue
            p3 = probs(prompt + [a, b], [a, b])
            out[a * SMALL_V ** 2 + b * SMALL_V: a * SMALL_V ** 2 + b * SMALL_V + SMALL_V] = (p1[a] * p2[b] * p3).numpy()
    return out


# ---- the parameters: one clear error, before any model ----

@pytest.mark.parametrize("kw, names", [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": '{"type": "objec"}'}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
    ({"regex": "[a-"}, "regex"),
    ({"grammar": "start: (("}, "grammar"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"regex": "a+", "json_object": True}, "json_object, regex"),
])
def test_a_bad_constraint_is_one_error_naming_it(kw, names):
    with pytest.raises(SpecdecError) as e:
        GenerationParams(**kw)
    msg = str(e.value)
    assert "\n" not in msg and names in msg


def test_good_constraints_compile():
    for kw in ({"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}, {"json_object": True},
               {"regex": "[0-9]+"}, {"grammar": 'start: "yes" | "no"'}, {"grammar": 'root ::= "yes" | "no"'}):
        assert GenerationParams(**kw).constrained
    assert GenerationParams().constrained is None


# ---- the draft cut to the grammar ----

def test_forbidden_nodes_are_pruned_with_their_subtrees(vocab):
    c = vocab.constraint(compile_grammar("regex", REGEX))
    # root: a (ok) -> b (ok) -> a (ok); root: b (forbidden) -> c; root: c (ok) -> a (forbidden after one token)
    tree = DraftTree(torch.tensor([A, B, A, B, C, C, A]), torch.tensor([-1, 0, 1, -1, 3, -1, 5]))
    got = c.plan(tree, 16)
    assert got.tokens.tolist() == [A, B, A, C]
    assert got.parents.tolist() == [-1, 0, 1, -1]
    rows = [int(r) for r in c._masks[:, 0]]  # the mask of the root and of each kept node's row
    assert rows == [sum(1 << t for t in allowed_after(p)) for p in ([], [A], [A, B], [A, B, A], [C])]


def test_a_sampled_forbidden_node_stays_without_its_subtree(vocab):
    c = vocab.constraint(compile_grammar("regex", REGEX))
    q = torch.full((4, SMALL_V), 0.2)
    tree = DraftTree(torch.tensor([B, C, A, A]), torch.tensor([-1, 0, -1, 2]), draft_probs=q)
    got = c.plan(tree, 16)
    # b is forbidden at the root: kept (its rejection moves the residual of its sibling a), its child dropped
    assert got.tokens.tolist() == [B, A, A] and got.parents.tolist() == [-1, -1, 1]
    assert torch.equal(got.draft_probs, q[[0, 2, 3]])


def test_greedy_pruning_and_masks_follow_the_grammar(vocab):
    c = vocab.constraint(compile_grammar("regex", REGEX), greedy=True)
    tree = DraftTree(torch.tensor([A, B, A, B, C, C, A]), torch.tensor([-1, 0, 1, -1, 3, -1, 5]))
    got = c.plan(tree, 16)
    assert got.tokens.tolist() == [A, B, A, C] and got.parents.tolist() == [-1, 0, 1, -1]
    logits = torch.randn(5, SMALL_V, generator=torch.Generator().manual_seed(0))
    # the argmax: forbidden after the root and after [A]; allowed after [A, B], [A, B, A] and [C]
    for row, best in ((0, B), (1, A), (2, C), (3, EOS), (4, C)):
        logits[row, best] = 9.0
    masked = c.mask(logits)
    paths = ([], [A], [A, B], [A, B, A], [C])
    for r, path in enumerate(paths):
        if r in (0, 1):  # the argmax is forbidden: the row is masked by its own state
            assert masked[r].isfinite().tolist() == [t in allowed_after(path) for t in range(SMALL_V)]
        else:  # the argmax is allowed: the row is left as it is (its argmax is the masked one)
            assert torch.equal(masked[r], logits[r])
        assert int(masked[r].argmax()) == max(allowed_after(path), key=lambda t: logits[r, t])


def test_the_end_is_allowed_once_the_grammar_is_complete(vocab):
    # a complete grammar's matcher stops and validates nothing more, yet the end token is what it allows
    for greedy in (True, False):
        c = vocab.constraint(compile_grammar("regex", "ab"), greedy)
        assert c.allowed([A], [EOS, A], 2) == [] and c.allowed([A, B], [A, EOS, C], 2) == [1]
        c.consume([A, B])
        assert c.allowed([], [C, EOS], 2) == [1]
        assert c.plan(DraftTree.chain(torch.tensor([EOS])), 4).tokens.tolist() == [EOS] and c.pruned == 0
        logits = torch.zeros(2, SMALL_V)
        logits[:, EOS] = 1.0
        assert c.mask(logits)[0].isfinite().sum() == (SMALL_V if greedy else 1)


def test_forced_tokens_join_the_draft(vocab):
    c = vocab.constraint(compile_grammar("regex", "abc(a|b)"))
    got = c.plan(DraftTree.empty(), 8)
    assert got.tokens.tolist() == [A, B, C] and got.parents.tolist() == [-1, 0, 1]
    c.consume([A, B, C])
    assert c.plan(DraftTree.empty(), 8).tokens.tolist() == []  # a or b: nothing forced


# ---- lossless under the constraint ----

def drafters(model):
    draft = LeanRunner(noisy_copy(model, 0.5))
    return {"chain": DraftModelDrafter(draft, SMALL_V, 3),
            "tree": DraftModelDrafter(LeanRunner(noisy_copy(model, 0.5)), SMALL_V, 3, TreeBudget(3, 2, 5)),
            "lookup": PromptLookupDrafter(chain_len=3)}


@pytest.mark.parametrize("shape", ["chain", "tree", "lookup"])
def test_greedy_under_a_grammar_equals_vanilla_under_it(vocab, shape):
    model = flat_tiny()
    target = LeanRunner(model)
    for prompt in ([1, 3, 0, 2], [2, 4, 3, 2, 4, 3, 2], [4]):
        want, _ = constrained_run(target, NoDrafter(), prompt, SamplingParams(), 12, vocab)
        got, st = constrained_run(target, drafters(model)[shape], prompt, SamplingParams(), 12, vocab)
        assert got == want
        # every row masked (the sampling path's masks) gives the same answer
        assert constrained_run(target, drafters(model)[shape], prompt, SamplingParams(), 12, vocab,
                               greedy=False)[0] == want
        assert want[0] in (A, C) and (len(want) < 2 or want[1] in (B, C)) and 0 not in want
        assert len(want) == 12 or want[-1] == EOS


def recording(cls):
    class Recording(cls):
        blind = False  # drafts as if there were no grammar

        def propose(self, ctx):
            if self.blind:
                ctx.allowed = None
            tree = super().propose(ctx)
            self.proposed.append((list(ctx.tokens[ctx.prompt_len:]), tree))
            return tree
    return Recording


def forbidden_nodes(tree: DraftTree, done: list[int]) -> int:
    toks = tree.tokens.tolist()
    return sum(x not in allowed_after(done + [toks[j] for j in tree.path_to(i)][:-1]) for i, x in enumerate(toks))


@pytest.mark.parametrize("blind", [True, False])
@pytest.mark.parametrize("make", [lambda: recording(PromptLookupDrafter)(chain_len=3),
                                  lambda: recording(NgramDrafter)(tree_size=6, topk=2)], ids=["pld", "ngram"])
def test_a_forbidden_draft_token_is_never_verified(vocab, blind, make):
    model = flat_tiny()
    steps = []
    drafter = make()
    drafter.proposed, drafter.blind = [], blind
    # the lookup drafts what the prompt repeats: "b" first where the grammar forbids it
    prompt = [B, C, A, B, C, A, B, C, A, B]
    got, _ = constrained_run(LeanRunner(model), drafter, prompt, SamplingParams(), 10, vocab,
                             on_verify=lambda tree, verdict: steps.append((tree, verdict.tokens)))
    # blind, the drafter proposes them; under the grammar (what it forbids never drafted) it does not
    assert any(forbidden_nodes(tree, done) for done, tree in drafter.proposed) == blind
    done = got[:1]  # the prefill's token
    for tree, emitted in steps:
        assert forbidden_nodes(tree, done) == 0
        done = done + emitted
    assert done == got
    assert any(len(tree) for _, tree in drafter.proposed)


class RecordingDraft(DraftModelDrafter):
    blind = False  # drafts as if there were no grammar

    def drafting(self, ctx, budget=None):
        if self.blind:
            ctx.allowed = None
        tree = yield from super().drafting(ctx, budget)
        self.proposed.append((list(ctx.tokens[ctx.prompt_len:]), tree))
        return tree


@pytest.mark.parametrize("tree", [None, TreeBudget(3, 2, 5)])
def test_a_draft_model_proposes_under_the_grammar(vocab, tree):
    regex = "(a|b)(c|a)(b|c)(a|b)(c|a)(b|c)[abc]*"  # two of three letters allowed at each of six places

    def forbidden(done, t):  # the draft's nodes the grammar forbids after what was emitted
        m = vocab.constraint(compile_grammar("regex", regex)).m
        toks = t.tokens.tolist()
        return sum(m.validate_tokens(done + [toks[j] for j in t.path_to(i)]) < len(done) + len(t.path_to(i))
                   for i in range(len(t)))

    model = flat_tiny()
    want, _ = constrained_run(LeanRunner(model), NoDrafter(), [4], SamplingParams(), 12, vocab, regex)
    seen = {}
    for blind in (False, True):
        drafter = RecordingDraft(LeanRunner(noisy_copy(model, 0.5)), SMALL_V, 3, tree)
        drafter.proposed, drafter.blind = [], blind
        got, _ = constrained_run(LeanRunner(model), drafter, [4], SamplingParams(), 12, vocab, regex)
        assert got == want
        seen[blind] = sum(forbidden(done, t) for done, t in drafter.proposed), sum(len(t) for _, t in drafter.proposed)
    assert seen[False][0] == 0 and seen[False][1] > 0
    assert seen[True][0] > 0  # the same draft blind to the grammar proposes what it forbids


@pytest.mark.slow
@pytest.mark.parametrize("params,shape", [  # each sampling and each shape; the truncated ones on both shapes
    (SamplingParams(1.0), "chain"), (SamplingParams(0.8, top_k=3), "tree"),
    (SamplingParams(1.2, top_p=0.85), "chain"), (SamplingParams(1.2, top_p=0.85), "tree")],
    ids=["T1-chain", "T0.8-topk3-tree", "T1.2-topp0.85-chain", "T1.2-topp0.85-tree"])
def test_sampling_under_a_grammar_is_the_renormalised_target(vocab, shape, params):
    model = flat_tiny()
    target = LeanRunner(model)
    prompt = [1, 3, 0, 2]
    counts, sizes = np.zeros(SMALL_V ** 3), []
    drafter = drafters(model)[shape]
    for seed in range(2000):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed if seed % 2 else None)
        toks, st = constrained_run(target, drafter, prompt, p, 6, vocab, first=3)
        counts[toks[0] * SMALL_V ** 2 + toks[1] * SMALL_V + toks[2]] += 1
        sizes += st.tree_sizes
    assert max(sizes) >= 3
    assert chi2_pvalue(counts, exact_masked_first3(model, prompt, params)) > 1e-3


# ---- on the embedded model ----

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string", "enum": ["Lisbon", "Porto", "Faro"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol_auto(smollm2_default):
    """The embedded SmolLM2 under `auto`, built once for both tests here (greedy answers do not depend on
    what it has drafted before)."""
    from specdec.api import from_models

    model, tok, weights = smollm2_default
    return from_models(model, tok, "auto", weights=weights)


@pytest.mark.slow
def test_smollm2_answers_fit_the_schema_and_auto_equals_vanilla(smol_auto, smollm2_default):
    import jsonschema

    from specdec.api import from_models

    prompt = [{"role": "user", "content": "Describe Ana, 31, who lives in Lisbon, as JSON."}]
    answers = {}
    for method in ("vanilla", "auto", "eagle2"):
        model, tok, weights = smollm2_default
        # eagle2's tree pinned (not the shipped tuning's): what is asserted of it is how the grammar prunes
        pinned = {"depth": 2, "topk": 3, "tree_size": 4} if method == "eagle2" else {}
        dec = smol_auto if method == "auto" else from_models(model, tok, method, weights=weights, **pinned)
        for kw in ({"json_schema": SCHEMA}, {"regex": r"(yes|no), because [a-z ]{3,30}\."}):
            g = dec.generate(prompt, max_new_tokens=64, **kw)
            answers.setdefault(next(iter(kw)), []).append(g.token_ids)
            if "json_schema" in kw:
                jsonschema.validate(json.loads(g.text), SCHEMA)
            else:
                assert g.text.startswith(("yes, because ", "no, because ")) and g.text.endswith(".")
            assert g.finish_reason == "stop"
            if method == "eagle2":  # the head (over its reduced vocabulary) drafts under the grammar
                assert g.stats.pruned == 0 and g.stats.tau > 1.5, (kw, g.stats.pruned, g.stats.tau)
    for kind, (vanilla, *others) in answers.items():
        assert all(o == vanilla for o in others), kind


@pytest.mark.slow
def test_the_openai_client_gets_json_that_fits_its_response_format(smol_auto):
    import jsonschema
    import openai

    from tests.test_serve import Server

    dec = smol_auto
    server = Server(dec)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "Describe Ana, 31, who lives in Porto, as JSON."}]
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=64, temperature=0,
                                           response_format=fmt)
        want = dec.generate(msgs, max_new_tokens=64, json_schema=SCHEMA)
        assert r.choices[0].message.content == want.text
        jsonschema.validate(json.loads(want.text), SCHEMA)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=64, temperature=0, response_format=fmt, stream=True) if c.choices)
        assert streamed == want.text
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=48, temperature=0,
                                           response_format={"type": "json_object"})
        want = dec.generate(msgs, max_new_tokens=48, json_object=True)
        assert r.choices[0].message.content == want.text and want.text.startswith("{")
        if want.finish_reason == "stop":
            assert isinstance(json.loads(want.text), dict)
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, response_format=bad)
        assert e.value.body["param"] == "response_format" and "objec" in e.value.body["message"]
    finally:
        server.stop()
