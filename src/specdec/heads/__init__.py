"""Draft heads that read the target's features (EAGLE), and the trained heads shipped with the package."""

from specdec.errors import SpecdecError

ENGINES = ("vllm", "sglang", "llamacpp")  # what export-head writes for


def check_sizes(what: str, hidden: int, vocab: int, hidden_size: int | None, vocab_size: int | None) -> None:
    """A head's hidden size and vocabulary against the target's (None: not checked), refused in one line."""
    if hidden_size is not None and hidden != hidden_size:
        raise SpecdecError(f"{what}: hidden size {hidden} but the target has {hidden_size}: "
                           "trained for a different model")
    if vocab_size is not None and vocab != vocab_size:
        raise SpecdecError(f"{what}: a vocabulary of {vocab} tokens but the target has {vocab_size}: "
                           "trained for a different model")
