"""One error hierarchy and one command-line dialect for sample.py, export.py, prepare_data.py,
eval.py and bench_cache.py: --key=value and --key value, a bare --flag or --flag=True/False for a
boolean, an unknown key refused with the nearest known one in one line; a user error is that one
line, and a bug (any other exception, even a ValueError deep in support/) stays a traceback."""
import contextlib
import io

import pytest

import ablate
import bench_cache
import eval as eval_py
import export
import prepare_data
import sample
import train
from support.errors import EXIT_USER_ERROR, UserError, run_main

SCRIPTS = {"sample.py": sample, "export.py": export, "prepare_data.py": prepare_data,
           "eval.py": eval_py, "bench_cache.py": bench_cache}


def entry_point(module, argv):
    """(exit status, stderr) of `python SCRIPT argv` as its entry point runs it."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run_main(module.main, argv)
    return code, err.getvalue()


@pytest.mark.parametrize("script, both", [
    ("sample.py", (["--prompt=hi", "--num_samples=2"], ["--prompt", "hi", "--num_samples", "2"])),
    ("export.py", (["A", "B", "--dtype=bfloat16"], ["A", "B", "--dtype", "bfloat16"])),
    ("prepare_data.py", (["text", "--name=x", "--val_fraction=0.2"],
                         ["text", "--name", "x", "--val_fraction", "0.2"])),
    ("eval.py", (["--init_from=out/RUN", "--tasks=", "--ppl=pile", "--limit=0.5"],
                 ["--init_from", "out/RUN", "--tasks", "", "--ppl", "pile", "--limit", "0.5"])),
])
def test_both_dialects_give_one_command(script, both):
    equals, spaced = (vars(SCRIPTS[script].parse_args(argv)) for argv in both)
    assert equals == spaced


def test_the_table_scripts_take_both_dialects():
    """bench_cache, ablate and train parse through support.config: --key value is --key=value."""
    assert bench_cache.parse_args(["--repeats=3"]) == bench_cache.parse_args(["--repeats", "3"])
    assert train.parse_args(["--n_layer=3", "--compile=True"]) == train.parse_args(["--n_layer", "3",
                                                                                "--compile"])
    assert ablate.parse_args(["--seeds=2", "--overwrite=True"]) == ablate.parse_args(["--seeds", "2",
                                                                                  "--overwrite"])


@pytest.mark.parametrize("script, argv, flag", [
    ("export.py", ["A", "B"], "overwrite"),
    ("prepare_data.py", ["text"], "force"),
])
def test_a_boolean_is_a_bare_flag_or_a_value(script, argv, flag):
    parse = SCRIPTS[script].parse_args
    assert getattr(parse(argv), flag) is False
    for spelling, value in ((f"--{flag}", True), (f"--{flag}=True", True), (f"--{flag}=1", True),
                            (f"--{flag}=False", False), (f"--{flag}=0", False)):
        assert getattr(parse([*argv, spelling]), flag) is value, spelling
    assert getattr(parse([f"--{flag}", *argv]), flag) is True  # before the positionals, too
    with pytest.raises(UserError, match=f"--{flag}=maybe: give --{flag} alone"):
        parse([*argv, f"--{flag}=maybe"])


def test_flags_and_keys_take_the_same_boolean_words():
    """support.config.BOOL_WORDS, in any case, for an argparse flag and a table's key alike."""
    for word, value in (("TRUE", True), ("1", True), ("False", False), ("0", False)):
        assert export.parse_args(["A", "B", f"--overwrite={word}"]).overwrite is value, word
        assert train.parse_args([f"--compile={word}"])["compile"] is value, word
        assert train.parse_args(["--compile", word])["compile"] is value, word


@pytest.mark.parametrize("script, shown", [
    ("sample.py", "keep the k most likely tokens; 0 = all (default: 200)"),
    ("sample.py", "--num_samples NUM_SAMPLES (default: 1)"),  # an option without help text
    ("prepare_data.py", "(default: 0.1)"),
    ("eval.py", "examples in each prompt"),  # its own formatter, and its help names its defaults
])
def test_argparse_help_shows_each_default_once(script, shown, capsys):
    """support.argparser.ArgumentParser's --help: an option's default, unless unset (None, False, "") or
    already in its help; a script's own formatter_class (eval.py's raw docstring) still applies."""
    with pytest.raises(SystemExit) as done:
        SCRIPTS[script].parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
    assert done.value.code == 0 and shown in out
    assert "(default: None)" not in out and "(default: False)" not in out
    assert "default 16 (default" not in out  # eval.py's --batch_size says it itself


def test_a_script_formatter_class_is_kept(capsys):
    with pytest.raises(SystemExit):
        eval_py.parse_args(["--help"])
    assert next(line for line in eval_py.__doc__.splitlines()
                if line.startswith("    ")) in capsys.readouterr().out


@pytest.mark.parametrize("script, argv, nearest", [
    ("sample.py", ["--temprature=0.5"], "--temperature"),
    ("sample.py", ["--max_new_token", "5"], "--max_new_tokens"),
    ("export.py", ["A", "B", "--overwrit"], "--overwrite"),
    ("export.py", ["A", "B", "--over"], "--overwrite"),  # no abbreviations: a typo picks no flag
    ("prepare_data.py", ["text", "--val_frac=0.2"], "--val_fraction"),
    ("eval.py", ["--init_from=x", "--num_fewshots=5"], "--num_fewshot"),
    # one dash or another case: a slip, named as the key meant
    ("sample.py", ["-max_new_tokens=3"], "--max_new_tokens"),
    ("sample.py", ["--MAX_NEW_TOKENS", "3"], "--max_new_tokens"),
    ("prepare_data.py", ["text", "-force"], "--force"),
])
def test_an_unknown_key_names_the_nearest_in_one_line(script, argv, nearest):
    code, err = entry_point(SCRIPTS[script], argv)
    assert code == EXIT_USER_ERROR and err.count("\n") == 1 and err.startswith("error: "), err
    assert f"did you mean {nearest}?" in err and f"python {script} --help" in err


@pytest.mark.parametrize("script, argv, flag", [
    ("sample.py", ["--init_from="], "--init_from"),  # these fell back to out/shakespeare
    ("sample.py", ["--ckpt="], "--ckpt"),
    ("sample.py", ["--out_dir="], "--out_dir"),
    ("sample.py", ["--out_dir=x", "--prompt_file="], "--prompt_file"),
    ("eval.py", ["--init_from="], "--init_from"),
    ("eval.py", ["--init_from=x", "--json="], "--json"),  # wrote nothing, silently
    ("eval.py", ["--init_from=x", "--ppl=", "--data_root=x"], "--ppl"),
    ("eval.py", ["--init_from=x", "--ppl=pile", "--data_root="], "--data_root"),
    ("eval.py", ["--init_from=x", "--include_path="], "--include_path"),
    ("export.py", ["", "out_hf"], "src"),
    ("export.py", ["out/RUN", ""], "out_dir"),  # the current folder
    ("prepare_data.py", ["text", "--out_dir="], "--out_dir"),
    ("prepare_data.py", ["text", "--name="], "--name"),
    ("prepare_data.py", ["text", "--input", ""], "--input"),
    ("prepare_data.py", ["text", "--tokenizer="], "--tokenizer"),
])
def test_an_empty_path_is_one_line_naming_its_flag(script, argv, flag):
    """support.argparser.path, the key tables' Key.path rule for argparse: "" is no path."""
    code, err = entry_point(SCRIPTS[script], argv)
    assert code == EXIT_USER_ERROR and err.count("\n") == 1, err
    assert f"argument {flag}: is empty; give a name or a path" in err, err


def test_a_misspelt_dataset_names_the_prepared_one(tmp_path):
    """train.py's --dataset is a folder of --data_root: a typo names the nearest prepared there."""
    (tmp_path / "minipile").mkdir()
    (tmp_path / "minipile" / "meta.json").write_text("{}")
    with pytest.raises(UserError, match="did you mean --dataset=minipile\\? else run"):
        train.open_data({"data_root": str(tmp_path), "dataset": "MiniPile"}, True)


def test_bench_cache_refuses_an_unknown_key_in_one_line():
    code, err = entry_point(bench_cache, ["--modez=value"])
    assert code == EXIT_USER_ERROR and err.count("\n") == 1 and "modez" in err, err


def test_parse_args_reads_no_file(tmp_path, monkeypatch):
    """A documented command can be checked without its files: nothing is opened or made."""
    monkeypatch.chdir(tmp_path)
    sample.parse_args(["--init_from=out/RUN", "--prompt_file=nowhere.txt"])
    export.parse_args(["out/RUN", "out/RUN_hf", "--overwrite"])
    prepare_data.parse_args(["text", "--input", "a.txt", "b.txt", "--name", "mydata"])
    eval_py.parse_args(["--init_from=out/RUN", "--json=out/RUN/eval.json"])
    bench_cache.parse_args(["--json=out/bench.json"])
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- a bug is a traceback

def bug(*args, **kwargs):
    raise ValueError("a bug in a fork's new mode")


@pytest.mark.parametrize("script, where, argv", [
    ("sample.py", "load_model", ["--init_from=out/RUN"]),
    ("export.py", "load_model", ["nowhere", "out_hf"]),
    ("prepare_data.py", "prepare", ["text"]),
    ("eval.py", "load_model", ["--init_from=out/RUN", "--tasks=", "--ppl=tiny"]),
])
def test_a_bug_below_a_script_is_a_traceback_not_a_user_error(script, where, argv, monkeypatch,
                                                              tmp_path):
    monkeypatch.chdir(tmp_path)
    module = SCRIPTS[script]
    monkeypatch.setattr(module, where, bug)
    if script == "eval.py":  # the --ppl data is checked before the model loads
        monkeypatch.setattr(module, "open_ppl_data", lambda *a: None)
    with pytest.raises(ValueError, match="a bug in a fork's new mode"):
        run_main(module.main, argv)
    monkeypatch.setattr(module, where, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bug")))
    with pytest.raises(RuntimeError, match="bug"):
        run_main(module.main, argv)


def test_a_bug_inside_support_is_a_traceback(monkeypatch, tmp_path):
    """Deeper down: checkpoint.load_model no longer turns a ValueError into a CheckpointError."""
    from support import checkpoint
    monkeypatch.setattr(checkpoint, "read_checkpoint", bug)
    with pytest.raises(ValueError, match="a bug in a fork's new mode"):
        run_main(sample.main, [f"--init_from={tmp_path}"])
