"""The docs run: every Python import line and every command of a root script in the code blocks of
README.md and docs/*.md is executed or parsed here (docs/gpu.md's command resolved as its scripts
resolve it), so a renamed module or flag fails a test instead of a reader. And the code reads beside
a PDF: line lengths of every module; no tracked file holds a merge's conflict markers."""
import importlib.util
import json
import re
import shlex
import subprocess
import sys

import pytest

from support.errors import ShowHelp
from helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Packages a doc may import that the test environment need not have: each is optional for users
# and absent from requirements-dev.txt (checked below), so its ImportError is not a stale doc.
OPTIONAL_PACKAGES = {"wandb": "train.py's --wandb_log=True"}

IMPORT = re.compile(r"\s*(import\s+[\w.]|from\s+[\w.]+\s+import\s)")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}
VARIABLE = re.compile(r"\$\{?(\w+)\}?")


def code_blocks(path):
    """(first line number, the block's lines) of every fenced code block of a Markdown file."""
    blocks, lines, start = [], None, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            if lines is None:
                lines, start = [], number + 1
            else:
                blocks.append((start, lines))
                lines = None
        elif lines is not None:
            lines.append(line)
    return blocks


def where(path, number):
    return f"{path.relative_to(ROOT)}:{number}"


def import_lines():
    """(where, statement) of every import line in the docs' code blocks, an import in parentheses
    joined to one line."""
    found = []
    for path in DOCS:
        for start, lines in code_blocks(path):
            i = 0
            while i < len(lines):
                if IMPORT.match(lines[i]):
                    statement, first = lines[i].split("#")[0].strip(), i
                    while statement.count("(") > statement.count(")") and i + 1 < len(lines):
                        i += 1
                        statement += " " + lines[i].split("#")[0].strip()
                    found.append((where(path, start + first), statement))
                i += 1
    return found


def shell_lines(lines):
    """A block's logical shell lines: continuations joined, a `$ ` prompt dropped."""
    joined, pending = [], ""
    for line in lines:
        line = line.removeprefix("$ ")
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    return joined


def script_commands():
    """(where, script, argv, the command as written) of every command line in the docs' code blocks
    that runs a root script: `python X.py ...` or `torchrun ... X.py ...`, env assignments and shell
    comments stripped, a block's own `NAME=value` lines and a for loop's first word substituted."""
    found = []
    for path in DOCS:
        for start, lines in code_blocks(path):
            variables = {}
            for offset, line in enumerate(shell_lines(lines)):
                try:
                    words = shell_words(line)
                except ValueError:  # not shell: a Python or output line with an odd quote
                    continue
                for command in split_commands(words, variables):
                    script = run_script(command)
                    if script:
                        found.append((where(path, start + offset), *script, " ".join(line.split())))
    return found


def shell_words(line):
    """The words of a shell line as sh splits them: quotes removed, a comment dropped, and ; && |
    words of their own even when written against a word (`a b; do`)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def split_commands(words, variables):
    """The simple commands of one shell line, split at ; && || |, leading env assignments and shell
    keywords stripped and $NAME substituted; a `NAME=value` line and a for loop's first word are
    recorded in variables."""
    commands, current = [], []
    for word in words + [";"]:
        if word not in SEPARATORS:
            current.append(word)
            continue
        while current and (current[0] in ("do", "then", "else", "done", "fi")
                           or ENV_ASSIGNMENT.match(current[0])):
            name, _, value = current.pop(0).partition("=")
            if value and not current:  # NAME=value alone sets a variable for the lines below
                variables[name] = value
        current = [VARIABLE.sub(lambda m: variables.get(m[1], m[0]), w) for w in current]
        if current[:1] == ["for"] and len(current) >= 4 and current[2] == "in":
            variables[current[1]] = current[3]
        elif current:
            commands.append(current)
        current = []
    return commands


def run_script(words):
    """(script, argv) if the command runs a root script, else None."""
    if words[0] in ("python", "python3") and len(words) > 1:
        script, argv = words[1], words[2:]
    elif words[0] == "torchrun":
        at = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if at is None:
            return None
        script, argv = words[at], words[at + 1:]
    else:
        return None
    if not script.endswith(".py") or "/" in script or not (ROOT / script).is_file():
        return None
    return script, argv


IMPORTS = import_lines()
COMMANDS = script_commands()


@pytest.fixture(scope="module")
def import_results():
    """Every import line run once, each on its own, in one fresh interpreter at the repository root
    (as a reader runs them): {statement: None, or (the missing module's name, the error)}."""
    program = (
        "import json, sys\n"
        "results = {}\n"
        "for statement in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        exec(statement, {})\n"
        "        results[statement] = None\n"
        "    except Exception as e:\n"
        "        results[statement] = (getattr(e, 'name', None), f'{type(e).__name__}: {e}')\n"
        "print(json.dumps(results))\n")
    statements = sorted({statement for _, statement in IMPORTS})
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, ''); {program}",
                           json.dumps(statements)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_docs_have_imports_and_commands_to_check():
    assert len(IMPORTS) >= 5 and len(COMMANDS) >= 20, (len(IMPORTS), len(COMMANDS))


@pytest.mark.parametrize("place, statement", IMPORTS, ids=[w for w, _ in IMPORTS])
def test_every_import_line_of_the_docs_runs(import_results, place, statement):
    result = import_results[statement]
    if result is None:
        return
    missing, error = result
    top = (missing or "").split(".")[0]
    if top in OPTIONAL_PACKAGES:
        pytest.skip(f"{top} is optional ({OPTIONAL_PACKAGES[top]}) and not installed")
    pytest.fail(f"{place}: `{statement}` raises {error}")


def requirement_names():
    names = set()
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.add(re.split(r"[<>=!~\[ ]", line)[0].lower().replace("_", "-"))
    return names


def test_optional_packages_are_not_requirements():
    """A package the tests need cannot be excused as optional."""
    listed = {name.replace("_", "-") for name in OPTIONAL_PACKAGES} & requirement_names()
    assert not listed, f"{sorted(listed)} are in requirements-dev.txt: drop them from OPTIONAL"


SCRIPTS = {}


def parse_args_of(script):
    """The script's module-level parse_args, the script loaded once as a module (its main is
    guarded by __main__, so nothing runs)."""
    if script not in SCRIPTS:
        spec = importlib.util.spec_from_file_location(f"docs_{script[:-3]}", ROOT / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        SCRIPTS[script] = getattr(module, "parse_args", None)
    return SCRIPTS[script]


# docs/forking.md's worked example adds the row top1 to model.DEPTH_MODES, and its commands run in
# that fork: here the row is stood in by a row of the same shape, so the rest of each command is
# still checked.
FORK_ROWS = {"top1": "value"}


@pytest.mark.parametrize("place, script, argv, command", COMMANDS,
                         ids=[f"{w}:{s}" for w, s, _, _ in COMMANDS])
def test_every_command_of_the_docs_parses(place, script, argv, command, capsys, monkeypatch):
    """parse_args only parses and checks the command's syntax (a placeholder like out/RUN is fine:
    it touches no file); a bad command raises support.errors.UserError or model.ConfigError."""
    import dataclasses
    import model
    from support import run_config
    for mode, row in FORK_ROWS.items():  # the guide's commands run in a fork that has the row
        monkeypatch.setitem(model.DEPTH_MODES, mode, model.DEPTH_MODES[row])
        key = run_config.TRAIN_KEYS["depth_mode"]  # its choices: the rows when it was imported
        monkeypatch.setitem(run_config.TRAIN_KEYS, "depth_mode",
                            dataclasses.replace(key, choices=(*key.choices, mode)))
    parse_args = parse_args_of(script)
    assert callable(parse_args), f"{script} has no module-level parse_args(argv) to check " \
                                 f"{place}: {command}"
    try:
        parse_args(argv)
    except ShowHelp:  # support.config's --help: run_main prints it and exits 0
        assert {"-h", "--help"} & set(argv), f"{script} shows its help for {place}: {command}"
    except SystemExit as e:  # --help prints and exits 0; anything else is a refused command
        assert e.code in (0, None) and {"-h", "--help"} & set(argv), \
            f"{script} refuses {place}: {command}\n(exit {e.code}) {capsys.readouterr().err}"
    except Exception as e:
        pytest.fail(f"{script} refuses {place}: {command}\n{type(e).__name__}: {e}")


SOURCE_DIRS = ("support", "course", "tests", "experiments")
LONG, TOO_LONG, SHARE = 100, 120, 20  # columns; at most 1 line in SHARE over LONG


def python_modules():
    return sorted([*ROOT.glob("*.py"), *(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))])


def test_every_module_fits_beside_a_pdf():
    """At most 1 line in 20 over 100 columns and none over 120, in every module (a comment that does
    not fit goes above its line)."""
    bad = []
    for path in python_modules():
        lines = path.read_text().splitlines()
        long = sum(len(line) > LONG for line in lines)
        too_long = sum(len(line) > TOO_LONG for line in lines)
        if too_long or long * SHARE > len(lines):
            bad.append((long / max(len(lines), 1), path.relative_to(ROOT).as_posix(), long,
                        len(lines), too_long))
    worst = "\n".join(f"  {name}: {long} of {n} lines over {LONG} ({share:.0%}), {over} over "
                      f"{TOO_LONG}" for share, name, long, n, over in sorted(bad, reverse=True))
    assert not bad, f"{len(bad)} modules do not fit beside a PDF, worst first:\n{worst}"


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


# A merge's conflict markers, as git writes them: a side's first and last line start with seven
# "<" or ">" and a space (or end there). A lone "=======" is also a Markdown heading's underline
# or a Python divider, so it counts only in a file that has the other markers.
SIDE_MARKER = re.compile(r"^(?:<{7}|>{7})(?: |$)")
MIDDLE_MARKER = re.compile(r"^={7}$")


def conflict_markers(text):
    """The line numbers of the merge-conflict markers in text."""
    lines = text.splitlines()
    sides = [number for number, line in enumerate(lines, 1) if SIDE_MARKER.match(line)]
    middles = [number for number, line in enumerate(lines, 1) if MIDDLE_MARKER.match(line)]
    return sorted(sides + middles) if sides else []


def tracked_text_files():
    """(path, text) of every file git tracks that is in the working tree and is text: a binary file
    (a NUL byte, or not UTF-8) cannot hold a marker a reader would see."""
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.decode().strip()}")
    for name in filter(None, proc.stdout.decode().split("\0")):
        path = ROOT / name
        if not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def test_conflict_markers_are_told_from_underlines():
    """The check below sees a conflict and is blind to a heading's underline or a divider."""
    left, right = "<" * 7, ">" * 7
    conflict = f"a\n{left} HEAD\nours\n{'=' * 7}\ntheirs\n{right} branch\nb\n"
    assert conflict_markers(conflict) == [2, 4, 6]
    assert conflict_markers(f"Title\n{'=' * 7}\n\n# {'=' * 7}\nx = 1\n") == []
    assert conflict_markers(f"{left}\n") == [1] and conflict_markers(f"x {left} y\n") == []


def test_no_tracked_file_holds_merge_conflict_markers():
    """A merge resolved by committing both sides leaves markers in the file (a doc reads both
    versions; a module does not even import): every tracked text file is free of them."""
    files = list(tracked_text_files())
    assert files, "git tracks no text file"
    found = {path.relative_to(ROOT).as_posix(): lines for path, text in files
             if (lines := conflict_markers(text))}
    assert not found, ("merge-conflict markers (resolve them: keep the right text, drop the "
                       f"markers), file: lines: {found}")


def test_the_readme_and_the_tests_page_state_one_suite_time():
    """The full suite's measured minutes, said once in each place and the same in both."""
    said = {}
    for path in (ROOT / "README.md", ROOT / "docs" / "tests.md"):
        text = " ".join(path.read_text().split())
        said[path.name] = re.findall(r"(?:takes|tests in) about (\d+) minutes", text)
    assert said["README.md"] == said["tests.md"] and len(said["README.md"]) == 1, said
