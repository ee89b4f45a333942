"""
argparse in the dialect every script shares with train.py's --key=value (support/config.py), for
the scripts that take positional arguments (sample.py, eval.py, export.py, prepare_data.py, the
course's): `ArgumentParser`, and `path`, the type of an argument that names a file or folder.
"""
import argparse
import sys

from support.cli import EMPTY_PATH, boolean, nearest
from support.errors import ConfigError


def path(text) -> str:
    """argparse's type for a path or name (a key table's Key.path is the same rule): "" refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError(EMPTY_PATH)
    return text


class _ShowDefaults(argparse.HelpFormatter):
    """An option's default in --help, unless unset (None, False, "") or named by its help."""

    def _get_help_string(self, action):
        d, text = action.default, action.help
        hide = d is None or d is False or d in ("", argparse.SUPPRESS) or "default" in text
        return text if hide else f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse in the dialect every script shares with train.py's --key=value: --key=value or
    --key value; a boolean (add_flag) is a bare --flag or --flag=True/False/1/0; no abbreviations
    (--over is not --overwrite: a typo must not pick a flag); an unknown option names the nearest
    known one. An error is a one-line ConfigError (run_main prints it), so parse_args can check a
    command without running it. --help shows the defaults, beside a script's formatter_class."""

    def __init__(self, prog, formatter_class=argparse.HelpFormatter, **kwargs):
        if not issubclass(formatter_class, _ShowDefaults):
            formatter_class = type("HelpFormatter", (_ShowDefaults, formatter_class), {})
        super().__init__(prog=prog, allow_abbrev=False, formatter_class=formatter_class, **kwargs)
        self.flags = []

    def add_argument(self, *args, **kwargs):
        # argparse formats no help line for an option without help: give its default one
        if kwargs.get("help") is None and kwargs.get("default") not in (None, False, ""):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def add_flag(self, name, help=None):
        """A boolean, False unless given: --name, or --name=True/False/1/0 (parse_known_args)."""
        self.flags.append(name)
        return self.add_argument(name, action="store_true", help=help)

    def parse_known_args(self, args=None, namespace=None):
        # argparse gives a store_true flag no value, and nargs="?" would take the next positional
        # as one (`--overwrite SRC OUT`): --flag=value is read here; a flag's last spelling wins
        last, rest, options = {}, [], True
        for arg in sys.argv[1:] if args is None else args:
            options = options and arg != "--"  # after --, everything is a positional
            key, eq, value = arg.partition("=")
            if options and key in self.flags:
                last[key] = boolean(key[2:], value) if eq else True
                if eq:
                    continue
            rest.append(arg)
        namespace, extras = super().parse_known_args(rest, namespace)
        for key, value in last.items():
            setattr(namespace, self._option_string_actions[key].dest, value)
        return namespace, extras

    def error(self, message):
        """One line, not argparse's usage block, naming the nearest option to an unknown one."""
        if message.startswith("unrecognized arguments:"):
            known = [o for o in self._option_string_actions if o.startswith("--")]
            unknown = [a.partition("=")[0] for a in message.split(":", 1)[1].split()]
            # -max_new_tokens and --MAX_NEW_TOKENS too: one dash, or another case, is a slip
            near = [m for a in unknown if a.startswith("-")
                    if (m := nearest("--" + a.lstrip("-"), known))]
            message += f"; did you mean {near[0]}?" if near else ""
        raise ConfigError(f"{message} (python {self.prog} --help lists the flags)")
