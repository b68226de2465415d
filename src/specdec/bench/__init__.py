"""`specdec bench`: Spec-Bench-style timing of every method against its peers, in one process.

data (questions) -> methods (spec parsing, peers) -> runner (interleaved timing) -> audit
(losslessness) -> metrics (pure arithmetic) -> report (Markdown + PNG) ; compare (two result dirs).
"""

from specdec.bench.data import Question, load_questions
from specdec.bench.methods import MethodSpec, parse_methods
from specdec.bench.runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "MethodSpec", "Question", "load_questions", "parse_methods", "run_bench"]
