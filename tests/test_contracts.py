"""Drafters and runners are used through what their base classes declare (drafters.base.Drafter,
target.base.Runner), never probed: no getattr/hasattr/setattr on a drafter or runner, and no isinstance
against a Drafter or Runner subclass outside the module that defines it."""

import ast
import importlib
from pathlib import Path

import pytest

from specdec.drafters.base import Drafter
from specdec.runtime.base import Runner

SRC = Path(__file__).resolve().parents[1] / "src" / "specdec"
PROBES = ("getattr", "hasattr", "setattr")
# names that hold a drafter, a runner or what bundles them (registry.Target, api.Decoder)
HOLDERS = {"drafter", "runner", "target", "dec", "decoder"}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def holds_one(node: ast.expr) -> bool:
    """`drafter`, `self.runner`, `dec.drafter`, `draft_runner`, `target.runner`, ...: a drafter or runner."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name is not None and (name in HOLDERS or name.endswith(("_drafter", "_runner")))


def class_names(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [n for e in node.elts for n in class_names(e)]
    return [node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute) else []


def contract_classes() -> dict[str, str]:
    """Every Drafter and Runner class in the package (all modules imported) -> the module defining it."""
    for p in SRC.rglob("*.py"):  # some packages are namespace packages: pkgutil would not walk them
        name = module_name(p)
        if ".training" not in name and not name.endswith("__main__"):
            importlib.import_module(name)
    out, todo = {}, [Drafter, Runner]
    while todo:
        c = todo.pop()
        out[c.__name__] = c.__module__
        todo += c.__subclasses__()
    return out


def violations(source: str, module: str, classes: dict[str, str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
            continue
        line = f"{module}:{node.lineno}: {ast.unparse(node)}"
        probe = node.func.id in PROBES and holds_one(node.args[0])
        foreign = node.func.id == "isinstance" and len(node.args) == 2 and \
            any(classes.get(n, module) != module for n in class_names(node.args[1]))
        if probe or foreign:
            out.append(line)
    return out


def test_drafters_and_runners_are_used_through_their_contracts():
    classes = contract_classes()
    found = [v for p in sorted(SRC.rglob("*.py")) for v in violations(p.read_text(), module_name(p), classes)]
    assert not found, "declare it on the base class instead of probing:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    'typical = getattr(drafter, "typical", None)',
    'ok = hasattr(self.runner, "lm_head")',
    'w = getattr(dec.runner, "weights", None)',
    "first = drafter.members[0] if isinstance(drafter, UnionDrafter) else drafter",
    "assert isinstance(x, (int, EagleDrafter))",
    "assert isinstance(r, LeanRunner)",
])
def test_the_check_catches_a_probe(line):
    assert violations(line, "specdec.api", contract_classes())


def test_the_defining_module_and_other_objects_are_fine():
    classes = contract_classes()
    assert not violations("isinstance(d, UnionDrafter)", "specdec.drafters.union", classes)
    assert not violations('getattr(cfg, "hidden_size", 0) + isinstance(x, dict)', "specdec.api", classes)
