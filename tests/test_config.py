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
    # a slip of case or of a dash names the key meant; only a hopeless typo lists them all
    (["--N_LAYER=2"], "unknown config key 'N_LAYER'; did you mean --n_layer? (--help lists"),
    (["-n_layer=3"], "-n_layer=3 looks like an option with one dash; did you mean --n_layer=3?"),
    (["-zzz=3"], "-zzz=3 looks like an option with one dash; keys take two dashes"),
    (["--help=1"], "--help takes no value; give --help alone"),
    (["--", "--n_layer=2"], "a bare -- ends nothing here"),
], ids=["near", "far", "needs_value", "needs_value_before_key", "int", "bool", "missing",
        "upper_case", "one_dash", "one_dash_far", "help_value", "bare_dashes"])
def test_bad_arguments_name_the_fix(argv, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("?", r"\?")):
        parse_config(DEFAULTS, argv)


def test_a_config_file_misnamed_a_folder_or_with_a_typo_names_the_file_and_the_fix(tmp_path):
    """A folder lists its config files; a missing file names its nearest sibling; a file's unknown
    key names the file (a base_config's: the base) and the nearest key."""
    (tmp_path / "small.py").write_text("n_layer = 2\n")
    (tmp_path / "base.py").write_text("N_layer = 2\n")
    (tmp_path / "child.py").write_text("base_config = 'base.py'\n")
    for arg, message in ((tmp_path, f"{tmp_path} is a folder, not a config file; the config files "
                                    f"in it: {tmp_path / 'base.py'}, {tmp_path / 'child.py'}, "
                                    f"{tmp_path / 'small.py'}"),
                         (tmp_path / "smal.py", f"did you mean {tmp_path / 'small.py'}?"),
                         (tmp_path / "child.py", f"config file {tmp_path / 'base.py'}: unknown "
                                                 f"config key 'N_layer'; did you mean n_layer?")):
        with pytest.raises(ConfigError) as e:
            parse_config(DEFAULTS, [str(arg)])
        assert message in str(e.value), e.value


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
            "stride": Key(None, "every", kind=int), "compile": Key(False, "fast")}
    defaults, helps, ranges, choices = key_table(keys)
    assert (defaults, ranges, choices) == ({"n_layer": 12, "mode": "a", "stride": None,
                                            "compile": False}, {"n_layer": ">= 1"},
                                           {"mode": ("a", "b")})
    with pytest.raises(ShowHelp) as usage:
        parse_config(defaults, ["--help"], "doc", choices, helps)
    assert "--n_layer=12" in str(usage.value) and "how; one of a, b" in str(usage.value)
    check_keys(parse_config(defaults, ["--mode=b", "--stride=2"]), keys)
    for argv, message in ((["--n_layer=0"], "--n_layer must be a finite number >= 1, got 0"),
                          (["--mode=c"], "--mode=c is not a choice; choices: a, b"),
                          (["--mode=A"], "--mode=A is not a choice; did you mean a\\? choices"),
                          (["--stride=2.5"], "--stride: expected int or None \\(the default\\), "
                                             "got 2.5"),
                          (["--n_layer=None"], "--n_layer=None: give a value, e.g. the default "
                                               "--n_layer=12")):
        with pytest.raises(ConfigError, match=message):
            check_keys(parse_config(defaults, argv), keys)
    with pytest.raises(TypeError, match="names its kind"):  # a table that leaves a key untyped
        Key(None, "every")


@pytest.mark.parametrize("key", ["max_iters", "learning_rate", "seed", "block_size",
                                 "eval_interval", "compile"])
def test_train_refuses_none_where_a_value_is_needed(key):
    """train.py's table through the one check every key table uses (support.config.check_keys):
    None is refused by name, where it used to pass and end in a TypeError or a silent False."""
    from support import run_config
    with pytest.raises(ConfigError, match=f"--{key}=None: give a value"):
        run_config.parse_args([f"--{key}=None"])


def key_tables():
    """{script: (its key table, its parse_args as a config dict)} of the three table scripts."""
    import ablate
    import bench_cache
    from support import run_config
    return {"train.py": (run_config.TRAIN_KEYS, run_config.parse_args),
            "ablate.py": (ablate.KEYS, lambda argv: ablate.parse_args(argv)[0]),
            "bench_cache.py": (bench_cache.KEYS, bench_cache.parse_args)}


@pytest.mark.parametrize("script", ["train.py", "ablate.py", "bench_cache.py"])
def test_every_key_takes_only_the_values_it_means_something_by(script, tmp_path):
    """Each key of each table, set by a config file (on the command line a string key's None is
    the text "None"): None refused by name unless it is the default; a None default's other values
    of its kind (--micro_batch=2.5 was a TypeError mid-run, --ckpt_interval=1.5 and
    --depth_stride=True passed silently); an empty path refused (it meant the current folder)."""
    keys, parse = key_tables()[script]
    config = tmp_path / "c.py"
    for name, key in keys.items():
        for value in ((None,) if key.default is not None else (2.5, True)):
            config.write_text(f"{name} = {value!r}\n")
            expected = (f"--{name}=None: give a value" if value is None
                        else f"--{name}: expected {key.kind.__name__} or None")
            with pytest.raises(ConfigError, match=expected):
                parse([str(config)])
    paths = [name for name, key in keys.items() if key.path]
    assert paths == {"train.py": ["dataset", "data_root", "out_dir"], "ablate.py": ["base", "out"],
                     "bench_cache.py": []}[script]
    for name in paths:
        with pytest.raises(ConfigError, match=f"--{name} is empty; give a name or a path, e.g. "
                                              f"the default --{name}="):
            parse([f"--{name}="])


@pytest.mark.parametrize("argv, message", [
    (["--depth_mode=Value"], "--depth_mode=Value is not a choice; did you mean value? choices: "
                             "vanilla, value, uniform, key, kv, lime"),
    (["--depth_mode=value=value"], "--depth_mode=value=value is not a choice; did you mean value?"),
    (["--depth_mode=foo"], "--depth_mode=foo is not a choice; choices: vanilla, value"),
    (["--attention=Keyless"], "--attention=Keyless is not a choice; did you mean keyless?"),
    (["--residual=Add"], "--residual=Add is not a choice; did you mean add?"),
    (["--dtype=Float32"], "--dtype=Float32 is not a choice; did you mean float32?"),
    (["--parallel=FSDP"], "--parallel=FSDP is not a choice; did you mean fsdp?"),
])
def test_train_checks_every_choice_from_the_table_naming_the_nearest(argv, message):
    """The model's choices too: they used to pass parse_args and meet the model's check (or a
    KeyError in run_config.ignored_keys) only when the run started."""
    from support import run_config
    with pytest.raises(ConfigError) as e:
        run_config.parse_args(argv)
    assert message in str(e.value), e.value
