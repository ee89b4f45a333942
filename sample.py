"""
Sample text from a checkpoint written by train.py, or from a Hugging Face folder or hub id.

    python sample.py --init_from=out/shakespeare --prompt="ROMEO:" --num_samples=3 --max_new_tokens=200
    python sample.py --init_from=zeng123/Depth-attention-3B --prompt="The capital of France is"

A train.py checkpoint brings its config and its data's tokenizer, a Hugging Face folder its
config.json and tokenizer.json (checkpoint.load_model); model.generate decodes with the KV cache.
"""
import support.interrupt  # noqa: F401  first: Ctrl-C during the imports is one line, exit 130
import sys
from pathlib import Path

import torch

from support.variants import attention_of, residual_of
from support.checkpoint import load_model
from support.argparser import ArgumentParser, path
from support.cli import check_ranges, resolve_device
from support.errors import ConfigError, run_main

KEY_RANGES = {"num_samples": ">= 1", "max_new_tokens": ">= 0", "temperature": ">= 0",
              "top_k": ">= 0", "seed": "in [0, 2**63)"}
SOURCES = ("init_from", "ckpt", "out_dir")  # each names a model: a command samples one
DEFAULT_OUT_DIR = "out/shakespeare"


def read_prompt(args) -> str:
    if not args.prompt_file:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompt_file {args.prompt_file}: "
                          f"{getattr(e, 'strerror', None) or e}; "
                          f"give a readable UTF-8 text file") from None


def parse_args(argv):
    """The command line, checked (flags, types, ranges) without reading a file."""
    p = ArgumentParser("sample.py", description=__doc__.strip().split("\n")[0])
    p.add_argument("--init_from", type=path,
                   help="a train.py out_dir or ckpt.pt, a Hugging Face folder or hub id")
    p.add_argument("--out_dir", type=path,
                   help=f"a training run's folder (default {DEFAULT_OUT_DIR})")
    p.add_argument("--ckpt", type=path, help="a checkpoint file")
    p.add_argument("--prompt", default="",
                   help="text to continue; empty = start a new document (end-of-text)")
    p.add_argument("--prompt_file", type=path, help="read the prompt from this file instead")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="keep the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto = cuda, then mps, then cpu")
    args = p.parse_args(argv)
    check_ranges(vars(args), KEY_RANGES)
    given = [f"--{k}={getattr(args, k)}" for k in SOURCES if getattr(args, k)]
    if len(given) > 1:  # one would be sampled and the other ignored without a word
        raise ConfigError(f"{' and '.join(given)} each name a model; give one of them")
    return args


def main(argv):
    args = parse_args(argv)
    device = resolve_device(args.device)
    prompt = read_prompt(args)
    loaded = load_model(args.init_from or args.ckpt or args.out_dir or DEFAULT_OUT_DIR, device)
    model, enc = loaded.model, loaded.tokenizer

    ids = enc.encode(prompt, allowed_special="all") or [enc.eot_token]
    idx = torch.tensor([ids] * args.num_samples, device=device)  # (num_samples, prompt tokens)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    step = "" if loaded.step is None else f"step {loaded.step}, "
    print(f"{loaded.source}: {step}{model.num_params() / 1e6:.2f}M parameters, "
          f"depth_mode={model.config.depth_mode}, residual={residual_of(model.config)}, "
          f"attention={attention_of(model.config)}, tokenizer {enc.name}",
          file=sys.stderr)
    # a prompt and new tokens beyond the context: model.ConfigError, a user error (run_main)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k or None, generator=gen)
    for i, row in enumerate(out.tolist()):
        print(f"--- sample {i + 1}/{args.num_samples}: {len(ids)} prompt + "
              f"{len(row) - len(ids)} new tokens")
        print(enc.decode(row))


if __name__ == "__main__":
    sys.exit(run_main(main))
