"""The repository's shape and what it must keep reading: the root holds the design card's files and
the rest is the package support/; the import graph is layered (no cycle, model.py imports nothing of
the repository, not even inside a function, baselines.py only model.py, the package only those two
and its own modules below each, nothing a script); lists of modes follow the table; and checkpoints
and Hugging Face folders written before the baselines' keys left ModelConfig still load and sample
exactly."""
import ast
import json
import re

import pytest
import torch

import ablate
from baselines import DEPTH_MODES
from conftest import tiny_model
import sample
from support import hf
from support.checkpoint import CheckpointError, load_model, model_from_checkpoint, save_checkpoint
from support.config import read_config_file
from support.tokenizer import get_tokenizer
from helpers import ROOT, TINY_SHORT, train

# The root holds the design card's files, the paper's comparisons and the commands a user runs; the
# rest is the package support/, which the scripts import and nobody runs.
CARD = {"model", "baselines", "train", "sample", "prepare_data", "bench_cache", "eval", "ablate", "export"}
ROOT_MODULES = {p.stem: p for p in ROOT.glob("*.py") if not p.stem.startswith("test_")
                and p.stem != "conftest"}
PACKAGE = {f"support.{p.stem}": p for p in (ROOT / "support").glob("*.py") if p.stem != "__init__"}
MODULES = {**ROOT_MODULES, **PACKAGE}
SCRIPTS = CARD - {"model", "baselines"}

# ModelConfig's fields as checkpoints and exports stored them until the baselines got their own
# config: the decoder's and Depth-Attention's keys, then `residual` and the baselines' seven knobs
# at their defaults.
# The ModelConfig fields of the flat-dict checkpoint format (every field of the time).
OLD_MODEL_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "head_dim",
                  "n_embd", "mlp_hidden", "rope_theta", "qk_norm", "k_norm_after_rope",
                  "tie_embeddings", "norm_eps", "init_std", "depth_mode", "depth_stride",
                  "depth_recent_window", "n_loops")
OLD_BASELINE_KEYS = {"residual": "add", "denseformer_dwa_dilation": 1,
                     "denseformer_dwa_period": 1, "attnres_block_size": 12,
                     "attnres_recency_bias_init": 3.0, "mhc_num_streams": 4,
                     "mhc_alpha_init": 0.01, "mhc_sinkhorn_iters": 20}


def imports(path):
    """The repository modules a file imports anywhere: at the top, inside functions, in `if` blocks;
    a module of the package as support.NAME."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            if node.module == "support":
                found |= {f"support.{a.name}" for a in node.names}
    return {m if m.startswith("support.") else m.split(".")[0] for m in found} & MODULES.keys() - {
        f"support.{path.stem}" if path.parent.name == "support" else path.stem}


def test_the_root_is_the_design_card_and_the_rest_is_the_package():
    assert set(ROOT_MODULES) == CARD, f"the root's modules: {sorted(ROOT_MODULES)}"
    # copied into exports, not imported
    assert not (ROOT / "support" / "hf_remote" / "__init__.py").exists()


def test_the_import_graph_is_layered():
    graph = {name: imports(path) for name, path in MODULES.items()}
    assert graph["model"] == set(), f"model.py imports {graph['model']}"
    assert graph["baselines"] == {"model"}, f"baselines.py imports {graph['baselines']}"
    order = ast.get_docstring(ast.parse((ROOT / "support" / "__init__.py").read_text())).split("\n\n")[-1].split()
    assert sorted(order) == sorted(m.removeprefix("support.") for m in PACKAGE), order
    for name in PACKAGE:  # on model.py, baselines.py and the package's modules listed before it
        below = {"model", "baselines"} | {f"support.{m}" for m in order[:order.index(name[8:])]}
        assert graph[name] <= below, f"{name} imports {sorted(graph[name] - below)}"

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, (*seen, d))) for d in graph[a])
    cycles = sorted(name for name in graph if reaches(name, name))
    assert not cycles, f"modules on an import cycle: {cycles} ({ {n: sorted(graph[n]) for n in cycles} })"
    assert not {name for name, deps in graph.items() if deps & SCRIPTS}, "a module imports a script"


def test_the_course_stands_on_the_model_and_the_package_and_nothing_stands_on_it():
    """course/ (the assignment) reads model.py, baselines.py and support/, never a script; only its
    own test (tests/test_course.py) imports it, so the repository runs without it."""
    for path in (ROOT / "course").rglob("*.py"):
        found = {m for m in imports(path) if m in SCRIPTS}
        assert not found, f"{path.relative_to(ROOT)} imports the scripts {sorted(found)}"
    for path in [*ROOT.glob("*.py"), *(ROOT / "support").rglob("*.py"),
                 *(ROOT / "tests").glob("*.py")]:
        tree = ast.parse(path.read_text())
        users = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 and any(name.split(".")[0] == "course" for name in
                         ([a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]))]
        assert not users or path.name == "test_course.py", f"{path.relative_to(ROOT)} imports course"


@pytest.mark.parametrize("overrides", [dict(depth_mode="value"), dict(depth_mode="kv", n_loops=2),
                                       dict(depth_mode="vanilla", residual="mhc",
                                            mhc_num_streams=2)], ids=str)
def test_a_checkpoint_in_the_old_format_loads_and_samples_as_before(tmp_path, overrides, capsys):
    """A train.py checkpoint whose model_config is the old flat dict (every ModelConfig field of the
    time, the baselines' keys included) rebuilds the same model: the same class, weights, logits and
    greedy sample."""
    source = tiny_model(vocab_size=257, **overrides).eval()
    stored = {**OLD_BASELINE_KEYS, **{k: v for k, v in vars(source.config).items()
                                      if k in OLD_MODEL_KEYS or k in OLD_BASELINE_KEYS}}
    # The old format had exactly these 26 keys: a field added since (a fork's too) is not in it,
    # and loads with its default; if this fails, OLD_MODEL_KEYS lost one of the old fields.
    assert len(stored) == 26
    save_checkpoint({"model": source.state_dict(), "model_config": stored, "tokenizer": "bytes",
                     "step": 7, "best_val_loss": 2.0, "config": {}}, tmp_path / "ckpt.pt")
    idx = torch.randint(0, 257, (2, 9))
    rebuilt = model_from_checkpoint({"model_config": stored, "model": source.state_dict()}).eval()
    loaded = load_model(tmp_path)
    with torch.no_grad():
        for model in (rebuilt, loaded.model):
            assert type(model) is type(source) and torch.equal(model(idx)[0], source(idx)[0])
    assert loaded.step == 7
    sample.main([f"--out_dir={tmp_path}", "--prompt=ab", "--max_new_tokens=6", "--temperature=0",
                 "--device=cpu"])
    expected = source.generate(torch.tensor([[97, 98]]), 6, temperature=0)[0].tolist()
    assert capsys.readouterr().out.endswith("\n" + get_tokenizer("bytes").decode(expected) + "\n")


@pytest.mark.parametrize("overrides", [dict(depth_mode="value"), dict(depth_mode="vanilla")],
                         ids=str)
def test_an_export_in_the_old_format_loads_as_before(tmp_path, overrides):
    """An export whose config.json recorded the old flat ModelConfig dict (baseline keys at their
    defaults)."""
    source = tiny_model(**overrides).eval()
    hf.save_pretrained(source, tmp_path, None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[hf.OUR_CONFIG] = {**OLD_BASELINE_KEYS, **cfg[hf.OUR_CONFIG]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = hf.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert type(back.config) is type(source.config) and torch.equal(back(idx)[0],
                                                                        source(idx)[0])


def test_a_plain_run_with_a_baseline_knob_set_resumes(data_root, tmp_path, monkeypatch):
    """A plain model's checkpoint stores no baseline keys, so a knob the run set (and the run's
    config.json keeps) is no difference from the checkpoint's model: the run resumes, and only a
    real change is refused."""
    run = [*TINY_SHORT, f"--data_root={data_root}", f"--out_dir={tmp_path}", "--max_iters=4",
           "--eval_interval=2"]
    assert train(monkeypatch, *run, "--attnres_block_size=4", "--stop_at_step=2") is None
    assert "attnres_block_size" not in torch.load(tmp_path / "ckpt.pt",
                                                  weights_only=True)["model_config"]
    assert train(monkeypatch, f"--out_dir={tmp_path}", "--resume=True") is None
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 4
    error = train(monkeypatch, f"--out_dir={tmp_path}", "--resume=True", "--n_layer=3")
    assert "'n_layer': (2, 3)" in error and "attnres_block_size" not in error


def test_a_checkpoint_from_a_newer_version_is_one_error(tmp_path):
    source = tiny_model()
    stored = {**vars(source.config), "depth_gate": True}  # a key this code does not know
    save_checkpoint({"model": source.state_dict(), "model_config": stored, "tokenizer": "bytes"},
                    tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError,
                       match=r"unknown model keys \['depth_gate'\] \(from a newer version"):
        load_model(tmp_path)


def test_every_list_of_modes_follows_the_table():
    """The README's table of depth modes and ablate.py's runs (each with its delta file) are the
    rows of model.DEPTH_MODES; train.py --help and bench_cache.py --help list them from the table
    itself."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| `depth_mode` |"):]
    rows = re.findall(r"^\| `(\w+)` \|", table[:table.index("\n\n")], re.M)[1:]  # under the header
    assert sorted(rows) == sorted(DEPTH_MODES), f"README's mode table: {rows}, the table: {list(DEPTH_MODES)}"
    for mode in DEPTH_MODES:
        delta = ROOT / "configs" / "ablations" / f"mode_{mode}.py"
        assert delta.is_file(), (f"the row {mode!r} has no ablation run: add {delta.relative_to(ROOT)} "
                                 f"(depth_mode = {mode!r} and an out_dir, like mode_value.py)")
        assert read_config_file(delta)["depth_mode"] == mode and ablate.RUNS[mode] == [f"mode_{mode}"]


def test_the_gpu_command_names_only_known_flags():
    """docs/gpu.md's one command, resolved here as each script resolves its arguments (a key or
    value it would refuse stops with its error line): the page cannot drift from the scripts."""
    import bench_cache
    import train
    block = re.search(r"```bash\n(.*?)```", (ROOT / "docs" / "gpu.md").read_text(), re.S).group(1)
    words = " ".join(line.split("#")[0].rstrip(" \\") for line in block.splitlines()).split()
    commands = " ".join(words).split(" && ")
    bench = next(c for c in commands if c.startswith("python bench_cache.py")).split()[2:]
    assert bench_cache.resolve([a for a in bench
                                if not a.startswith("--json")])["preset"] == "paper_1p5b"
    trains = next(c for c in commands if "python train.py" in c)
    args = trains[trains.index("python train.py") + len("python train.py"):].split()
    for mode in ("value", "vanilla"):
        cfg = train.parse_args([a.replace("$mode", mode) for a in args])
        assert cfg["depth_mode"] == mode and cfg["n_embd"] == 1536 and cfg["max_iters"] == 12
