"""Checkpoints and Hugging Face folders written before the baselines' keys left ModelConfig (the
old flat dict of every field) still load and sample exactly; a plain run that set a baseline knob
still resumes; and a checkpoint from a newer version, with a key this code does not know, is one
error."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import tiny_model
import sample
from support import hf
from support.checkpoint import CheckpointError, load_model, model_from_checkpoint
from support.run_dir import save_checkpoint
from support.tokenizer import get_tokenizer
from helpers import ROOT, TINY_SHORT, train

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


def test_a_moved_name_says_where_it_went():
    """What moved in the split of baselines.py and of the package: an import names the new place,
    and the old command prints the new one in one line, exiting non-zero."""
    with pytest.raises(ImportError, match="from support.variants import build_model"):
        from baselines import build_model  # noqa: F401
    proc = subprocess.run([sys.executable, "-m", "support.recall", "--steps=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "support.recall moved: run `python -m experiments.recall` (same flags)"], proc.stderr
