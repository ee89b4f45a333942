"""
eval.py's lm-eval tasks: finding and building them before the model loads (a task file's relative
data read from beside it, the Hub probed before anything downloads), and the one boundary that turns
what lm-eval raises into one error line. lm_eval and datasets are optional packages, imported inside
the functions that use them: this module, and so `python eval.py --help` and eval.py's
MissingPackage line, import without them.
"""
import errno
import functools
import glob
import json
import os
import socket
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager, nullcontext
from pathlib import Path

from support.errors import USER_ERRORS, ConfigError, DataError

GLOB_CHARACTERS = set("*?[")  # fnmatch's: a --tasks name with one of them is a pattern
# Before tasks that may download are built, the Hub has this long to answer (hub_access).
HUB_PROBE_SECONDS = 3
OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def ours(method):
    """An EvalLM method lm-eval calls: what it raises is marked as raised in eval.py, so
    lm_eval_says lets it through (a UserError as its line, anything else as the bug it is, with its
    traceback)."""
    @functools.wraps(method)
    def marked(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except Exception as e:
            e.raised_in_eval_py = True
            raise
    return marked


@contextmanager
def lm_eval_says(what):
    """The one boundary around lm-eval: what it raises for a task (a file it cannot build, missing
    data, a template field the data lacks, a document its metrics cannot take) becomes one
    ConfigError, its own message and the error under it. lm-eval has no error type of its own (a
    bad task file or data reaches us as a ValueError, a KeyError, a jinja2 or datasets error...),
    so any Exception is caught, but what EvalLM raised (`ours`) passes through as it is: a
    UserError is its own line, anything else a bug with its traceback."""
    try:
        yield
    except USER_ERRORS:
        raise
    except ConnectionError as e:  # datasets raises this when the Hub is out of reach
        raise DataError(f"{what}: its data could not be downloaded ({one_line(e)}); run once with "
                        f"network access (it is cached), or use local task files with "
                        f"--include_path") from e
    except Exception as e:
        if getattr(e, "raised_in_eval_py", False):
            raise
        root = e
        while root.__cause__ or root.__context__:  # datasets may fail again wording its own error
            root = root.__cause__ or root.__context__
        raise ConfigError(f"{what}: {one_line(e)}"
                          + (f", from {one_line(root)}" if root is not e else "")) from e


def build_tasks(names, include_path):
    """(lm-eval's TaskManager, the tasks to run), built before the model loads: lm-eval reads each
    task's file and data (downloading it on first use). A glob selects every single task whose name
    matches (not groups or tags, whose tasks it matches too: lm-eval refuses a task that would run
    twice). Indexing lm-eval's ~15,000 built-in task files takes ~15 s, so names that --include_path
    defines (no glob) index that folder alone. Where the Hub is out of reach (hub_access), tasks
    whose data is cached still build and the others are named together in one error."""
    from lm_eval.tasks import TaskManager
    manager = None
    if include_path and not any(GLOB_CHARACTERS & set(n) for n in names):
        local = TaskManager(include_path=include_path, include_defaults=False)
        manager = local if set(names) <= set(local.all_subtasks) | set(local.all_tags) else None
    manager = manager or TaskManager(include_path=include_path)
    if include_path:
        read_data_beside_task_files(manager, include_path)
    single = set(manager.all_subtasks)
    selected = {n: [t for t in manager.match_tasks([n]) if t in single] if GLOB_CHARACTERS & set(n)
                else [n] * (n in manager.all_tasks) for n in names}
    missing = [n for n, found in selected.items() if not found]
    if missing:
        left_out = []  # the --include_path files lm-eval could not read (none looked for without)
        if include_path:
            indexed = {e.yaml_path.resolve() for e in manager.task_index.values() if e.yaml_path}
            left_out = [str(p) for p in sorted(Path(include_path).rglob("*.yaml"))
                        if p.resolve() not in indexed]
        raise ConfigError(f"unknown task(s) {', '.join(missing)}" + (
            f"; lm-eval left out these task files of --include_path, which it could not read: "
            f"{', '.join(left_out)}" if left_out else ": list lm-eval's tasks with `lm-eval ls "
            "tasks`, or give a folder of task YAML files with --include_path (a glob selects "
            "single tasks, not groups or tags)"))
    todo = list(dict.fromkeys(t for found in selected.values() for t in found))
    offline = hub_access([manager.task_index.get(name) for name in todo])
    built, uncached = [], []
    with hub_offline() if offline else nullcontext():
        for name in todo:
            entry = manager.task_index.get(name)
            where = f" ({entry.yaml_path})" if entry and entry.yaml_path else ""
            with lm_eval_says(f"task {name}{where}"):
                try:
                    loaded = manager.load([name])
                except ConnectionError:  # offline, datasets fails at once on data it has not cached
                    if not offline:
                        raise
                    uncached.append(name)  # the next tasks may be cached: name every one missing
                    continue
            built += ([loaded["groups"][name]] if name in loaded["groups"]
                      else list(loaded["tasks"].values()))
    if uncached:
        import datasets.config
        raise DataError(
            f"task(s) {', '.join(uncached)}: their data is on the Hugging Face Hub, but {offline}, "
            f"and it is not in the datasets cache ({datasets.config.HF_DATASETS_CACHE}): run once "
            f"with network access (the data is then cached, and HF_DATASETS_OFFLINE=1 runs on the "
            f"cache alone), or use local task files with --include_path (docs/eval.md)")
    with lm_eval_says("--tasks"):
        manager.load(built)  # lm-eval's own check that no task runs twice (alone and in a group)
    return manager, built


def read_data_beside_task_files(manager, include_path):
    """Make lm-eval read the relative data_files (or data_dir) of a task file in --include_path
    from that file's own folder: lm-eval hands them to datasets as they are, which reads them from
    the current folder, so a folder of tasks would run from one folder only. A path that is not
    beside the file is left as it is (a task written against the current folder still runs), and so
    are absolute paths, URLs and a Hub dataset's files (paths in its repository). lm-eval 0.4.13
    reads every task's config in one private method (also for a group's tasks), wrapped here on
    this manager alone; an lm-eval without it keeps its own rule."""
    factory = getattr(manager, "_factory", None)
    read = getattr(factory, "_load_full_config", None)
    if read is None:
        return
    folder = Path(include_path).resolve()

    def read_beside(entry, overrides=None):
        cfg = read(entry, overrides)
        yaml = Path(entry.yaml_path).resolve() if getattr(entry, "yaml_path", None) else None
        if yaml and folder in yaml.parents and local_builder(cfg) \
                and isinstance(cfg.get("dataset_kwargs"), dict):
            cfg["dataset_kwargs"] = beside(yaml.parent, cfg["dataset_kwargs"])
        return cfg
    factory._load_full_config = read_beside


def local_builder(cfg):
    """Whether a task's dataset_path is one of datasets' builders of files (json, csv, parquet...),
    whose data_files are local paths or URLs, not paths in a Hub repository."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    path = cfg.get("dataset_path")
    return isinstance(path, str) and path in _PACKAGED_DATASETS_MODULES


def beside(folder, kwargs):
    """dataset_kwargs with its relative data_dir, or else its relative data_files (datasets reads
    them in data_dir when there is one), in folder where they exist there (a pattern: where it
    matches a file)."""
    def resolve(p):
        if isinstance(p, (list, tuple)):
            return [resolve(q) for q in p]
        if isinstance(p, dict):
            return {k: resolve(v) for k, v in p.items()}
        if (isinstance(p, str) and "://" not in p and not Path(p).expanduser().is_absolute()
                and glob.glob(p, root_dir=folder, recursive=True)):
            return str(folder / p)
        return p
    key = "data_dir" if kwargs.get("data_dir") else "data_files"
    return {**kwargs, key: resolve(kwargs[key])} if kwargs.get(key) else kwargs


def may_download(entry):
    """Whether building an index entry may fetch data from the Hub: anything but a task whose data
    is local (a builder of files over paths that are no URLs, or a dataset_path that exists here).
    A group, a tag or a Python task may: their tasks are not looked into."""
    cfg = getattr(entry, "cfg", None)
    if (not cfg or "task" not in cfg or "class" in cfg or "group" in cfg
            or cfg.get("custom_dataset")):
        return True
    kwargs = cfg.get("dataset_kwargs") or {}
    if "://" in json.dumps([kwargs.get("data_files"), kwargs.get("data_dir")]):
        return True
    path = cfg.get("dataset_path")
    return not (local_builder(cfg) or (isinstance(path, str) and Path(path).exists()))


def hub_access(entries):
    """None where the tasks may use the Hub, else why not (for the error line): offline by choice
    (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE), or the Hub did not answer a probe. Offline, datasets
    retries each download for ~25 s (longer where a connection hangs instead of failing) before it
    fails, so tasks that may download are built in its offline mode where the Hub is out of reach:
    cached data still loads, data that is not cached fails at once. Tasks on local files probe
    nothing."""
    if not any(may_download(e) for e in entries):
        return None
    import datasets.config
    if datasets.config.HF_HUB_OFFLINE:  # either variable sets it when datasets is imported
        chosen = " and ".join(f"{v}={os.environ[v]}" for v in OFFLINE_VARIABLES
                              if os.environ.get(v))
        return f"datasets is in offline mode ({chosen or 'set in code'}; unset to download)"
    endpoint = datasets.config.HF_ENDPOINT
    silent = hub_unreachable(endpoint)
    if silent is None:
        return None
    print(f"warning: {endpoint} is out of reach ({silent}): the tasks read their data from the "
          f"datasets cache alone (its offline mode)", file=sys.stderr)
    return f"{endpoint} is out of reach ({silent})"


def hub_unreachable(endpoint, timeout=HUB_PROBE_SECONDS):
    """None where the Hub answers at all, else why not: one HEAD request to its endpoint, through
    the environment's proxies as datasets' own requests go. Any answer counts, an HTTP error or a
    TLS failure too: only a name that does not resolve, a connection refused or without a route, or
    no connection within `timeout` seconds is out of reach, so the probe stops no run that could
    download."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"),
                               timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:  # no answer to the request; the socket's error is its reason
        if isinstance(e.reason, TimeoutError):
            return f"no connection within {timeout} s"
        if (isinstance(e.reason, (socket.gaierror, ConnectionError))
                or getattr(e.reason, "errno", None) in (errno.ENETUNREACH, errno.EHOSTUNREACH)):
            return one_line(e.reason)
    except (OSError, ValueError):  # an answer, if slow or strange: datasets will say what is wrong
        pass
    return None


@contextmanager
def hub_offline():
    """datasets' and huggingface_hub's offline mode within the block, as HF_HUB_OFFLINE=1 sets it
    when they are imported; restored after, as eval.main runs in the tests' process too."""
    import datasets.config
    import huggingface_hub.constants as hub
    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def one_line(e):
    """An exception as one line: its class and its message, every run of white space one space."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
