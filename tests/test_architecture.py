"""The shape of the code, enforced: layers import only downward, function-local imports of our own
modules are rare and justified, files stay small, and the README's method table is the registry's."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.drafters import registry

SRC = Path(__file__).resolve().parents[1] / "src" / "specdec"
README = Path(__file__).resolve().parents[1] / "README.md"

# lower layers never import higher ones
LAYERS = (
    ("core", ("errors", "options", "files", "detok", "sampling", "tree", "grammar", "verify", "slot", "stats", "engine",
              "batch", "tuning", "vocab", "machine", "runtime", "drafters.base")),
    ("methods", ("drafters", "heads")),  # every drafter and the heads they run
    ("api", ("api", "__init__")),
    ("tools", ("tune", "bench", "training", "serve", "cli")),
)
# function-local imports of our own modules, each for a reason (module -> imported module)
# (transformers' Llama modules take ~6 s to import, its cache classes ~3 s: only when really used, so that
# `specdec --help`, `specdec methods` and bad-input errors stay fast)
LOCAL_IMPORTS_ALLOWED = {
    ("specdec.drafters.eagle", "specdec.heads.io"): "loads a head: transformers' Llama modules",
    ("specdec.training.train", "specdec.heads.io"): "the CLI parser imports train.py",
    ("specdec.training.train", "specdec.heads.model"): "the CLI parser imports train.py",
    ("specdec.runtime.loading", "specdec.runtime.hf"): "the HF runner, for non-Llama targets only",
    ("specdec.cli", "specdec.cli.commands"): "torch loads inside main, where a Ctrl-C is caught",
    ("specdec.cli.commands", "specdec.serve.app"): "fastapi and uvicorn are the optional `serve` extra",
    ("specdec.cli.interop", "specdec.heads.interop"): "every CLI start would load transformers' Llama modules",
    ("specdec.cli.interop", "specdec.heads.io"): "every CLI start would load transformers' Llama config",
    ("specdec.tune.cli", "specdec.heads.io"): "every CLI start would load transformers' Llama modules",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 2 else rel.parts
    return ".".join(parts)


def layer_of(module: str) -> int:
    name = module.removeprefix("specdec.").removeprefix("specdec") or "__init__"
    best, depth = None, -1  # the most specific prefix decides (drafters.base is core, drafters.* methods)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best


def our_imports(source: str, module: str) -> list[tuple[str, bool]]:
    """(imported specdec module, imported inside a function?) for every import statement."""
    tree = ast.parse(source)
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = []
    package = module if module.count(".") == 0 else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
            names = [n for n in names if _is_module(n)] or [base]
        else:
            continue
        out += [(n, id(node) in local) for n in names if n == "specdec" or n.startswith("specdec.")]
    return out


def _is_module(name: str) -> bool:
    rel = name.removeprefix("specdec").lstrip(".").replace(".", "/")
    return (SRC / f"{rel}.py").is_file() or (SRC / rel / "__init__.py").is_file()


def violations(source: str, module: str) -> list[str]:
    own = layer_of(module)
    bad = []
    for imported, is_local in our_imports(source, module):
        if layer_of(imported) > own:
            bad.append(f"{module} ({LAYERS[own][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})")
        if is_local and imported != module and (module, imported) not in LOCAL_IMPORTS_ALLOWED:
            bad.append(f"{module} imports {imported} inside a function")
    return bad


def sources():
    return sorted(SRC.rglob("*.py"))


def test_layers_import_only_downward_and_local_imports_are_justified():
    bad = [v for p in sources() for v in violations(p.read_text(), module_name(p))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module,line", [
    ("specdec.drafters.eagle", "import specdec.tune"),
    ("specdec.drafters.eagle", "from specdec.tune.search import tune"),
    ("specdec.engine", "from specdec.drafters.eagle import EagleDrafter"),
    ("specdec.runtime.lean", "from specdec.bench import runner"),
    ("specdec.heads.runner", "def f():\n    from specdec.api import load"),
])
def test_the_layer_check_catches_an_upward_import(module, line):
    assert violations(line, module)


def test_the_cli_starts_without_transformers_model_code():
    """Each `specdec` command (and every CLI process the suite starts) would pay ~3 s for it."""
    code = "import sys, specdec.cli.commands; print(sorted(m for m in sys.modules if '.modeling_' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in sources() if (n := len(p.read_text().splitlines())) > 400}
    assert not long


def test_readme_method_table_is_the_registrys():
    text = README.read_text()
    m = re.search(r"<!-- methods: generated by `specdec methods` -->\n(.*?)<!-- /methods -->", text, re.S)
    assert m, "README lacks the generated methods table"
    assert m.group(1) == registry.markdown_table(), "README's method table is stale: paste `specdec methods`"


def test_shipped_heads_fit_the_package():
    """Each shipped head: at most 64 MB, in files of at most 16 MiB, and the target fingerprint `auto` finds
    it by."""
    import json

    from specdec.heads.shipped import SHIPPED_DIR

    heads = [d for d in SHIPPED_DIR.iterdir() if (d / "config.json").exists()]
    assert heads
    for d in heads:
        sizes = [f.stat().st_size for f in d.iterdir() if f.is_file()]
        assert sum(sizes) <= 64e6 and max(sizes) <= 16 * 2 ** 20, d.name
        target = json.loads((d / "config.json").read_text())["specdec"]["target"]
        assert {"model_type", "hidden_size", "num_hidden_layers", "vocab_size", "embed_abs_mean"} <= set(target), d.name
