import pytest
import torch

from tests.helpers import QS, TRAIN_KW, char_tokenizer, make_data, noisy_copy, tiny_model

torch.set_num_threads(2)

@pytest.fixture(params=["llama", "qwen2", "mistral"])
def family(request):
    return request.param


# ---- EAGLE fixtures, shared by the head, drafting, training, union and tune tests (one training run) ----

@pytest.fixture(scope="session")
def tiny():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_data(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    make_data(tiny, d)
    return d


@pytest.fixture(scope="session")
def trained(tiny, tiny_data, tmp_path_factory):
    from specdec.training.train import TrainConfig, train_eagle

    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(data=str(tiny_data), out=str(out), **TRAIN_KW)
    r = train_eagle(cfg, tiny, progress=False)
    return r, out


# ---- the benchmark's tiny target + draft with a char tokenizer, and one small run over them ----

@pytest.fixture(scope="module")
def bench_models():
    tok = char_tokenizer()
    target = tiny_model("llama", vocab_size=len(tok))
    return target, tok, noisy_copy(target, scale=0.2)


@pytest.fixture(scope="module")
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
