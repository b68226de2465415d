"""specdec: lossless speculative decoding."""

from specdec.errors import SpecdecError

__all__ = ["SamplingParams", "DraftTree", "SpecdecError", "Decoder", "Generation", "load"]
__version__ = "0.1.0"

# imported on first use (PEP 562): `specdec` on the command line must be able to report a Ctrl-C during
# the seconds torch takes to import, which it can only catch once its own entry point runs
_LAZY = {"SamplingParams": "specdec.sampling", "DraftTree": "specdec.tree", "Decoder": "specdec.api",
         "Generation": "specdec.api", "load": "specdec.api"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
