import atexit
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

# The suite's own cache, set before specdec is imported, and inherited by every subprocess the tests start:
# never the user's ~/.cache/specdec (nor a SPECDEC_CACHE of theirs), whose measured costs, converted models
# and `specdec tune` results would make what the tests see depend on that machine's history. Everything
# measured or derived is made afresh each session; only the built C++ kernels (a minute or two to compile,
# keyed by their sources, flags, torch and Python) are kept between runs, under <repo>/.cache/test-suite
# (SPECDEC_TEST_CACHE moves it, e.g. onto a CI cache).
# The pytest-xdist workers inherit the session's cache from the process that starts them, so a model is
# converted and a cost measured once a run, not once a worker (writes into it are atomic).
_KEEP = Path(os.environ.get("SPECDEC_TEST_CACHE") or Path(__file__).resolve().parents[1] / ".cache" / "test-suite")
if os.environ.get("SPECDEC_TEST_SESSION_CACHE"):
    _SESSION = Path(os.environ["SPECDEC_TEST_SESSION_CACHE"])
else:
    _SESSION = Path(tempfile.mkdtemp(prefix="specdec-test-cache-"))
    (_KEEP / "kernels").mkdir(parents=True, exist_ok=True)
    (_SESSION / "kernels").symlink_to(_KEEP / "kernels", target_is_directory=True)
    os.environ["SPECDEC_TEST_SESSION_CACHE"] = str(_SESSION)
    atexit.register(shutil.rmtree, _SESSION, ignore_errors=True)
os.environ["SPECDEC_CACHE"] = str(_SESSION)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import QS, TRAIN_KW, char_tokenizer, make_data, noisy_copy, tiny_model  # noqa: E402

# One thread unless a module asks for more (helpers.at_threads): ops on the tiny models gain nothing from a
# second thread, and on a busy machine two threads wait for each other (a sampled decode of the tiny model
# took 25x the CPU time on two threads as on one beside other processes). The kernels' own tests and the real
# model's run on two, and test_gguf compares the kernels' bits across thread counts.
torch.set_num_threads(1)

def pytest_collection_finish(session):
    """Start the slow preparations the collected tests need, in the background (tests/background.py), when
    the suite runs one test at a time: under pytest-xdist every worker collects every test, and no core idles."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests import background

    background.start({item.module.__name__.rsplit(".", 1)[-1] for item in session.items if item.module})


@pytest.fixture(autouse=True)
def no_thread_follower():
    """A test that loads a model (api.load) starts a thread follower (runtime/threads.py): it goes with the
    test, and the next starts from the suite's count, not from what the follower left."""
    from specdec.runtime import threads

    before = torch.get_num_threads()
    yield
    if threads.install(None) is not None:
        torch.set_num_threads(before)
    threads._usual = None


@pytest.fixture
def on_one_thread():
    """A test in a module that runs on two threads, whose work a second thread does not change (a row's bits
    follow no thread count): on one. Beside the other worker's test, a 2-thread decode of many short answers
    ran ~6x slower than alone; on one thread, as fast."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def family(request):
    return request.param


# ---- EAGLE fixtures, shared by the head, drafting, training, union and tune tests (one training run) ----

@pytest.fixture(scope="session")
def tiny():
    return tiny_model("llama")


@contextmanager
def one_thread():
    """A session fixture's data and head are made on one thread whichever module asks first (a module on two
    threads sums in another order: another head, and another tau for the tests that read it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_data(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    with one_thread():
        make_data(tiny, d)
    return d


@pytest.fixture(scope="session")
def trained(tiny, tiny_data, tmp_path_factory):
    from specdec.training.train import TrainConfig, train_eagle

    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(data=str(tiny_data), out=str(out), **TRAIN_KW)
    with one_thread():
        r = train_eagle(cfg, tiny, progress=False)
    return r, out


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir():
    """The embedded SmolLM2's tokenizer and config (no weights), read from its GGUF file into this session's
    cache: tests that need a real chat tokenizer get it in an empty cache too, without converting the model."""
    from specdec.runtime.loading import gguf_meta, resolve

    return gguf_meta(resolve("smollm2"))


@pytest.fixture(scope="session")
def smollm2_default():
    """The embedded SmolLM2 as `specdec.load` loads it by default (on the CPU: its GGUF file's own blocks where
    the kernels run), loaded once (~3 s a load) for the modules that build decoders over it with from_models
    (a decoder leaves the model as it was): (model, tokenizer, the weights load would pass)."""
    from specdec.runtime.gguf import GGUFModel
    from specdec.runtime.loading import load_model

    model, tok, _ = load_model("smollm2", device="cpu")
    return model, tok, "gguf" if isinstance(model, GGUFModel) else None


# ---- the benchmark's tiny target + draft with a char tokenizer, and one small run over them (every module's) ----

@pytest.fixture(scope="session")
def bench_models():
    tok = char_tokenizer()
    target = tiny_model("llama", vocab_size=len(tok))
    return target, tok, noisy_copy(target, scale=0.2)


@pytest.fixture(scope="session")
def bench_result(bench_models, tmp_path_factory):
    from specdec.bench.methods import parse_methods
    from specdec.bench.runner import BenchConfig, run_bench

    target, tok, draft = bench_models
    out = tmp_path_factory.mktemp("bench")
    specs = parse_methods("vanilla,sps:gamma=3,sps-tree:topk=2:gamma=3:tree_tokens=6,hf-pld:num_tokens=4,hf-assisted",
                          has_draft=True)
    cfg = BenchConfig(specs, max_new_tokens=16, repeats=2, warmup_tokens=4, progress=False, threads=1,
                      extra={"dataset": "test"})
    return run_bench(cfg, QS, target, tok, draft, tok, out), out


# ---- `auto` priced by fixed costs: what it drafts (hence its tau) then depends on no machine ----

def fixed_costs_for(menu, sampled=()):
    """Costs shaped as SmolLM2's measured on a 2-core CPU (t(n) rises ~3% a row, a head level costs ~2% of a
    one-row forward), never rescaled by a clock: the choices follow the acceptance alone, the same on every
    machine, however loaded."""
    from specdec.drafters.costs import ANCHORS, Costs

    unit, level = 1e3, 0.02e3
    return Costs({n: unit * (1 + 0.03 * (n - 1)) for n in ANCHORS}, {b: level * b.depth for b, _ in menu},
                 2 * level, 1e-3 * unit, {b: level * b.depth for b, _ in sampled}, catch_row_s=3e-3 * unit)


@pytest.fixture
def fixed_costs(monkeypatch):
    """`auto` (with a head or without) priced by fixed_costs_for instead of costs measured on this machine,
    and kept at those prices (no StepClock following the forwards' wall time): assertions about what it
    accepts hold on any machine, however loaded."""
    from specdec.drafters import auto

    def fixed(runner, model, menu, ngram, head=None, recalibrate=False, sampled=()):
        return fixed_costs_for(menu, sampled), None, "fixed (tests)"

    monkeypatch.setattr(auto, "load_costs", fixed)
    monkeypatch.setattr(auto, "StepClock", lambda: None)
