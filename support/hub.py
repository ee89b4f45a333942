"""
A Hugging Face tokenizer.json behind tiktoken's interface (HFTokenizer), apart from
support/tokenizer.py so that a run on a tiktoken encoding (the default's bytes, GPT-2's) never
reads it: tokenizer.py imports it only for a tokenizer.json. `tokenizers` is optional, imported
where used.
"""
from pathlib import Path

from support.cli import EOT, reason, require
from support.errors import DataError


class HFTokenizer:
    """A tokenizer.json (the `tokenizers` package) behind tiktoken's interface."""

    def __init__(self, path, eot_token=None, name=None, text=None):
        """From the file at path, or from text, its contents kept in a checkpoint (path is then only
        its name). `self.text` is what an export or a checkpoint stores: never a path, which would
        break once the folder is moved or read from another working directory."""
        tokenizers = require("tokenizers", "a Hugging Face tokenizer.json")
        try:
            self.text = Path(path).read_text() if text is None else text
            self._tok = tokenizers.Tokenizer.from_str(self.text)
            self._plain = tokenizers.Tokenizer.from_str(self.text)
        except Exception as e:  # unreadable, not JSON, or JSON that is not a tokenizer: a file
            raise DataError(f"{path}: not a readable tokenizer.json ({reason(e)})") from e
        self._plain.encode_special_tokens = True  # special-token text is encoded as plain text
        self.name = name or str(path)
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder().values()
        self.special = {t.content for t in added if t.special}
        self.eot_token = eot_token if eot_token is not None else self._tok.token_to_id(EOT)
        if self.eot_token is None:
            raise DataError(f"{path}: no end-of-text token (no eos_token_id in config.json and no "
                            f"{EOT} in the tokenizer)")

    def encode(self, text, allowed_special=()):
        """Like tiktoken: special-token text is an error unless allowed ("all" or a set of them)."""
        if allowed_special != "all":
            banned = [s for s in self.special if s in text and s not in allowed_special]
            if banned:
                raise ValueError(f"text contains special tokens {banned}; pass allowed_special or "
                                 f"use encode_ordinary")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_ordinary(self, text):
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self._tok.decode(list(ids), skip_special_tokens=False)
