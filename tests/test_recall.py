"""lab/recall.py, the associative-recall check of Keyless Attention: the task's targets are the
values the sequence paired with its queries and nothing else, a seed gives the same sequences, and
a tiny run writes all four variants' accuracies."""
import json

import pytest
import torch

from configurator import ConfigError
from lab import recall


def batch(seed, **shape):
    shape = {"batch": 16, "pairs": 5, "n_keys": 7, "n_values": 3, **shape}
    return recall.recall_batch(generator=torch.Generator().manual_seed(seed), **shape)


def test_each_query_targets_the_value_paired_with_its_key_and_a_seed_repeats():
    idx, targets = batch(0)
    assert idx.shape == targets.shape == (16, 15)
    for row, target in zip(idx.tolist(), targets.tolist()):
        keys, values, queries = row[0:10:2], row[1:10:2], row[10:]
        assert len(set(keys)) == 5 and all(0 <= k < 7 for k in keys)
        assert all(7 <= v < 10 for v in values)
        assert sorted(queries) == sorted(keys)  # every key asked again, once
        paired = dict(zip(keys, values))
        assert target == [-1] * 10 + [paired[q] for q in queries]
    assert all(torch.equal(a, b) for a, b in zip(batch(3), batch(3)))
    assert not torch.equal(batch(3)[0], batch(4)[0])


def test_a_tiny_run_writes_the_four_variants_accuracies(tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "recall.json"
    recall.main(["--steps=3", "--heads=1,2", "--seeds=0,1", "--pairs=2", "--n_keys=4",
                 "--n_values=4", f"--json={out}"])
    runs = json.loads(out.read_text())["runs"]
    assert {(r["variant"], r["heads"], r["seed"]) for r in runs} == {
        (v, h, s) for v in ("vanilla", "value", "keyless", "keyless+value")
        for h in (1, 2) for s in (0, 1)}
    assert all(0 <= r["accuracy"] <= 1 for r in runs)
    printed = capsys.readouterr().out
    assert "| keyless+value |" in printed and "| variant | 1 head | 2 heads |" in printed
    assert torch.get_num_threads() == threads  # the run's one thread is not left to other tests
    recall.main(["--steps=1", "--heads=1", "--seeds=0", f"--json={out}"])  # its own: replaced
    for bad in (["--heads=3"], ["--seeds=a"], ["--pairs=9", "--n_keys=4"]):
        with pytest.raises(ConfigError):
            recall.main(bad)
