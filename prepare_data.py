"""Turn a text corpus into flat token files for train.py.

    python prepare_data.py shakespeare               # embedded default, byte tokenizer, no download
    python prepare_data.py minipile [--input DIR]    # JeanKaddour/minipile parquet, gpt2 tokenizer
    python prepare_data.py pile --input 'shards/*.jsonl.zst'  # or no --input:
                                                              # monology/pile-uncopyrighted
    python prepare_data.py text --input a.txt b.txt --name mydata

Writes <out_dir>/<name>/train.bin, val.bin (uint16 ids, uint32 above 65,536 tokens) and meta.json;
support/prepare.py says how the documents are split and tokenized, and why an interrupted run
never leaves a half-written dataset.
"""
import support.interrupt  # noqa: F401  first: Ctrl-C during the imports is one line, exit 130
import sys

from support.argparser import ArgumentParser, path
from support.data import SOURCES
from support.prepare import check_request, prepare
from support.errors import run_main


def parse_args(argv):
    """The command line, checked (flags, types, choices) without reading a file."""
    parser = ArgumentParser("prepare_data.py", description=__doc__.split("\n")[0])
    parser.add_argument("source", choices=SOURCES, help="corpus to prepare")
    parser.add_argument("--input", nargs="+", dest="inputs", metavar="PATH", type=path,
                        help="local files, globs or directories (minipile: parquet; "
                             "pile: .jsonl.zst; text: any text file, one document each); minipile "
                             "and pile download from Hugging Face without it")
    parser.add_argument("--name", type=path,
                        help="output directory name under --out_dir (default: the source)")
    parser.add_argument("--tokenizer", type=path,
                        help="gpt2, bytes, or a Hugging Face folder / tokenizer.json / hub id (a "
                             "released model's); default: bytes for shakespeare (no download), "
                             "gpt2 otherwise")
    parser.add_argument("--out_dir", default="data", type=path, help="parent of the output directory")
    parser.add_argument("--val_fraction", type=float, default=0.1,
                        help="without val* files, every round(1/val_fraction)th document goes to "
                             "val; a single text file: its last val_fraction of characters")
    parser.add_argument("--num_proc", type=int,
                        help="tokenizer processes (default: min(8, CPU count))")
    parser.add_argument("--shards", type=int, default=1,
                        help="pile download only: train shards to fetch (00, 01, ...)")
    parser.add_flag("--force",
                    help="rebuild even if meta.json says the output is finished "
                         "(the old dataset stays until the new one is complete)")
    parser.add_argument("--decode_errors", choices=("strict", "replace"), default="strict",
                        help="a text file that is not UTF-8: strict = stop and name it; "
                             "replace = read each invalid byte as U+FFFD, with a warning that "
                             "counts them")
    args = parser.parse_args(argv)
    check_request(args.source, args.name, args.val_fraction, args.num_proc, args.shards)
    return args


def main(argv):
    prepare(**vars(parse_args(argv)))  # bad input, a missing package, no network: a UserError


if __name__ == "__main__":
    sys.exit(run_main(main))
