"""The shared command-line config parser: typing, unknown keys, config files and base_config."""
import pytest
from support.errors import ConfigError, ShowHelp
from support.config import Key, check_keys, key_table, parse_config


DEFAULTS = {"n_layer": 12, "lr": 1e-3, "stride": None, "name": "run", "compile": False}


def test_overrides_are_typed_like_the_default():
    cfg = parse_config(DEFAULTS, ["--n_layer=4", "--lr=1", "--stride=3", "--name=123",
                                  "--compile=True"])
    assert cfg == {"n_layer": 4, "lr": 1.0, "stride": 3, "name": "123", "compile": True}
    assert isinstance(cfg["lr"], float)
    assert parse_config(DEFAULTS, ["--stride=None"])["stride"] is None


def test_one_dialect_key_value_key_space_value_and_bare_flags():
    """--key=value, --key value and a bare --flag (True for a boolean) mean the same; a boolean
    takes a following true/false/1/0 as its value, and leaves anything else (a config file)
    alone."""
    spelled = [["--n_layer=4", "--compile=True", "--name=x"], ["--n_layer", "4", "--compile",
                                                               "--name", "x"], ["--compile", "true",
                                                                                "--n_layer", "4",
                                                                                "--name=x"]]
    for argv in spelled:
        assert parse_config(DEFAULTS, argv) == {**DEFAULTS, "n_layer": 4, "compile": True,
                                                "name": "x"}, argv
    assert parse_config(DEFAULTS, ["--compile", "0"])["compile"] is False
    # a negative number is a value, not a key
    assert parse_config(DEFAULTS, ["--lr", "-1"])["lr"] == -1.0
    # typed as the default: a string
    assert parse_config(DEFAULTS, ["--name", "123"])["name"] == "123"


def test_a_bare_flag_before_a_config_file_leaves_the_file_alone(tmp_path):
    (tmp_path / "c.py").write_text("n_layer = 3\n")
    assert parse_config(DEFAULTS, ["--compile", str(tmp_path / "c.py")]) == {**DEFAULTS,
                                                                             "compile": True,
                                                                             "n_layer": 3}


@pytest.mark.parametrize("argv, fragment", [
    (["--n_layers=4"], "unknown config key 'n_layers'; did you mean --n_layer?"),
    (["--zzz=4"], "unknown config key 'zzz'; known keys: compile, lr, n_layer, name, stride"),
    (["--n_layer"], "--n_layer needs a value: --n_layer=VALUE or --n_layer VALUE"),
    (["--n_layer", "--lr=1"], "--n_layer needs a value"),
    (["--n_layer=1.5"], "--n_layer: expected int"),
    (["--compile=maybe"], "--compile=maybe: give --compile alone, --compile=True or"),
    (["missing.py"], "config file missing.py not found"),
])
def test_bad_arguments_name_the_fix(argv, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        parse_config(DEFAULTS, argv)


def test_files_apply_in_order_and_inherit_from_base_config(tmp_path):
    (tmp_path / "base.py").write_text("n_layer = 8\nname = 'base'\nlr = 3e-4\n")
    (tmp_path / "child.py").write_text("base_config = 'base.py'\nname = 'child'\n")
    (tmp_path / "delta.py").write_text("lr = 2e-3\n")
    cfg = parse_config(DEFAULTS, [str(tmp_path / "child.py"), str(tmp_path / "delta.py"),
                                  "--n_layer=2"])
    assert cfg == {**DEFAULTS, "n_layer": 2, "name": "child", "lr": 2e-3}
    (tmp_path / "loop.py").write_text("base_config = 'loop.py'\n")
    with pytest.raises(ConfigError, match="includes itself"):
        parse_config(DEFAULTS, [str(tmp_path / "loop.py")])
    (tmp_path / "bad.py").write_text("n_layers = 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'n_layers'"):
        parse_config(DEFAULTS, [str(tmp_path / "bad.py")])


def test_a_key_table_gives_the_defaults_the_help_and_the_checks():
    """One table {name: Key} is what parse_config and check_keys read; --help lists each key's
    default, help and choices."""
    keys = {"n_layer": Key(12, "blocks", ">= 1"), "mode": Key("a", "how", choices=("a", "b")),
            "stride": Key(None, "every"), "compile": Key(False, "fast")}
    defaults, helps, ranges, choices = key_table(keys)
    assert (defaults, ranges, choices) == ({"n_layer": 12, "mode": "a", "stride": None,
                                            "compile": False}, {"n_layer": ">= 1"},
                                           {"mode": ("a", "b")})
    with pytest.raises(ShowHelp) as usage:
        parse_config(defaults, ["--help"], "doc", choices, helps)
    assert "--n_layer=12" in str(usage.value) and "how; one of a, b" in str(usage.value)
    check_keys(parse_config(defaults, ["--mode=b", "--stride=2"]), keys)
    for argv, message in ((["--n_layer=0"], "--n_layer must be a finite number >= 1, got 0"),
                          (["--mode=c"], "--mode must be one of a, b, got 'c'"),
                          (["--n_layer=None"], "--n_layer=None: give a value, e.g. the default "
                                               "--n_layer=12")):
        with pytest.raises(ConfigError, match=message):
            check_keys(parse_config(defaults, argv), keys)


@pytest.mark.parametrize("key", ["max_iters", "learning_rate", "seed", "block_size",
                                 "eval_interval", "compile"])
def test_train_refuses_none_where_a_value_is_needed(key):
    """train.py's table through the one check every key table uses (support.config.check_keys):
    None is refused by name, where it used to pass and end in a TypeError or a silent False."""
    from support import run_config
    with pytest.raises(ConfigError, match=f"--{key}=None: give a value"):
        run_config.parse_args([f"--{key}=None"])
