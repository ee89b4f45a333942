"""
Command-line configuration shared by train.py, bench_cache.py and ablate.py.

    python train.py configs/minipile_value.py --n_layer=8 --depth_mode=vanilla

Positional arguments are config files: plain Python assignments (`n_layer = 12`), applied in order.
A file may start from another with `base_config = "other.py"` (a path relative to the file): the other file's
assignments come first, so a variant states only the lines that differ. Then `--key=value` overrides. Every key must already exist in the defaults; values are parsed to the
type of the default (an int is accepted where a float is expected; `None` is accepted anywhere, and a
default of `None` accepts any literal). Anything else is an error that names the fix.
"""
import ast
from pathlib import Path


class ConfigError(ValueError):
    pass


def _coerce(key, value, default):
    if value is None or default is None:
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif isinstance(value, type(default)) and not (isinstance(value, bool) and not isinstance(default, bool)):
        return value
    raise ConfigError(f"--{key}: expected {type(default).__name__} like the default {default!r}, got {value!r}")


def _unknown(key, known):
    return ConfigError(f"unknown config key {key!r}; known keys: {', '.join(sorted(known))}")


def _parse_literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word such as --depth_mode=value is a string


def read_config_file(path, _seen=()) -> dict:
    """The assignments of a config file (after those of its base_config), evaluated in an empty scope."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; the configs/ folder lists the ones that ship")
    if path.resolve() in _seen:
        raise ConfigError(f"config file {path} includes itself through base_config")
    scope = {}
    exec(compile(path.read_text(), str(path), "exec"), {}, scope)
    own = {k: v for k, v in scope.items() if not k.startswith("_")}
    base = own.pop("base_config", None)
    return {**read_config_file(path.parent / base, (*_seen, path.resolve())), **own} if base else own


def parse_config(defaults: dict, argv: list) -> dict:
    """defaults overridden by the config files, then the --key=value arguments, in argv's order."""
    cfg = dict(defaults)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"argument {arg!r} must look like --key=value")
            # A string default keeps the text as typed (--name=123 is the name "123").
            updates = {key: text if isinstance(defaults.get(key), str) else _parse_literal(text)}
        else:
            updates = read_config_file(arg)
        for key, value in updates.items():
            if key not in defaults:
                raise _unknown(key, defaults)
            cfg[key] = _coerce(key, value, defaults[key])
    return cfg
