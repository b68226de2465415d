"""`specdec medusa convert SRC DST`: Medusa heads between our layout, vLLM's and FasterDecoding's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.files import check_writable
from specdec.heads.medusa_formats import FORMATS, detect_format, export_medusa, export_vllm, import_medusa
from specdec.heads.medusa_io import save_medusa
from specdec.options import one_line_errors
from specdec.runtime.loading import load_model, resolve


def add_parser(sub) -> None:
    p = one_line_errors(sub.add_parser("medusa", help="Medusa heads: convert between specdec, vLLM and "
                                       "FasterDecoding (medusa) layouts"))
    acts = p.add_subparsers(dest="action", required=True)
    c = one_line_errors(acts.add_parser("convert", help="read heads in any layout (detected), write them in --to's"))
    c.add_argument("src", help="heads dir: specdec's, vLLM's (config.json model_type medusa) or FasterDecoding's "
                   "(medusa_lm_head.safetensors / .pt)")
    c.add_argument("dst", help="output dir (replaced if it already holds Medusa heads)")
    c.add_argument("--to", choices=FORMATS, default="specdec", help="output layout (default specdec)")
    c.add_argument("--model", default=None, help="the target (HF dir, .gguf or smollm2): checks hidden size and "
                   "vocabulary, shares its LM head when the heads' equal it, and supplies its rows to heads that "
                   "share it when writing vllm/medusa; without it nothing is checked against a target")
    c.add_argument("--pt", action="store_true", help="--to medusa: also write medusa_lm_head.pt (the only file "
                   "FasterDecoding's own loader reads)")
    c.set_defaults(func=cmd_convert)


def cmd_convert(args) -> int:
    src, dst = Path(args.src), Path(args.dst)
    fmt = detect_format(src)  # checked before any model loads
    if dst.exists() and dst.resolve() == src.resolve():
        raise SpecdecError("DST must differ from SRC (the conversion writes a new directory)")
    if dst.exists() and not dst.is_dir():
        raise SpecdecError(f"{dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()):
        try:
            detect_format(dst)
        except SpecdecError:
            raise SpecdecError(f"{dst} exists and does not hold Medusa heads: refusing to replace it") from None
    if args.pt and args.to != "medusa":
        raise SpecdecError("--pt only applies to --to medusa")
    check_writable(dst.absolute().parent, f"DST {dst}:")
    if args.model is not None:
        resolve(args.model)
    lm = None
    if args.model is not None:
        model, _, _ = load_model(args.model, "cpu", torch.float32)
        lm = model.get_output_embeddings().weight.detach()
    heads = import_medusa(src, lm)
    if args.to == "specdec":
        save_medusa(heads, dst)
    elif args.to == "vllm":
        export_vllm(heads, dst, lm)
    else:
        export_medusa(heads, dst, lm, base_model=args.model, pt=args.pt)
    vocab = (f"draft vocabulary {heads.draft_vocab_size} of {heads.vocab_size}" if heads.d2t is not None
             else f"vocabulary {heads.vocab_size}")
    print(f"{src} ({fmt}) -> {dst} ({args.to}): {heads.num_heads} heads x {heads.num_layers} layers, hidden "
          f"{heads.hidden_size}, {vocab}, LM head {heads.lm_head_kind}", file=sys.stderr)
    return 0
