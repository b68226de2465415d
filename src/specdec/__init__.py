"""specdec: lossless speculative decoding."""

from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree

__all__ = ["SamplingParams", "DraftTree", "SpecdecError"]
__version__ = "0.1.0"

from specdec.api import Decoder, Generation, load  # noqa: E402

__all__ += ["Decoder", "Generation", "load"]
