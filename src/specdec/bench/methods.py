"""Method specs: `name[:key=value[:key=value...]]`, comma-separated.

Our methods are the registry's (specdec.drafters.registry): a spec's options are checked by the
method's options class when parsed, before any model loads, and go to `api.from_models` unchanged, so a
new drafter is benchmarkable as soon as it is registered. The peers are HF `generate` variants run in
the same process: hf (vanilla), hf-pld (prompt lookup), hf-assisted (assisted generation with --draft),
and llama.cpp (bench/llamacpp.py: llamacpp, llamacpp-pld, llamacpp-server), whose options and install
are checked here too, before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench import llamacpp
from specdec.drafters import registry
from specdec.errors import SpecdecError
from specdec.runtime.loading import Runtime

HF_PEERS = ("hf", "hf-pld", "hf-assisted")
OWN_TARGET = ("weights", "target")  # options of the bench, not of the method: which target it runs on
# what applies a question's JSON schema (the extraction set): our methods (the bench option `constrained`,
# default true) and llama-server (its own option, sent as the request's json_schema)
CONSTRAINED = "constrained"
PEERS = HF_PEERS + llamacpp.NAMES
# the default run: the baselines, `auto` (what `specdec generate` uses), prompt lookup and HF's; with --draft
# the draft-model methods too; eagle2 joins when the package ships a head for the target (cli.py)
DEFAULT_METHODS = ("vanilla", "hf", "auto", "pld", "hf-pld")
DRAFT_METHODS = ("sps", "sps-tree", "hf-assisted")
DEFAULT_HELP = (f"Default: {','.join(DEFAULT_METHODS)} (+ eagle2 when the package ships an EAGLE head for the "
                f"target; + {','.join(DRAFT_METHODS)} with --draft)")


def our_methods() -> tuple[str, ...]:
    return registry.names()


@dataclass(frozen=True)
class MethodSpec:
    name: str
    opts: dict = field(default_factory=dict, hash=False)
    label: str = ""

    @property
    def is_peer(self) -> bool:
        return self.name in PEERS

    @property
    def weights(self) -> str | None:
        """Our methods' own `weights=` option: the target's linear precision for this method alone (None:
        the run's `--weights`). Decoding is lossless relative to that precision's target."""
        return None if self.is_peer else self.opts.get("weights")

    @property
    def target(self) -> str | None:
        """Our methods' own `target=` option: another target (an HF dir, e.g. a Medusa-2 run's new target)
        for this method alone, on the run's tokenizer. Decoding is lossless relative to that target."""
        return None if self.is_peer else self.opts.get("target")

    @property
    def decoder_opts(self) -> dict:
        """The options the method itself takes (everything but `weights`, `target` and `constrained`)."""
        return {k: v for k, v in self.opts.items() if k not in (*OWN_TARGET, CONSTRAINED)}

    @property
    def constrained(self) -> bool:
        """Whether the method applies a question's JSON schema (`constrained=false`: it answers freely). The
        HF peers and llama-cpp-python's cannot: they always answer freely."""
        return self.opts.get(CONSTRAINED, True) if self.name in our_methods() + ("llamacpp-server",) else False

    @property
    def lossy(self) -> bool:
        """A lossy acceptance rule is on (Medusa's typical acceptance): never audited as lossless."""
        return self.opts.get("typical") is True

    @property
    def audited(self) -> bool:
        """False for peers on another engine (llama.cpp: other kernels, maybe other weights) and for lossy
        methods: not held to token identity with our vanilla; their agreement with it is reported instead."""
        return self.name not in llamacpp.NAMES and not self.lossy


def _value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def parse_method(text: str, known: tuple[str, ...] | None = None) -> MethodSpec:
    text = text.strip()
    parts = text.split(":")
    name = parts[0].strip()
    check = known is None  # an explicit `known` list asks for the syntax only
    known = known if known is not None else our_methods() + PEERS
    if not name:
        raise SpecdecError(f"empty method name in {text!r}")
    if name not in known:
        raise SpecdecError(f"unknown method {name!r}; choose from: {', '.join(known)}")
    opts = {}
    for p in parts[1:]:
        k, eq, v = p.partition("=")
        k = k.strip().replace("-", "_")
        if not eq or not k or not v.strip():
            raise SpecdecError(f"bad option {p!r} in method {text!r}: expected key=value")
        if k in opts:
            raise SpecdecError(f"option {k!r} given twice in method {text!r}")
        opts[k] = _value(v.strip())
    if "weights" in opts:
        if name not in registry.names():
            raise SpecdecError(f"option 'weights' in method {text!r}: only our methods take it (llama.cpp peers "
                               "choose their weights with gguf=, hf runs the model as loaded)")
        Runtime(weights=str(opts["weights"]))  # one line naming the parameter, before any model loads
        opts["weights"] = str(opts["weights"])
    if "target" in opts:
        opts["target"] = _target_dir(name, str(opts["target"]), text)
    if CONSTRAINED in opts and name in registry.names() and not isinstance(opts[CONSTRAINED], bool):
        raise SpecdecError(f"option 'constrained' in method {text!r}: must be true or false, "
                           f"got {opts[CONSTRAINED]!r}")
    if check and name in registry.names():  # fails here, not after loading
        registry.parse(name, {k: v for k, v in opts.items() if k not in (*OWN_TARGET, CONSTRAINED)})
    if check and name in llamacpp.NAMES:
        llamacpp.check(name, opts, text)  # the package, the options, the weights file
    return MethodSpec(name, opts, text)


def _target_dir(name: str, value: str, text: str) -> str:
    if name not in registry.names():
        raise SpecdecError(f"option 'target' in method {text!r}: only our methods take it")
    d = Path(value).expanduser()
    if not (d / "config.json").is_file():
        raise SpecdecError(f"option 'target' in method {text!r}: {d} is not a model directory (no config.json)")
    return str(d.resolve())


def parse_methods(text: str | None, has_draft: bool, known: tuple[str, ...] | None = None,
                  weights: str | None = None, hf: bool = True) -> list[MethodSpec]:
    """The methods to time. The two baseline candidates (hf and our vanilla) are always included,
    since the speedup baseline is the faster of them in the same run (docs/design.md, "Terms"). A method on its own
    `weights=` or `target=` gets the vanilla of that precision and target too: the reference its outputs are
    audited against.
    `weights`: the run's default precision (--weights). hf=False: no HF baseline (a GGUF target on its own
    blocks has no HF forward; the HF peers would time its de-quantized fp32 copy, another model)."""
    if text is None or not text.strip():
        ours = (our_methods() if known is None else known) + PEERS
        names = [m for m in DEFAULT_METHODS + (DRAFT_METHODS if has_draft else ()) if m in ours]
        if not hf:
            names = [n for n in names if n not in HF_PEERS]
        text = ",".join(names)
    specs = [parse_method(t, known) for t in text.split(",") if t.strip()]
    labels = [s.label for s in specs]
    dup = [x for x in labels if labels.count(x) > 1]
    if dup:
        raise SpecdecError(f"method {dup[0]!r} is listed twice")
    if not hf and any(s.name in HF_PEERS for s in specs):
        raise SpecdecError("the hf peers need the model's HF forward: a .gguf on its own blocks has none "
                           "(run them with --weights fp32)")
    bases = [next((s for s in specs if s.label == b), MethodSpec(b, {}, b)) for b in ("vanilla", "hf")[:1 + hf]]
    specs = bases + [s for s in specs if s not in bases]
    def ref(s):  # what a method is lossless relative to: (weights, target); None weights: the run's
        return s.weights or weights, s.target

    have = {ref(s) for s in specs if s.name == "vanilla"}
    at = specs.index(bases[-1]) + 1
    for w, t in dict.fromkeys(ref(s) for s in specs):
        if (w, t) not in have:  # a method on its own weights or target: the vanilla it is audited against
            opts = ({"weights": w} if w != weights else {}) | ({"target": t} if t else {})
            label = "vanilla:" + ":".join(f"{k}={v}" for k, v in opts.items())
            specs.insert(at, MethodSpec("vanilla", opts, label))
            at += 1
            have.add((w, t))
    if any(s.name == "hf-assisted" for s in specs) and not has_draft:
        raise SpecdecError("method 'hf-assisted' needs a draft model: pass --draft")
    return specs
