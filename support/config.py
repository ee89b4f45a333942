"""
Command-line configuration shared by train.py, bench_cache.py and ablate.py.

    python train.py configs/minipile_value.py --n_layer=8 --depth_mode=vanilla

Positional arguments are config files: plain Python assignments (`n_layer = 12`), applied in order.
A file may start from another with `base_config = "other.py"` (a path relative to the file): the
other file's assignments come first, so a variant states only the lines that differ. Then the
overrides: `--key=value`, `--key value`, or a bare `--flag` for a boolean. Every key must already
exist in the defaults (an unknown one, in another case or misspelt, is refused naming the nearest);
values are parsed to the type of the default (an int is accepted where a float is expected; `None`
parses anywhere, and a default of `None` accepts any literal). A script declares its keys once, as a
table {name: Key} (key_table), and check_keys then holds each value to its key: None only where the
default is None, a None default's other values of its kind, no empty path, the range, the choices.
Anything else is a ConfigError that names the fix. `--help` (or `-h`) raises ShowHelp with the
script's docstring and every key with its default and its help, so the help can never drift from the
defaults.
"""
import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from support.cli import BOOL_WORDS, EMPTY_PATH, boolean, check_ranges, nearest, not_a_choice
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
    kind: Optional[type] = None  # a None default's type: the key is None or one of these
    path: bool = False  # a path or a folder's name: "" would silently mean the current folder

    def __post_init__(self):
        if self.default is None and self.kind is None:  # a bug in a table, not a user error
            raise TypeError("a key whose default is None names its kind, e.g. Key(None, kind=int)")


def key_table(keys: dict) -> tuple:
    """(defaults, helps, ranges, choices) of a table {name: Key}."""
    return ({name: key.default for name, key in keys.items()},
            {name: key.help for name, key in keys.items()},
            {name: key.check for name, key in keys.items() if key.check},
            {name: key.choices for name, key in keys.items() if key.choices})


def check_keys(cfg: dict, keys: dict):
    """Raise ConfigError for the first key of the table {name: Key} whose value it does not take:
    None where its default is not (parse_config takes None anywhere), another type than a None
    default's kind, an empty path, a value outside its range or not one of its choices."""
    for name, key in keys.items():
        value = cfg[name]
        if value is None and key.default is not None:
            raise ConfigError(f"--{name}=None: give a value, e.g. the default "
                              f"--{name}={key.default!r}")
        if value is not None and key.default is None and not _typed(value, key.kind):
            raise ConfigError(f"--{name}: expected {key.kind.__name__} or None (the default), "
                              f"got {value!r}")
        if key.path and not value.strip():
            raise ConfigError(f"--{name} {EMPTY_PATH}, e.g. the default --{name}={key.default}")
        if key.choices and value not in key.choices:
            raise not_a_choice(f"--{name}", value, key.choices)
    check_ranges(cfg, key_table(keys)[2])


def _typed(value, kind) -> bool:
    """Whether a key of type kind takes value: an int where a float is expected, never a bool for
    a number (True is an int too)."""
    if isinstance(value, bool) or kind is bool:
        return isinstance(value, bool) and kind is bool
    return isinstance(value, kind) or (kind is float and isinstance(value, int))


def _coerce(key, value, default):
    if value is None or default is None:
        return value
    if isinstance(default, bool):
        return boolean(key, value)
    if _typed(value, type(default)):
        return float(value) if isinstance(default, float) else value
    raise ConfigError(f"--{key}: expected {type(default).__name__} like the default {default!r}, "
                      f"got {value!r}")


def _unknown(key, known, where=""):
    """The error for an unknown key (where: the config file that sets it): the nearest known one,
    a slip of case first, or all of them."""
    near = nearest(key, known)
    spelled = f"--{near}" if not where else near
    hint = f"did you mean {spelled}? (--help lists every key)" if near else \
        f"known keys: {', '.join(sorted(known))}"
    return ConfigError(f"{where}unknown config key {key!r}; {hint}")


def _parse_literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word such as --depth_mode=value is a string


def read_config_file(path, known=None, _seen=()) -> dict:
    """The assignments of a config file (after those of its base_config), evaluated in an empty
    scope; with known (the keys a script takes), an unknown one is refused naming its file."""
    path = Path(path)
    if path.is_dir():
        shipped = ", ".join(str(p) for p in sorted(path.glob("*.py"))) or "none"
        raise ConfigError(f"{path} is a folder, not a config file; the config files in it: "
                          f"{shipped}")
    if not path.is_file():
        near = nearest(path.name, [p.name for p in path.parent.glob("*.py")]) \
            if path.parent.is_dir() else None
        hint = f"did you mean {path.with_name(near)}?" if near else \
            "the configs/ folder lists the ones that ship"
        raise ConfigError(f"config file {path} not found; {hint}")
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
    unknown = sorted(own.keys() - set(known)) if known is not None else []
    if unknown:
        raise _unknown(unknown[0], known, f"config file {path}: ")
    return {**read_config_file(path.parent / base, known, (*_seen, path.resolve())),
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
            cfg[key] = _coerce(key, value, defaults[key])
    return cfg


def argument_updates(argv, defaults):
    """The keys each argument sets, uncoerced, in order: a config file's assignments, or one key
    from `--key=value`, `--key value` or a bare `--flag` (True, for a boolean key). A key not in
    defaults is a ConfigError naming the nearest."""
    i = 0
    while i < len(argv):
        arg, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        if not arg.startswith("--") or "=" in arg or arg == "--":
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
    literal (the text as typed where the default is a string: --name=123 is the name "123"). With
    defaults, a key not in them is a ConfigError naming the nearest."""
    if arg == "--":  # argparse's end of options: here options and files mix in any order
        raise ConfigError("a bare -- ends nothing here: config files and --key=value come in any "
                          "order; drop it")
    if arg.startswith("-") and not arg.startswith("--") and not Path(arg).exists():
        key, eq, text = arg.lstrip("-").partition("=")
        near = nearest(key, defaults or ())
        fix = f"did you mean --{near}{eq}{text}?" if near else "keys take two dashes: --key=value"
        raise ConfigError(f"{arg} looks like an option with one dash; {fix}")
    if not arg.startswith("--"):
        return read_config_file(arg, defaults)
    key, eq, text = arg[2:].partition("=")
    if key == "help":
        raise ConfigError("--help takes no value; give --help alone")
    if not eq:
        raise ConfigError(f"argument {arg!r} must look like --key=value, --key value or --flag")
    if defaults is not None and key not in defaults:
        raise _unknown(key, defaults)
    return {key: text if isinstance((defaults or {}).get(key), str) else _parse_literal(text)}
