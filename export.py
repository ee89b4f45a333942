"""
Export a model to a Hugging Face folder: config.json, model.safetensors, the tokenizer and, for
any model but a vanilla one, the code transformers runs it with (support/hf.py, save_pretrained).

    python export.py out/shakespeare out/shakespeare_hf      # a train.py out_dir (or its ckpt.pt)
    python export.py zeng123/Depth-attention-3B out/da3b_hf  # a Hugging Face folder or hub id
    python export.py out/RUN out/RUN_hf --dtype=bfloat16 --overwrite

The folder is written whole beside OUT_DIR and renamed into place, so an interrupted export leaves
no partial folder; an existing folder is refused, or replaced whole with --overwrite.
"""
import support.interrupt  # noqa: F401  first: Ctrl-C during the imports is one line, exit 130
import json
from pathlib import Path

import torch
import sys

from support import hf
from support.checkpoint import checkpoint_path, load_model
from support.argparser import ArgumentParser, path
from support.errors import run_main
from support.tokenizer import is_hf_folder


def parse_args(argv):
    """The command line, checked (flags, choices) without reading a file."""
    p = ArgumentParser("export.py", description=__doc__.strip().split("\n\n")[0],
                       epilog="python export.py SRC OUT_DIR [--dtype=...] [--overwrite]")
    p.add_argument("src", type=path, help="a train.py out_dir, a ckpt.pt or ckpt.dcp, or a Hugging Face "
                               "folder / hub id")
    p.add_argument("out_dir", type=path, help="a new or empty folder (not a train.py out_dir)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="convert the weights (default: unchanged)")
    p.add_flag("--overwrite", help="replace the files already in OUT_DIR, all of them")
    return p.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    out = Path(args.out_dir).resolve()
    src = Path(args.src).resolve()
    # a folder or a file of ours (a hub id is not a path): never written into, nor around
    home = (src if is_hf_folder(src) else checkpoint_path(src).resolve().parent) \
        if src.exists() else ""
    sources = [("SRC", home)]
    hf.check_export_dir(Path(args.out_dir), args.overwrite, sources)  # before loading: free
    loaded = load_model(args.src)
    model = loaded.model.to(getattr(torch, args.dtype)) if args.dtype else loaded.model
    hf.save_pretrained(model, out, loaded.tokenizer, overwrite=args.overwrite, sources=sources)
    cfg = json.loads((out / "config.json").read_text())
    code = (" (its code is in the folder: transformers loads it with trust_remote_code=True)"
            if "auto_map" in cfg else "")
    print(f"{loaded.source} -> {args.out_dir}: {model.num_params() / 1e6:.2f}M parameters, "
          f"{cfg['architectures'][0]}{code}")


if __name__ == "__main__":
    sys.exit(run_main(main))
