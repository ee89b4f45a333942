"""What earlier versions wrote still loads: a checkpoint whose model_config is the old flat dict
(the baselines' keys inside), one written before the checksums (with a warning), an export of the
old format, a token folder from before meta.json's dtype; a plain run that set a baseline knob
resumes; and a checkpoint from a newer version, with a key this code does not know, is one
error."""
import json

import numpy as np
import pytest
import torch

from checkpoint import build_model, load_model
from configurator import CheckpointError
from conftest import tiny_model
from data import load_meta, read_tokens
from helpers import TINY_SHORT, cli, train
from lab import hf
from lab.export import save_pretrained
from outputs import save_checkpoint
from tokenizer import get_tokenizer

# ModelConfig's fields as checkpoints and exports stored them until the baselines got their own
# config: the decoder's and Depth-Attention's keys, then `residual` and the baselines' seven knobs
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
def test_a_checkpoint_in_the_old_format_loads_and_samples_as_before(tmp_path, overrides):
    """model_config the old flat dict (26 keys, baselines' included), tokenizer a bare name: the
    same class, logits and greedy sample."""
    source = tiny_model(vocab_size=257, **overrides).eval()
    stored = {**OLD_BASELINE_KEYS, **{k: v for k, v in vars(source.config).items()
                                      if k in OLD_MODEL_KEYS or k in OLD_BASELINE_KEYS}}
    assert len(stored) == 26  # else OLD_MODEL_KEYS lost one of the old fields
    save_checkpoint({"model": source.state_dict(), "model_config": stored, "tokenizer": "bytes",
                     "step": 7, "best_val_loss": 2.0, "config": {}}, tmp_path / "ckpt.pt")
    idx = torch.randint(0, 257, (2, 9))
    loaded, rebuilt = load_model(tmp_path), build_model(stored)
    rebuilt.load_state_dict(source.state_dict())
    with torch.no_grad():
        for model in (rebuilt.eval(), loaded.model):
            assert type(model) is type(source) and torch.equal(model(idx)[0], source(idx)[0])
    assert loaded.step == 7
    code, out, err = cli("sample.py", f"--init_from={tmp_path}", "--prompt=ab",
                         "--max_new_tokens=6", "--temperature=0", "--device=cpu")
    expected = source.generate(torch.tensor([[97, 98]]), 6, temperature=0)[0].tolist()
    assert code == 0 and out.endswith("\n" + get_tokenizer("bytes").decode(expected) + "\n"), err


def test_a_checkpoint_without_checksums_loads_with_a_warning(tmp_path):
    source = tiny_model(vocab_size=257).eval()
    torch.save({"model": source.state_dict(), "model_config": vars(source.config),
                "tokenizer": "bytes"}, tmp_path / "old.pt")
    code, out, err = cli("sample.py", f"--init_from={tmp_path / 'old.pt'}", "--prompt=the",
                         "--max_new_tokens=0")
    assert code == 0 and "has no checksums" in err and out.endswith("the\n"), err


@pytest.mark.parametrize("overrides", [dict(depth_mode="value"), dict(depth_mode="vanilla")],
                         ids=str)
def test_an_export_in_the_old_format_loads_as_before(tmp_path, overrides):
    """config.json recording the old flat ModelConfig dict (baseline keys at their defaults)."""
    source = tiny_model(**overrides).eval()
    save_pretrained(source, tmp_path / "hf", None)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg[hf.OUR_CONFIG] = {**OLD_BASELINE_KEYS, **cfg[hf.OUR_CONFIG]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    back = hf.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert type(back.config) is type(source.config)
        assert torch.equal(back(idx)[0], source(idx)[0])


def test_a_token_folder_from_before_the_dtype_key_reads_as_uint16(tmp_path, data_root):
    meta = json.loads((data_root / "tiny" / "meta.json").read_text())
    del meta["dtype"]
    for name in ("train.bin", "val.bin"):
        (tmp_path / name).write_bytes((data_root / "tiny" / name).read_bytes())
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert read_tokens(tmp_path, "train", load_meta(tmp_path)).tolist() == np.fromfile(
        tmp_path / "train.bin", dtype=np.uint16).tolist()


def test_a_plain_run_with_a_baseline_knob_set_resumes(data_root, tmp_path, monkeypatch):
    """A plain model's checkpoint stores no baseline keys, so a knob the run set is no difference
    from the checkpoint's model: the run resumes, and only a real change is refused."""
    run = [*TINY_SHORT, f"--data_root={data_root}", f"--out_dir={tmp_path}", "--max_iters=4",
           "--eval_interval=2"]
    assert train(monkeypatch, *run, "--attnres_block_size=4", "--stop_at_step=2") is None
    stored = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert "attnres_block_size" not in stored["model_config"]
    assert train(monkeypatch, f"--out_dir={tmp_path}", "--resume") is None
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 4
    error = train(monkeypatch, f"--out_dir={tmp_path}", "--resume", "--n_layer=3")
    assert error.startswith("error:") and "n_layer" in error and "attnres" not in error, error


def test_a_checkpoint_from_a_newer_version_is_one_error(tmp_path):
    source = tiny_model()
    stored = {**vars(source.config), "depth_gate": True}  # a key this code does not know
    save_checkpoint({"model": source.state_dict(), "model_config": stored, "tokenizer": "bytes"},
                    tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="depth_gate") as e:
        load_model(tmp_path)
    assert "newer version" in str(e.value) and "\n" not in str(e.value)
