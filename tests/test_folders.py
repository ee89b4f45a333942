"""Every script that writes a folder writes only into one that is new, empty or its own
(support/folders.py): one table of foreign folders, each given to every writer with --overwrite,
must end in one error line and leave every file as it was. Then what a writer may do in its own
folder: --overwrite removes only the files its manifest lists."""
import os
import shutil
from pathlib import Path

import pytest

from conftest import tiny_model
from helpers import ROOT, TINY_SHORT, assert_one_error_line, cli, snapshot
from support import hf
from support.errors import ConfigError
from support.folders import MANIFEST, claim, manifest
from support.run_dir import save_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory, data_root):
    """The sources the writers read: a train.py run (inside runs/), an export of it, a corpus."""
    tmp = tmp_path_factory.mktemp("world")
    run = tmp / "runs" / "run"
    code, out, err = cli("train.py", *TINY_SHORT, "--max_iters=2", "--eval_interval=2",
                         f"--data_root={data_root}", f"--out_dir={run}")
    assert code == 0, err[-2000:]
    assert cli("export.py", run, tmp / "export")[0] == 0
    (tmp / "corpus").mkdir()
    (tmp / "corpus" / "a.txt").write_text("a small corpus of words. " * 400)
    return {"tmp": tmp, "run": run, "export": tmp / "export", "data": data_root}


def users_folder(where):
    where.mkdir()
    for name, text in [("config.json", '{"mine": 1}'), ("log.jsonl", "{}\n"), ("README.md", "card"),
                       ("ckpt.pt.tmp123", "not a torn write")]:
        (where / name).write_text(text)
    return where


# foreign folder -> (the folder given as the target, the folder whose files must stay)
FOREIGN = {
    "an export": lambda w, tmp: (w["export"], w["export"]),
    "a user's folder": lambda w, tmp: (users_folder(tmp / "mine"),) * 2,
    "the current folder": lambda w, tmp: (Path("."), users_folder(tmp / "here")),
    "an empty path": lambda w, tmp: ("", users_folder(tmp / "here")),
    "a parent of the run": lambda w, tmp: (w["run"].parent, w["run"].parent),
    "a symlink to a user's folder": lambda w, tmp: (
        os.symlink(users_folder(tmp / "target"), tmp / "link") or tmp / "link", tmp / "target"),
    "the command's own source": lambda w, tmp: (w["run"], w["run"]),
}
# writer -> its command line writing into folder, with --overwrite (world: the sources it reads;
# its source is the run, the corpus for prepare_data.py)
WRITERS = {
    "train.py": lambda f, w: ("train.py", *TINY_SHORT, "--max_iters=2", f"--data_root={w['data']}",
                              f"--out_dir={f}", "--overwrite=True", f"--init_from={w['run']}"),
    "export.py": lambda f, w: ("export.py", w["run"], f, "--overwrite"),
    "prepare_data.py": lambda f, w: ("prepare_data.py", "text", "--input", *(
        [f / "ckpt.pt"] if f == w["run"] else [w["tmp"] / "corpus"]), "--force", *(
            ["--out_dir", Path(f).resolve().parent, "--name", Path(f).resolve().name] if f
            else ["--out_dir", ""])),
    "ablate.py": lambda f, w: ("ablate.py", f"--out={f}", "--runs=vanilla", "--seeds=1",
                               f"--base={ROOT / 'configs/ablations/cpu.py'}", "--overwrite=True"),
    "course/make.py": lambda f, w: ("course/make.py", f, "--overwrite"),
}
OWN = {("export.py", "an export")}  # a writer's own folder: its --overwrite may replace it


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("foreign", FOREIGN)
def test_no_writer_touches_a_folder_it_did_not_make(writer, foreign, world, tmp_path,
                                                    monkeypatch):
    if (writer, foreign) in OWN:
        pytest.skip("the writer's own folder: test_overwrite_replaces_only_its_own_files")
    target, kept = FOREIGN[foreign](world, tmp_path)
    if foreign in ("the current folder", "an empty path"):
        monkeypatch.chdir(kept)
    before = snapshot(kept, world["run"], world["export"])
    code, out, err = cli(*WRITERS[writer](target, world))
    assert_one_error_line(code, out, err, "")
    assert snapshot(kept, world["run"], world["export"]) == before


def test_overwrite_keeps_what_the_writer_did_not_write(world, tmp_path):
    """train.py --overwrite in its own run deletes its files, not a user's notes; export.py and
    prepare_data.py replace a folder whole, so a user's file there is named and the folder kept."""
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    (run / "notes.txt").write_text("mine")
    code, out, err = cli("train.py", *TINY_SHORT, "--max_iters=2", "--eval_interval=2",
                         f"--data_root={world['data']}", f"--out_dir={run}", "--overwrite=True")
    assert code == 0, err[-2000:]
    assert (run / "notes.txt").read_text() == "mine" and "kept notes.txt" in out
    export = tmp_path / "export"
    shutil.copytree(world["export"], export)
    (export / "README.md").write_text("a model card")
    before = snapshot(export)
    code, out, err = cli("export.py", run, export, "--overwrite")
    assert_one_error_line(code, out, err, "README.md")
    assert snapshot(export) == before
    (export / "README.md").unlink()
    assert cli("export.py", run, export, "--overwrite")[0] == 0
    assert manifest(export)["written_by"] == "export.py, Depth-Attention"


def test_a_run_from_before_manifests_resumes_and_nothing_else_is_adopted(world, tmp_path):
    """A run folder an earlier train.py made (a lock and a checkpoint, no manifest) is still
    train.py's; a folder holding only a checkpoint someone copied is too (resume asked for it);
    an export or a user's config.json is not."""
    old = tmp_path / "old"
    shutil.copytree(world["run"], old)
    (old / MANIFEST).unlink()
    code, out, err = cli("train.py", f"--out_dir={old}", "--resume=True", "--max_iters=3")
    assert code == 0, err[-2000:]
    assert manifest(old)["written_by"] == "train.py, Depth-Attention"
    with pytest.raises(ConfigError, match="written by export.py"):
        claim(world["export"], "train.py", "--out_dir")


def test_a_forged_manifest_reaches_nothing_outside_its_folder(tmp_path):
    """The names a manifest lists are plain names: one listing ../x or /etc is no manifest."""
    for files in (["../victim"], ["/etc/passwd"], ["a/b"], [".."], "ckpt.pt", [1]):
        (tmp_path / MANIFEST).write_text(
            '{"written_by": "train.py, Depth-Attention", "files": %s}' % repr(files).replace(
                "'", '"'))
        assert manifest(tmp_path) == {}
    # a link, even to a well-formed manifest, is read as none: the folder is not its writer's
    elsewhere = tmp_path.parent / "elsewhere.json"
    elsewhere.write_text('{"written_by": "train.py, Depth-Attention", "files": ["ckpt.pt"]}')
    (tmp_path / MANIFEST).unlink()
    (tmp_path / MANIFEST).symlink_to(elsewhere)
    assert manifest(tmp_path) == {}


def test_an_export_written_by_python_is_marked_as_the_command_marks_it(tmp_path):
    hf.save_pretrained(tiny_model(vocab_size=257), tmp_path / "hf", None)
    assert manifest(tmp_path / "hf")["written_by"] == "export.py, Depth-Attention"
    save_checkpoint({"model": {}}, tmp_path / "hf" / "stray.pt")  # a user's file, then
    with pytest.raises(ConfigError, match="stray.pt"):
        hf.save_pretrained(tiny_model(vocab_size=257), tmp_path / "hf", None, overwrite=True)


def test_a_folder_it_cannot_write_is_one_error_naming_it(tmp_path, monkeypatch):
    """A read-only folder (root writes anywhere, so the refusal is stood in): the manifest's write
    fails as the first write would, one ConfigError naming the flag, not a PermissionError."""
    def refused(self, data):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "write_bytes", refused)
    with pytest.raises(ConfigError, match=r"cannot write --out_dir=.*Permission denied"):
        claim(tmp_path / "run", "train.py", "--out_dir").record()
