"""
Sample text from a train.py run, a checkpoint, a Hugging Face folder or a hub id, with the KV cache.

    python sample.py --init_from=out/shakespeare --prompt="ROMEO:" --num_samples=3
    python sample.py --init_from=zeng123/Depth-attention-3B --prompt="The capital of France is"
"""
import configurator  # first, so that Ctrl-C during the imports below is one line, exit 130
if __name__ == "__main__":
    configurator.interruptible()
import sys
from pathlib import Path

import torch

from checkpoint import load_model
from configurator import ConfigError, Key, parse, resolve_device, run_main

KEYS = {
    "init_from": Key("out/shakespeare", "a train.py out_dir or ckpt.pt, a Hugging Face folder or "
                     "hub id", path=True),
    "prompt": Key("", "text to continue; empty = start a new document (end-of-text)"),
    "prompt_file": Key("", "read the prompt from this UTF-8 file instead"),
    "num_samples": Key(1, "", ">= 1"),
    "max_new_tokens": Key(200, "", ">= 0"),
    "temperature": Key(0.8, "0 = greedy", ">= 0"),
    "top_k": Key(200, "keep the k most likely tokens; 0 = all", ">= 0"),
    "seed": Key(1337, "", "in [0, 2**63)"),
    "device": Key("auto", "auto = cuda, then mps, then cpu"),
}


def main(argv):
    a = parse(argv, KEYS, __doc__)
    device = resolve_device(a["device"])
    prompt = a["prompt"]
    if a["prompt_file"]:
        try:
            prompt = Path(a["prompt_file"]).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompt_file={a['prompt_file']}: {getattr(e, 'strerror', 0) or e}"
                              f"; give a readable UTF-8 text file") from None
    loaded = load_model(a["init_from"], device)
    model, enc = loaded.model, loaded.tokenizer
    ids = enc.encode(prompt, allowed_special="all") or [enc.eot_token]
    c = model.config
    print(f"{loaded.source}: {'' if loaded.step is None else f'step {loaded.step}, '}"
          f"{model.num_params() / 1e6:.2f}M parameters, depth_mode={c.depth_mode}, residual="
          f"{getattr(c, 'residual', 'add')}, attention={getattr(c, 'attention', 'standard')}, "
          f"tokenizer {enc.name}", file=sys.stderr)
    gen = torch.Generator(device=device).manual_seed(a["seed"])
    out = model.generate(torch.tensor([ids] * a["num_samples"], device=device),
                         a["max_new_tokens"], a["temperature"], a["top_k"] or None, gen)
    for i, row in enumerate(out.tolist()):
        print(f"--- sample {i + 1}/{a['num_samples']}: {len(ids)} prompt + {len(row) - len(ids)} "
              f"new tokens")
        print(enc.decode(row))


if __name__ == "__main__":
    sys.exit(run_main(main))
