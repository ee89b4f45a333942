"""
Command-line configuration shared by train.py, bench_cache.py and ablate.py.

    python train.py configs/minipile_value.py --n_layer=8 --depth_mode=vanilla

Positional arguments are config files: plain Python assignments (`n_layer = 12`), applied in order.
A file may start from another with `base_config = "other.py"` (a path relative to the file): the
other file's assignments come first, so a variant states only the lines that differ. Then the
overrides: `--key=value`, `--key value`, or a bare `--flag` for a boolean. Every key must already
exist in the defaults (an unknown one is refused naming the nearest); values are parsed to the type
of the default (an int is accepted where a float is expected; `None` is accepted anywhere, and a
default of `None` accepts any literal). Anything else is a ConfigError that names the fix. `--help`
(or `-h`) raises ShowHelp with the script's docstring and every key with its default and its help,
so the help can never drift from the defaults. A script declares its keys once, as a table
{name: Key} (key_table).
"""
import ast
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from support.cli import BOOL_WORDS, boolean, check_ranges
from support.errors import ConfigError, ShowHelp

@dataclass(frozen=True)
class Key:
    """One key of a script's table (its --help line and its checks)."""
    default: object
    help: str = ""
    check: Optional[str] = None      # a range rule of RULES, e.g. "> 0"
    choices: Optional[tuple] = None  # the values it takes
    # train.py's: False = the key changes no number the run reports (where and how often it writes
    # or prints, how the same computation is laid out), so a run recorded otherwise is still it
    result: bool = True
    per_invocation: bool = False  # how this command runs, not the run: never from a checkpoint


def key_table(keys: dict) -> tuple:
    """(defaults, helps, ranges, choices) of a table {name: Key}."""
    return ({name: key.default for name, key in keys.items()},
            {name: key.help for name, key in keys.items()},
            {name: key.check for name, key in keys.items() if key.check},
            {name: key.choices for name, key in keys.items() if key.choices})


def check_keys(cfg: dict, keys: dict):
    """Raise ConfigError for the first key of the table {name: Key} that is None where its default
    is not (parse_config takes None anywhere), outside its range or not one of its choices."""
    for name, key in keys.items():
        if cfg[name] is None and key.default is not None:
            raise ConfigError(f"--{name}=None: give a value, e.g. the default "
                              f"--{name}={key.default!r}")
        if key.choices and cfg[name] not in key.choices:
            raise ConfigError(f"--{name} must be one of {', '.join(key.choices)}, got {cfg[name]!r}")
    check_ranges(cfg, key_table(keys)[2])


def _coerce(key, value, default):
    if value is None or default is None:
        return value
    if isinstance(default, bool):
        return boolean(key, value)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, float) and number:
        return float(value)
    if isinstance(value, type(default)) and not isinstance(value, bool):  # True is an int too
        return value
    raise ConfigError(f"--{key}: expected {type(default).__name__} like the default {default!r}, "
                      f"got {value!r}")


def _unknown(key, known):
    """The error for an unknown key: the nearest known one, or all of them."""
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean --{near[0]}? (--help lists every key)" if near else \
        f"known keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key {key!r}; {hint}")


def _parse_literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word such as --depth_mode=value is a string


def read_config_file(path, _seen=()) -> dict:
    """The assignments of a config file (after those of its base_config), evaluated in an empty
    scope."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; the configs/ folder lists the ones that ship")
    if path.resolve() in _seen:
        raise ConfigError(f"config file {path} includes itself through base_config")
    scope = {}
    try:
        exec(compile(path.read_text(), str(path), "exec"), {}, scope)
    except Exception as e:  # a syntax error or a failing expression in the file
        tb = e.__traceback__.tb_next
        line = getattr(e, "lineno", None) or (tb.tb_lineno if tb else "?")
        raise ConfigError(f"config file {path}, line {line}: {type(e).__name__}: {e}; config files "
                          f"hold plain assignments such as `n_layer = 12`") from e
    own = {k: v for k, v in scope.items() if not k.startswith("_")}
    base = own.pop("base_config", None)
    return {**read_config_file(path.parent / base, (*_seen, path.resolve())),
            **own} if base else own


def help_text(defaults: dict, doc: str, helps: dict, choices=None) -> str:
    """The usage: the script's docstring, then `--key=default  help` for every key; choices:
    {key: the values it takes}, listed after the key's help (from the code, never stale)."""
    helps = dict(helps)
    for key, values in (choices or {}).items():
        helps[key] = f"{helps.get(key, '')}; one of {', '.join(values)}".lstrip("; ")
    width = min(36, max(len(f"--{k}={v!r}") for k, v in defaults.items()))
    keys = "\n".join(f"  {f'--{k}={v!r}':<{width}}  {helps.get(k, '')}".rstrip()
                     for k, v in defaults.items())
    return (f"{doc.strip()}\n\nkeys (--key=value or --key value, typed like the default; a bare "
            f"--flag sets a boolean):\n{keys}")


def parse_config(defaults: dict, argv: list, doc: str = "", choices=None, helps=None) -> dict:
    """defaults overridden by the config files, then the --key=value arguments, in argv's order.
    With -h/--help anywhere in argv, ShowHelp with the help (helps: {key: text}; choices: listed
    after it)."""
    if "-h" in argv or "--help" in argv:
        raise ShowHelp(help_text(defaults, doc, helps or {}, choices))
    cfg = dict(defaults)
    for updates in argument_updates(argv, defaults):
        for key, value in updates.items():
            if key not in defaults:
                raise _unknown(key, defaults)
            cfg[key] = _coerce(key, value, defaults[key])
    return cfg


def argument_updates(argv, defaults):
    """The keys each argument sets, uncoerced, in order: a config file's assignments, or one key
    from `--key=value`, `--key value` or a bare `--flag` (True, for a boolean key)."""
    i = 0
    while i < len(argv):
        arg, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        if not arg.startswith("--") or "=" in arg:
            yield arg_updates(arg, defaults)
            continue
        key = arg[2:]
        if key not in defaults:
            raise _unknown(key, defaults)
        if isinstance(defaults[key], bool):
            takes = nxt is not None and nxt.lower() in BOOL_WORDS
            text = nxt if takes else "True"
        elif nxt is not None and not nxt.startswith("--"):
            takes, text = True, nxt
        else:
            raise ConfigError(f"--{key} needs a value: --{key}=VALUE or --{key} VALUE")
        i += takes
        yield {key: text if isinstance(defaults[key], str) else _parse_literal(text)}


def arg_updates(arg, defaults=None) -> dict:
    """The keys one argument sets, uncoerced: a config file's assignments, or `--key=value`'s
    literal (the text as typed where the default is a string: --name=123 is the name "123")."""
    if not arg.startswith("--"):
        return read_config_file(arg)
    key, eq, text = arg[2:].partition("=")
    if not eq:
        raise ConfigError(f"argument {arg!r} must look like --key=value, --key value or --flag")
    return {key: text if isinstance((defaults or {}).get(key), str) else _parse_literal(text)}
