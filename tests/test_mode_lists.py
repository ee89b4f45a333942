"""Every list of depth modes follows the table, model.DEPTH_MODES: the README's table of modes and
ablate.py's runs (each with its delta file) have one entry per row, so a new row cannot be left out
of them."""
import re

import ablate
from baselines import DEPTH_MODES
from support.config import read_config_file
from helpers import ROOT


def test_every_list_of_modes_follows_the_table():
    """The README's table of depth modes and ablate.py's runs (each with its delta file) are the
    rows of model.DEPTH_MODES; train.py --help and bench_cache.py --help list them from the table
    itself."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| `depth_mode` |"):]
    rows = re.findall(r"^\| `(\w+)` \|", table[:table.index("\n\n")], re.M)[1:]  # under the header
    assert sorted(rows) == sorted(DEPTH_MODES), (f"README's mode table: {rows}, "
                                                 f"the table: {list(DEPTH_MODES)}")
    for mode in DEPTH_MODES:
        delta = ROOT / "configs" / "ablations" / f"mode_{mode}.py"
        assert delta.is_file(), (f"the row {mode!r} has no ablation run: add "
                                 f"{delta.relative_to(ROOT)} (depth_mode = {mode!r} and an "
                                 "out_dir, like mode_value.py)")
        assert read_config_file(delta)["depth_mode"] == mode
        assert ablate.RUNS[mode] == [f"mode_{mode}"]
