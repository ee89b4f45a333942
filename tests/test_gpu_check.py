"""gpu_check.py on the CPU: it refuses to run without a GPU unless asked for the CPU, a tiny CPU run goes through
every section and writes one JSON with sane figures (the attention kernels SDPA picks, no graph break), a graph
break is counted, a failing section is recorded while the others run, a SIGTERM records the section it cut off
and keeps the finished ones, and bad flags stop it with one `error:` line before any model is built."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gpu_check

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 256
# The 1.5B config's keys, shrunk; eager is torch.compile's tracing without code generation (inductor on a CPU
# spends ~20 s compiling), enough to run the compiled section's path.
TINY = ["--device=cpu", "--n_layer=2", "--n_embd=64", "--n_head=4", "--n_kv_head=2", "--head_dim=16",
        "--mlp_hidden=128", "--block_size=64", f"--vocab_size={VOCAB}", "--micro_batch=2", "--warmup=1",
        "--steps=2", "--bench_batch=2", "--prompt_len=32", "--new_tokens=4", "--repeats=1", "--compile_backend=eager"]


@pytest.fixture
def one_thread():
    """In-process runs on one thread: on a shared 2-core machine a descheduled second thread stalls every op of
    a tiny model (10x slower), as bench_cache.py's --threads=1 default says."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_refuses_in_one_line():
    proc = subprocess.run([sys.executable, "gpu_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: gpu_check.py needs a CUDA GPU") and proc.stderr.count("\n") == 1, proc.stderr
    assert not proc.stdout


def test_a_tiny_cpu_run_writes_every_section(tmp_path, capsys, one_thread):
    out = tmp_path / "check.json"
    returned = gpu_check.main([*TINY, f"--json={out}"])
    res = json.loads(out.read_text())
    assert res == json.loads(json.dumps(returned))  # the file is the whole result
    assert list(res["sections"]) == list(gpu_check.SECTIONS) and res["ok"]
    assert res["torch"] == torch.__version__ and res["device"] == "cpu" and res["gpu"] is None
    assert res["cut_off"] is None
    assert all(s["ok"] and s["seconds"] > 0 for s in res["sections"].values())
    assert res["seconds"] >= sum(s["seconds"] for s in res["sections"].values())

    flash = res["sections"]["flash"]
    assert flash["prompt"] == 16 and flash["chunk"] == 8  # a quarter and an eighth of block_size
    cpu_flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    for mode, r in flash["modes"].items():  # the CPU's flash kernel takes every call, masked ones too
        assert all(r[p]["ok"] for p in gpu_check.FLASH_PATHS), (mode, r)
        # left to itself SDPA picks the same kernel; the profile sees the backward's too (the depth step's call in
        # value's decode is the same kernel), and the public entry point is not listed
        assert r["train"]["default_kernels"] == [cpu_flash, cpu_flash + "_backward"], (mode, r)
        assert all(r[p]["default_kernels"] == [cpu_flash] for p in ("prefill", "decode", "chunk")), (mode, r)
        assert list(r["chunk"]["backends"]) == gpu_check.BACKENDS
        refused = r["chunk"]["backends"]["EFFICIENT_ATTENTION"]  # a CUDA-only kernel: refused, with torch's error
        assert not refused["ok"] and refused["error"].startswith("No viable backend for scaled_dot_product_attention")
    assert {"FLASH_ATTENTION", "MATH"} <= set(flash["chunk_runs_on"]["value"])  # math takes any call

    bench = res["sections"]["bench"]
    assert "--preset=paper_1p5b" in bench["command"] and "--n_layer=2" in bench["command"]
    assert bench["bench_cache"]["config"]["n_layer"] == 2 and bench["bench_cache"]["config"]["n_embd"] == 64
    assert bench["vanilla"]["cache_bytes"] == bench["value"]["cache_bytes"] > 0  # the paper's claim, measured
    assert bench["value_vs_vanilla"]["cache_bytes"] == 1.0
    ratios = bench["value_vs_vanilla"]  # times only: a tiny model's peak RSS can be within page noise of 0
    assert all(math.isfinite(ratios[m]) and ratios[m] > 0 for m in ("prefill_s", "decode_s_per_token", "train_step_s"))

    for name, compiled in (("train_eager", False), ("train_compile", True)):
        sec = res["sections"][name]
        assert sec["compile"] is compiled and sec["seq_len"] == 64 and sec["steps"] == 2
        van, val = sec["modes"]["vanilla"], sec["modes"]["value"]
        assert van["num_params"] == val["num_params"]  # Depth-Attention adds no parameter
        for r in (van, val):
            assert r["tokens_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(2 * 64 / r["step_s"])
            assert r["first_step_s"] > 0 and r["peak_gib"] is None  # peak memory is measured on CUDA only
            assert (r["planned_gib"] is None) if compiled else r["planned_gib"] > 0  # memory.py plans eager steps
            # near-uniform logits at init give ln(vocab) on random tokens; steps on the same batch only lower it
            assert 0 < r["loss"] < math.log(VOCAB) + 0.05, r["loss"]
            if compiled:  # the tiny model's step compiles to one graph: no break hides behind its speed
                assert r["graph_breaks"] == 0 and r["graphs"] == 1, r["graph_break_reasons"]
            else:
                assert r["graph_breaks"] is r["graph_break_reasons"] is r["graphs"] is None
        assert sec["value_vs_vanilla"] == {"tokens_per_s": val["tokens_per_s"] / van["tokens_per_s"], "peak_gib": None}

    printed = capsys.readouterr().out
    assert "section" in printed and "value/vanilla tokens/s" in printed and f"wrote {out}" in printed
    assert "unrestricted, SDPA runs: vanilla train flash, prefill flash, decode flash, chunk flash;" in printed
    assert "graph breaks vanilla 0, value 0" in printed


def test_a_graph_break_is_counted(monkeypatch, one_thread):
    """The counter that reads 0 above does count: a break put in front of the model's forward is one break."""
    class Broken(gpu_check.Parallel):
        def __init__(self, *args):
            super().__init__(*args)
            model = self.forward

            def forward(*inputs):
                torch._dynamo.graph_break()
                return model(*inputs)
            self.forward = forward
    monkeypatch.setattr(gpu_check, "Parallel", Broken)
    cfg = gpu_check.resolve([*TINY, "--steps=1"])
    r = gpu_check.train_run(cfg, "vanilla", True)
    assert r["graph_breaks"] == 1 and list(r["graph_break_reasons"].values()) == [1], r["graph_break_reasons"]
    assert "graph_break()" in next(iter(r["graph_break_reasons"]))


def test_a_failing_section_is_recorded_and_the_others_run(tmp_path, monkeypatch, one_thread):
    def broken(cfg, out):
        out["finished"] = "before the error"
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setitem(gpu_check.RUN, "bench", broken)
    out = tmp_path / "check.json"
    with pytest.raises(SystemExit) as stop:
        gpu_check.main([*TINY, "--only=bench,train_eager", f"--json={out}"])
    assert stop.value.code == (f"error: section(s) bench failed (see {out}); fix them and rerun with --only=bench")
    res = json.loads(out.read_text())
    assert res["sections"]["bench"]["error"] == "RuntimeError: boom" and not res["ok"]
    assert res["sections"]["bench"]["finished"] == "before the error"  # what it finished is kept
    assert res["sections"]["train_eager"]["ok"]


def test_a_sigterm_records_the_section_it_cut_off_and_keeps_the_finished(tmp_path, monkeypatch, capsys,
                                                                         one_thread):
    """What `timeout` does to a run that overstays: the JSON (written whole each time, never half) keeps the
    finished sections and what the cut-off one had finished, and the error names the --only that runs the rest."""
    def overstays(cfg, out):
        out["modes"] = {"vanilla": "done"}
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler interrupts this
        raise AssertionError("SIGTERM did not stop the section")
    monkeypatch.setitem(gpu_check.RUN, "bench", overstays)
    out = tmp_path / "check.json"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        gpu_check.main([*TINY, "--only=flash,bench,train_eager", f"--json={out}"])
    assert stop.value.code == (f"error: cut off by SIGTERM in bench; --only=bench,train_eager runs the rest (with its "
                               f"own --json: {out} keeps the sections finished)")
    assert signal.getsignal(signal.SIGTERM) == before  # main leaves the handler as it found it
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left beside it
    res = json.loads(out.read_text())
    assert list(res["sections"]) == ["flash", "bench"] and not res["ok"]
    assert res["cut_off"] == "cut off by SIGTERM in bench; --only=bench,train_eager runs the rest"
    assert res["sections"]["flash"]["ok"] and res["sections"]["flash"]["chunk_runs_on"]
    bench = res["sections"]["bench"]
    assert not bench["ok"] and bench["error"].startswith("cut off by SIGTERM after ") and bench["seconds"] < 30
    assert bench["modes"] == {"vanilla": "done"}
    printed = capsys.readouterr().out  # the summary table still prints, the cut-off section with its error
    assert "can run on flash alone" in printed and "cut off by SIGTERM after" in printed


@pytest.mark.parametrize("args, message", [
    (["--nope=1"], "unknown config key 'nope'; known keys:"),
    (["--only=flash,speed"], "--only=flash,speed: choose comma-separated sections from flash, bench, train_eager, "
                             "train_compile"),
    (["--steps=0"], "--steps must be a finite number >= 1, got 0"),
    (["--micro_batch=two"], "--micro_batch: expected int like the default 4, got 'two'"),
    (["--device=tpu"], "unknown device 'tpu'"),
    (["--n_head=5"], "n_head (5) must be a multiple of n_kv_head (6)"),
    (["--only=flash", "--block_size=8"], "the flash section needs --block_size >= 16"),
    (["--json={tmp}/"], "is a folder; give a file name"),
], ids=lambda a: a[0] if isinstance(a, list) else None)
def test_bad_flags_stop_in_one_line_before_any_work(args, message, tmp_path, monkeypatch):
    def run(cfg, out):
        raise AssertionError("a section ran before the flags were checked")
    monkeypatch.setattr(gpu_check, "RUN", {name: run for name in gpu_check.SECTIONS})
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--device=cpu", *(a.format(tmp=tmp_path) for a in args)])
    msg = str(stop.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and message in msg, msg
