"""The docs run: every Python import line in the code blocks of README.md, docs/*.md and
course/README.md runs, and every command line there that runs one of our scripts (the root's,
lab/'s, course/'s) parses, so a renamed module, script or flag fails here instead of a reader.
docs/gpu.md's command is resolved as its scripts resolve it."""
import importlib.util
import json
import re
import shlex
import subprocess
import sys

import pytest

import configurator
from helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "course" / "README.md"]
# Optional packages a page may import that the test environment need not have.
OPTIONAL_PACKAGES = {"wandb"}
IMPORT = re.compile(r"\s*(import\s+[\w.]|from\s+[\w.]+\s+import\s)")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}
VARIABLE = re.compile(r"\$\{?(\w+)\}?")
SCRIPT = re.compile(r"(?:(?:lab|course)/)?\w+\.py")


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


def blocks():
    """(the page's name, first line number, lines) of every code block of the pages."""
    for path in DOCS:
        for start, lines in code_blocks(path):
            yield path.relative_to(ROOT), start, lines


def import_lines():
    """(where, statement) of every import line, one in parentheses joined to one line."""
    found = []
    for page, start, lines in blocks():
        i = 0
        while i < len(lines):
            if IMPORT.match(lines[i]):
                statement, first = lines[i].split("#")[0].strip(), i
                while statement.count("(") > statement.count(")") and i + 1 < len(lines):
                    i += 1
                    statement += " " + lines[i].split("#")[0].strip()
                found.append((f"{page}:{start + first}", statement))
            i += 1
    return found


def shell_lines(lines):
    """(offset of its first line, line) of a block's logical shell lines: continuations joined, a
    `$ ` prompt dropped."""
    joined, pending, first = [], "", 0
    for offset, line in enumerate(lines):
        line = line.removeprefix("$ ")
        first = offset if not pending else first
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append((first, pending + line))
        pending = ""
    return joined


def split_commands(words, variables):
    """The simple commands of one line's words, split at ; && || |, leading env assignments and
    shell keywords stripped and $NAME substituted; a `NAME=value` line and a for loop's first word
    are recorded in variables."""
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
    """(script, argv) if the command runs one of our scripts, else None."""
    if words[0] in ("python", "python3") and len(words) > 1:
        at = 1
    elif words[0] == "torchrun":
        at = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
    else:
        return None
    if at is None or not SCRIPT.fullmatch(words[at]):
        return None
    return words[at], words[at + 1:]


def script_commands():
    """(where, script, argv, the line as written) of every command line that runs a script."""
    found = []
    for page, start, lines in blocks():
        variables = {}
        for offset, line in shell_lines(lines):
            try:  # the words as sh splits them; ; && | words of their own
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.whitespace_split = True
                words = list(lexer)
            except ValueError:  # not shell: a Python or output line with an odd quote
                continue
            for command in split_commands(words, variables):
                if script := run_script(command):
                    found.append((f"{page}:{start + offset}", *script, " ".join(line.split())))
    return found


IMPORTS = import_lines()
COMMANDS = script_commands()


@pytest.fixture(scope="module")
def import_results():
    """Every import line run once, each on its own, in one fresh interpreter at the repository
    root (as a reader runs them): {statement: None, or (the missing module, the error)}."""
    program = (
        "import json, sys\nsys.path.insert(0, '')\nresults = {}\n"
        "for statement in json.loads(sys.argv[1]):\n"
        "    try:\n        exec(statement, {})\n        results[statement] = None\n"
        "    except Exception as e:\n"
        "        results[statement] = (getattr(e, 'name', None), f'{type(e).__name__}: {e}')\n"
        "print(json.dumps(results))\n")
    statements = sorted({statement for _, statement in IMPORTS})
    done = subprocess.run([sys.executable, "-c", program, json.dumps(statements)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_docs_have_imports_and_commands_to_check():
    assert len(IMPORTS) >= 5 and len(COMMANDS) >= 20, (len(IMPORTS), len(COMMANDS))


@pytest.mark.parametrize("place, statement", IMPORTS, ids=[w for w, _ in IMPORTS])
def test_every_import_line_of_the_docs_runs(import_results, place, statement):
    if (result := import_results[statement]) is not None:
        missing, error = result
        if (missing or "").split(".")[0] in OPTIONAL_PACKAGES:
            pytest.skip(f"{missing} is optional and not installed")
        pytest.fail(f"{place}: `{statement}` raises {error}")


PARSERS = {}


def parser_of(script):
    """The script's parse_args, else configurator.parse over its KEYS; the script loaded once as
    a module (its main is guarded by __main__, so nothing runs)."""
    if script not in PARSERS:
        name = "docs_" + script[:-3].replace("/", "_")
        spec = importlib.util.spec_from_file_location(name, ROOT / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        PARSERS[script] = getattr(module, "parse_args", None) or (
            lambda argv: configurator.parse(argv, module.KEYS, module.__doc__))
    return PARSERS[script]


# docs/forking.md's worked example adds the row top1 to model.DEPTH_MODES, and its commands run
# in that fork: a row of the same shape stands in for it, so the rest of each command is checked.
FORK_ROWS = {"top1": "value"}


@pytest.fixture
def fork_rows(monkeypatch):
    import model
    import train
    for mode, row in FORK_ROWS.items():
        monkeypatch.setitem(model.DEPTH_MODES, mode, model.DEPTH_MODES[row])
    train.table.cache_clear()  # train.py's key table takes its depth_mode choices from the rows
    yield
    monkeypatch.undo()
    train.table.cache_clear()


@pytest.mark.parametrize("place, script, argv, command", COMMANDS,
                         ids=[f"{w}:{s}" for w, s, _, _ in COMMANDS])
def test_every_command_of_the_docs_parses(place, script, argv, command, fork_rows):
    """Parsing only checks the command's keys and values (a placeholder like out/RUN is fine: it
    touches no file); a bad command raises a configurator.UserError or model.ConfigError."""
    assert (ROOT / script).is_file(), f"{place}: {script} does not exist: {command}"
    try:
        parser_of(script)(argv)
    except configurator.ShowHelp:
        assert {"-h", "--help"} & set(argv), f"{script} shows its help for {place}: {command}"
    except Exception as e:
        pytest.fail(f"{script} refuses {place}: {command}\n{type(e).__name__}: {e}")


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
