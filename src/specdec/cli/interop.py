"""`specdec import-head SRC --out DIR` and `specdec export-head DIR --to vllm|sglang|llamacpp --out OUT`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.files import check_writable
from specdec.heads import ENGINES
from specdec.options import one_line_errors
from specdec.runtime.gguf import QuantTensor
from specdec.runtime.loading import load_model, resolve

_MODEL_HELP = ("the target (HF dir, .gguf or smollm2): every tensor is checked against it, and it supplies "
               "the LM head rows and layer count a head may take from it; without it nothing is checked")


def add_parser(sub) -> None:
    i = one_line_errors(sub.add_parser("import-head", help="read a published EAGLE-1/2, EAGLE-3 or Medusa "
                                       "checkpoint (format detected), write it as a specdec head dir"))
    i.add_argument("src", help="the checkpoint dir (config.json + model.safetensors / pytorch_model.bin, or "
                   "medusa_lm_head.*)")
    i.add_argument("--out", required=True, help="output head dir (written atomically)")
    i.add_argument("--model", default=None, help=_MODEL_HELP)
    i.set_defaults(func=cmd_import)
    e = one_line_errors(sub.add_parser("export-head", help="write a head for vLLM, SGLang or llama.cpp (EAGLE-3: "
                                       "one .gguf for llama-server --spec-type draft-eagle3)"))
    e.add_argument("src", help="the head dir (ours, or any layout import-head reads)")
    e.add_argument("--to", required=True, choices=ENGINES, help="the engine")
    e.add_argument("--out", required=True, help="output dir (written atomically); a .gguf file with --to llamacpp")
    e.add_argument("--model", default=None, help=_MODEL_HELP + "; with --to llamacpp, required: the target's .gguf "
                   "(or smollm2), whose tokenizer the file carries")
    e.set_defaults(func=cmd_export)


def _check_out(src: Path, out: Path, model: str | None) -> None:
    """--out and --model, before the target loads."""
    if out.exists() and out.resolve() == src.resolve():
        raise SpecdecError("--out must differ from SRC (a new directory is written)")
    if out.exists() and not out.is_dir():
        raise SpecdecError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise SpecdecError(f"--out {out} exists and holds no head: refusing to replace it")
    check_writable(out.absolute().parent, f"--out {out}:")
    if model is not None:
        resolve(model)


def _target(spec: str | None) -> tuple[torch.Tensor | None, int | None]:
    if spec is None:
        return None, None
    model, _, _ = load_model(spec, "cpu", torch.float32)
    w = model.get_output_embeddings().weight  # a .gguf target keeps its blocks: the rows a head takes, in fp32
    return (w.dequantize() if isinstance(w, QuantTensor) else w.detach()), model.config.num_hidden_layers


def cmd_import(args) -> int:
    from specdec.heads.interop import detect, import_head  # transformers' model code: only for these commands

    src, out = Path(args.src), Path(args.out)
    kind = detect(src)  # before any model loads
    _check_out(src, out, args.model)
    lm, n_layers = _target(args.model)
    kind, head = import_head(src, out, lm, n_layers)
    print(f"{src} ({kind}) -> {out}: specdec head dir", file=sys.stderr)
    return 0


def cmd_export(args) -> int:
    from specdec.heads.interop import detect, export_head

    src, out = Path(args.src), Path(args.out)
    detect(src)
    if args.to == "llamacpp":
        return _export_llamacpp(args, src, out)
    _check_out(src, out, args.model)
    lm, n_layers = _target(args.model)
    arch = export_head(src, args.to, out, lm, n_layers)
    print(f"{src} -> {out}: {arch} for {args.to}", file=sys.stderr)
    return 0


def _export_llamacpp(args, src: Path, out: Path) -> int:
    from specdec.heads.interop import export_head
    from specdec.heads.io import takes_target_rows

    if out.suffix != ".gguf" or out.is_dir():
        raise SpecdecError(f"--out {out}: --to llamacpp writes one file, give a path ending in .gguf")
    check_writable(out.absolute().parent, f"--out {out}:")
    if args.model is None:
        raise SpecdecError("--to llamacpp needs --model: the target's .gguf file (or smollm2), whose tokenizer "
                           "llama.cpp checks the draft's against")
    gguf = resolve(args.model)
    if gguf.suffix != ".gguf":
        raise SpecdecError(f"--model {args.model}: --to llamacpp needs the target's .gguf file (llama-server runs "
                           "it; its tokenizer is copied), not an HF directory")
    # the LM-head rows a head trained with --freeze-lm-head left to the target
    lm = _target(args.model)[0] if takes_target_rows(src) else None
    arch = export_head(src, "llamacpp", out, lm, target_gguf=gguf)
    print(f"{src} -> {out}: {arch} for llama.cpp (llama-server -m {gguf} -md {out} --spec-type draft-eagle3)",
          file=sys.stderr)
    return 0
