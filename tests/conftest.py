import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

torch.set_num_threads(2)

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, vocab_size=97, tie_word_embeddings=False,
)


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A random-weight model built from a config: fast, and every family we claim to support."""
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    kw = dict(_COMMON, **overrides)
    if family == "mistral":
        kw.setdefault("sliding_window", 4096)
    cfg = cls(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # random init gives near-uniform logits; scale the head so greedy choices are not ties
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def word_tokenizer(words):
    """A whitespace word-level tokenizer: ids 0 <unk>, 1 </s>, then the words."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
    t = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def family(request):
    return request.param


# ---- EAGLE fixtures, shared by the head, drafting, training, union and tune tests (one training run) ----

@pytest.fixture(scope="session")
def tiny():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_data(tiny, tmp_path_factory):
    from tests.eagle_common import make_data

    d = tmp_path_factory.mktemp("data")
    make_data(tiny, d)
    return d


@pytest.fixture(scope="session")
def trained(tiny, tiny_data, tmp_path_factory):
    from specdec.training.train import TrainConfig, train_eagle

    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(data=str(tiny_data), out=str(out), steps=100, batch_size=8, lr=3e-2, warmup=5,
                      save_every=1000, log_every=10)
    r = train_eagle(cfg, tiny, progress=False)
    return r, out
