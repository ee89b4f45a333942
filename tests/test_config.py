"""The one command-line dialect (configurator.py) and every script's table in it: values typed like
the default, each key's range, choice, kind and path rule, None only where it means something,
config files (in order, base_config), positionals and lists, ~ expanded, the nearest key or file
named for a slip; a user error is one line and exit 2 from every script, a bug a traceback; the
shipped config files resolve."""

import pytest
import torch

import bench_cache
import prepare_data
import sample
import train
from checkpoint import build_model
from configurator import ConfigError, Key, ShowHelp, UserError, parse, run_main
from helpers import ROOT, assert_one_error_line, cli
from lab import export

KEYS = {"n_layer": Key(12, "blocks", ">= 1"), "lr": Key(1e-3, "rate", "> 0"),
        "stride": Key(None, "every", kind=int), "name": Key("run", "a name"),
        "compile": Key(False, "fast"), "mode": Key("a", "how", choices=("a", "b")),
        "out": Key("out", "where", path=True), "inputs": Key((), "files")}
DEFAULTS = {k: key.default for k, key in KEYS.items()}


def parse_with_files(argv, keys=KEYS):
    """configurator.parse as train.py calls it: a positional is a config file."""
    return parse(argv, keys, files=train.read_config_file)
# every script's table and the command line it needs besides the option tested
SCRIPTS = {"train.py": (train.table(True), []), "sample.py": (sample.KEYS, []),
           "prepare_data.py": (prepare_data.KEYS, ["text"]), "lab/export.py": (export.KEYS,
                                                                                ["A", "B"]),
           "bench_cache.py": (bench_cache.KEYS, [])}
PARSE = {"train.py": train.parse_args, "bench_cache.py": bench_cache.parse_args,
         **{s: (lambda keys: lambda argv: parse(argv, keys))(SCRIPTS[s][0])
            for s in ("sample.py", "prepare_data.py", "lab/export.py")}}
# a value each rule refuses
OUTSIDE = {"> 0": 0, ">= 0": -1, ">= 1": 0, "in [0, 1)": 1, "in [0, 1]": 2, "in (0, 0.5]": 0.9,
           "in [0, 2**63)": 2**63}


def test_values_are_typed_like_the_default_in_either_spelling(tmp_path):
    """--key=value, --key value and a bare --flag mean the same; a boolean takes a following
    true/false/1/0 (any case) and leaves anything else (a config file) alone; a negative number is
    a value; a tuple key takes the values up to the next option; None where the default is."""
    want = {**DEFAULTS, "n_layer": 4, "lr": 1.0, "compile": True, "name": "123", "stride": 3}
    for argv in (["--n_layer=4", "--lr=1", "--compile=True", "--name=123", "--stride=3"],
                 ["--n_layer", "4", "--lr", "1", "--compile", "--name", "123", "--stride", "3"],
                 ["--compile", "TRUE", "--n_layer", "4", "--lr=1.0", "--name=123", "--stride=3"]):
        cfg = parse(argv, KEYS)
        assert cfg == want and isinstance(cfg["lr"], float) and cfg["name"] == "123", argv
    assert parse(["--compile", "0"], KEYS)["compile"] is False
    assert parse(["--lr", "-1", "--n_layer=2"], {**KEYS, "lr": Key(1.0)})["lr"] == -1.0
    assert parse(["--stride=None"], KEYS)["stride"] is None
    assert parse(["--inputs", "a", "b", "--n_layer=2"], KEYS)["inputs"] == ("a", "b")
    assert parse(["--inputs=a"], KEYS)["inputs"] == ("a",)
    (tmp_path / "c.py").write_text("n_layer = 3\ninputs = ['x', 'y']\n")
    assert parse_with_files(["--compile", str(tmp_path / "c.py")]) == {
        **DEFAULTS, "compile": True, "n_layer": 3, "inputs": ("x", "y")}


@pytest.mark.parametrize("argv, named", [
    (["--n_layers=4"], "did you mean --n_layer?"),  # a typo: the nearest key
    (["--N_LAYER=2"], "did you mean --n_layer?"),  # another case
    (["-n_layer=3"], "--n_layer=3"),  # one dash
    (["--zzz=4"], "n_layer"),  # hopeless: every key
    (["--n_layer"], "--n_layer needs a value"),
    (["--n_layer", "--lr=1"], "--n_layer needs a value"),
    (["--n_layer=1.5"], "--n_layer"),
    (["--compile=maybe"], "--compile"),
    (["--stride=2.5"], "--stride"),  # a None default's other values are of its kind
    (["--stride=True"], "--stride"),
    (["--n_layer=None"], "--n_layer=None"),  # None only where it is the default
    (["--n_layer=0"], "--n_layer"),  # a range
    (["--lr=1e999"], "--lr"),  # not finite
    (["--mode=A"], "did you mean a?"),  # a choice
    (["--out="], "--out"),  # an empty path: it would mean the current folder
    (["--out=None"], "--out"),
    (["--help=1"], "help"),
    (["--", "--n_layer=2"], "--"),
    (["missing.py"], "missing.py"),
], ids=str)
def test_a_slip_is_a_config_error_naming_the_key_and_the_fix(argv, named):
    with pytest.raises(ConfigError) as e:
        parse_with_files(argv)
    assert named in str(e.value) and "\n" not in str(e.value), e.value


def test_help_lists_every_key_with_its_default_help_and_choices():
    with pytest.raises(ShowHelp) as e:
        parse(["--n_layer=3", "--help"], KEYS, "the doc")
    lines = str(e.value).splitlines()
    assert lines[0] == "the doc"
    for name, key in KEYS.items():
        line = next(l for l in lines if l.strip().startswith(f"--{name}={key.default!r}"))
        assert key.help in line
    assert "one of ('a', 'b')" in next(l for l in lines if "--mode=" in l)


def test_config_files_apply_in_order_and_inherit_through_base_config(tmp_path, monkeypatch):
    """train.py's (bench_cache.py and lab/ablate.py read them through it); another script takes
    no config file."""
    (tmp_path / "base.py").write_text("n_layer = 8\nname = 'base'\nlr = 3e-4\n")
    (tmp_path / "child.py").write_text("base_config = 'base.py'\nname = 'child'\n")
    (tmp_path / "delta.py").write_text("lr = 2e-3\n")
    cfg = parse_with_files([str(tmp_path / "child.py"), str(tmp_path / "delta.py"), "--n_layer=2"])
    assert cfg == {**DEFAULTS, "n_layer": 2, "name": "child", "lr": 2e-3}
    monkeypatch.setenv("HOME", str(tmp_path))  # ~ is expanded in a file's path and a path key
    assert parse_with_files(["~/delta.py", "--out=~/runs/a"]) == {**DEFAULTS, "lr": 2e-3,
                                                              "out": f"{tmp_path}/runs/a"}
    for text, named in [("base_config = 'loop.py'\n", "includes itself"),
                        ("N_layer = 2\n", "did you mean n_layer?"),  # the file and the key
                        ("n_layer = = 3\n", "line 1"), ("n_layer = 1 / 0\n", "line 1"),
                        ("base_config = 3\n", "base_config"), ("stride = 2.5\n", "--stride"),
                        ("compile = None\n", "--compile=None")]:
        (tmp_path / "loop.py").write_text(text)
        with pytest.raises(ConfigError, match=named) as e:
            parse_with_files([str(tmp_path / "loop.py")])
        assert "\n" not in str(e.value)
    (tmp_path / "latin.py").write_bytes(b"name = 'caf\xe9'\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        parse_with_files([str(tmp_path / "latin.py")])
    with pytest.raises(ConfigError, match="did you mean .*delta.py"):  # the nearest sibling
        parse_with_files([str(tmp_path / "delt.py")])
    with pytest.raises(ConfigError, match="delta.py"):
        parse([str(tmp_path / "delta.py")], KEYS)


def test_positionals_fill_in_order_and_options_come_anywhere():
    a = parse(["--overwrite", "src", "--dtype", "bfloat16", "dst"], export.KEYS)
    assert (a["src"], a["out_dir"], a["dtype"], a["overwrite"]) == ("src", "dst", "bfloat16", True)
    with pytest.raises(ConfigError, match="OUT_DIR"):
        parse(["src"], export.KEYS)
    with pytest.raises(ConfigError, match="'third'"):
        parse(["src", "dst", "third"], export.KEYS)
    assert parse(["text", "--input", "a", "b", "--force"], prepare_data.KEYS)["input"] == ("a",
                                                                                           "b")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_key_of_every_script_takes_only_what_it_means(script, tmp_path):
    """Each key of the script's table: a value outside its range or choices, an empty path, None
    where the default is not None, a None default's value of another kind: each a ConfigError
    naming the flag. train.py's from a config file too, where a string's None is None (on the
    command line it is the text "None")."""
    keys, pos = SCRIPTS[script]
    bad = [(name, f"--{name}={OUTSIDE[key.check]}") for name, key in keys.items() if key.check]
    bad += [(name, f"--{name}=nonesuch") for name, key in keys.items() if key.choices]
    bad += [(name, f"--{name}=") for name, key in keys.items() if key.path and not key.positional]
    for name, key in keys.items():
        if key.default is None and key.kind not in (str, None):
            bad.append((name, f"--{name}=x"))
        elif key.default is not None and not isinstance(key.default, (str, tuple)):
            bad.append((name, f"--{name}=None"))
        if script == "train.py" and not isinstance(key.default, tuple):
            other = None if key.default is not None else \
                next(v for v in ("x", 2.5) if not isinstance(v, key.kind))
            bad.append((name, f"{name} = {other!r}\n"))
    for name, arg in bad:
        if not arg.startswith("--"):
            (tmp_path / "c.py").write_text(arg)
            arg = str(tmp_path / "c.py")
        with pytest.raises(ConfigError, match=f"--{name}") as e:
            PARSE[script]([*pos, arg])
        assert "\n" not in str(e.value), e.value


def test_train_takes_the_baselines_keys_and_checks_every_choice_of_its_table():
    assert train.parse_args(["--residual=mhc", "--depth_mode=vanilla"])["residual"] == "mhc"
    for argv, near in [(["--depth_mode=Value"], "value"), (["--dtype=Float32"], "float32"),
                       (["--parallel=FSDP"], "fsdp"), (["--init_lr=Peak"], "peak"),
                       (["--residual=Add"], "add"), (["--attention=Keyless"], "keyless")]:
        with pytest.raises(ConfigError, match=f"did you mean {near}\\?"):
            train.parse_args(argv)


@pytest.mark.parametrize("script, argv, near", [
    ("train.py", ["--n_layers=3"], "--n_layer"),
    ("sample.py", ["--temprature", "0.5"], "--temperature"),
    ("sample.py", ["-max_new_tokens=3"], "--max_new_tokens"),
    ("prepare_data.py", ["text", "--val_frac=0.2"], "--val_fraction"),
    ("lab/export.py", ["A", "B", "--overwrit"], "--overwrite"),
    ("bench_cache.py", ["--modez=value"], "--modes"),
    ("course/make.py", ["X", "--Overwrite"], "--overwrite"),
])
def test_every_script_says_a_slip_in_one_line_and_exits_2(script, argv, near):
    code, out, err = cli(script, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert_one_error_line(code, out, err, near)


@pytest.mark.parametrize("script", [*SCRIPTS, "course/make.py"])
def test_every_script_answers_help_with_every_key(script):
    code, out, err = cli(script, "-h" if script == "train.py" else "--help")
    assert code == 0 and "keys (--key=value" in out and not err, err
    keys = train.table() if script == "train.py" else SCRIPTS.get(script, ({},))[0]
    for name, key in keys.items():
        line = next((line for line in out.splitlines() if line.strip().startswith(
            name.upper() if key.positional else f"--{name}=")), "")
        assert key.help in line, name
    assert "--overwrite" in out or script != "course/make.py"


@pytest.mark.parametrize("script", SCRIPTS)
def test_parsing_a_command_reads_and_writes_no_file(script, tmp_path, monkeypatch):
    """A documented command can be checked without its files: nothing is opened or made."""
    monkeypatch.chdir(tmp_path)
    argv = {"train.py": ["--out_dir=out/RUN", "--init_from=out/OLD", "--dataset=x"],
            "sample.py": ["--init_from=out/RUN", "--prompt_file=nowhere.txt"],
            "prepare_data.py": ["text", "--input", "a.txt", "b.txt", "--name", "mydata"],
            "lab/export.py": ["out/RUN", "out/RUN_hf", "--overwrite"],
            "bench_cache.py": ["--json=out/bench.json", "--device=cpu"]}[script]
    PARSE[script](argv)
    assert not list(tmp_path.iterdir())


def bug(*args, **kwargs):
    raise ValueError("a bug in a fork's new mode")


@pytest.mark.parametrize("script, module, name, argv", [
    ("sample.py", "checkpoint", "load_model", ["--init_from=RUN"]),
    ("lab/export.py", "checkpoint", "load_model", ["RUN", "OUT"]),
    ("prepare_data.py", "tokenizer", "get_tokenizer", ["text", "--input", "meta.json"]),
    ("train.py", "data", "load_meta", ["--dataset=x", "--out_dir=RUN"]),
])
def test_a_bug_below_a_script_is_a_traceback_not_a_user_error(script, module, name, argv,
                                                              monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "x").mkdir(parents=True)
    for meta in (tmp_path / "meta.json", tmp_path / "data" / "x" / "meta.json"):
        meta.write_text("{}")
    monkeypatch.setattr(__import__(module), name, bug)
    code, out, err = cli(script, *argv)
    assert code == 1 and "Traceback" in err and "a bug in a fork's new mode" in err, err
    assert "error:" not in err


def test_the_entry_point_guard(capsys):
    """A user error (a model.ConfigError too) is one line and exit 2, Ctrl-C `interrupted` and
    130, --help 0; anything else propagates as a bug."""
    from model import ConfigError as ModelConfigError

    def raising(e):
        def main(argv):
            raise e
        return main
    for e, code, said in [(ConfigError("--x must be 1"), 2, "error: --x must be 1\n"),
                          (UserError("no room"), 2, "error: no room\n"),
                          (ModelConfigError("n_head"), 2, "error: n_head\n"),
                          (KeyboardInterrupt("the last checkpoint is intact"), 130,
                           "interrupted; the last checkpoint is intact\n"),
                          (ShowHelp("the help"), 0, "")]:
        assert run_main(raising(e), []) == code
        assert capsys.readouterr().err == said
    with pytest.raises(RuntimeError):
        run_main(raising(RuntimeError("bug")), [])


def resolve(*names):
    cfg = train.parse_args([str(ROOT / "configs" / n) for n in names])
    with torch.device("meta"):  # the model builds
        build_model({k: v for k, v in {**cfg, "vocab_size": cfg["vocab_size"] or 257}.items()
                     if k not in train.KEYS})
    return cfg


def test_the_shipped_config_files_resolve():
    """Every shipped config (ablations on top of their base) names only known keys and builds;
    any world size of 1, 2 or 8 splits its batch; each vanilla twin differs from its value run in
    depth_mode, out_dir and the stride it has no use for; shakespeare.py is the default."""
    runs = {p.name: resolve(p.name) for p in (ROOT / "configs").glob("*.py")}
    assert runs["shakespeare.py"] == train.parse_args([])
    for name, cfg in runs.items():
        for world in (1, 2, 8):
            mb, accum, rows = train.batch_layout(cfg, world)
            assert mb * accum * world == rows == cfg["batch_tokens"] // cfg["block_size"], name
    for name in [n for n in runs if n.endswith("_vanilla.py")]:
        twin, ours = runs[name.replace("_vanilla", "_value")], runs[name]
        assert {k for k in ours if ours[k] != twin[k]} <= {"depth_mode", "out_dir",
                                                           "depth_stride"}, name
        assert ours["depth_stride"] is None and ours["depth_mode"] == "vanilla", name
    deltas = [p.name for p in (ROOT / "configs" / "ablations").glob("*.py")
              if p.name not in ("base.py", "cpu.py")]
    for base in ("base.py", "cpu.py"):  # the GPU and the CPU base take the same deltas
        ablations = {d: resolve(f"ablations/{base}", f"ablations/{d}") for d in deltas}
        half, value = ablations["stride_half.py"], ablations["mode_value.py"]
        assert {k for k in half if half[k] != value[k]} == {"depth_stride", "out_dir"}
        assert value["depth_stride"] is None and half["depth_stride"] == value["n_layer"] // 2
