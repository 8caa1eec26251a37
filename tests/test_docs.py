"""The documentation site builds with no warnings, every figure in it comes from a
script in this repository, and every python block in it runs (or, where marked not to,
fits the API)."""
import ast
import inspect
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_site_builds_without_warnings(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in scripts/requirements.txt, which "
                        "scripts/bootstrap.sh installs")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stdout + done.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "DistributedOptimizer" in reference and "allreduce_async" in reference


def test_every_figure_is_made_by_the_figures_script(tmp_path):
    script = (ROOT / "scripts" / "figures.sh").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        for image in re.findall(r"!\[[^\]]*\]\(images/([^)]+)\)", page.read_text()):
            assert (ROOT / "docs" / "images" / image).exists(), f"{page.name}: {image}"
            assert image in script, f"{image} (in {page.name}) is not made by scripts/figures.sh"
    # The figures computed from the code are made afresh here.
    done = subprocess.run(["bash", str(ROOT / "scripts" / "figures.sh")], cwd=ROOT,
                          env=dict(os.environ, FIGURES_DIR=str(tmp_path)),
                          capture_output=True, text=True, timeout=600)  # (160 s at a load of 4 here)
    assert done.returncode == 0, done.stderr
    assert {"ring_4_ranks.svg", "cost_model_ranks.png"} <= {p.name for p in tmp_path.iterdir()}


class Fence(NamedTuple):
    language: str
    body: str
    line: int  # of the opening ```, from 1
    before: str  # the last non-blank line above it ("" if none)


def _fenced_blocks(page: str) -> list[Fence]:
    """Each fenced block of a Markdown page, in order."""
    blocks, language, body, start, before, last_text = [], None, [], 0, "", ""
    for number, line in enumerate(page.splitlines(), 1):
        if line.startswith("```"):
            if language is None:
                language, body, start, before = line[3:].strip(), [], number, last_text
            else:
                blocks.append(Fence(language, "\n".join(body), start, before))
                language = None
        elif language is not None:
            body.append(line)
        if line.strip():
            last_text = line.strip()
    assert language is None, f"the block opened on line {start} is never closed"
    return blocks


def test_every_excerpt_of_explain_in_the_docs_is_what_it_prints():
    # A `text` block after a `bash` block that runs `python -m ringreduce explain` quotes
    # what that command prints (its drawing left out): the block's lines, one after
    # another, as they are in the output.
    quoted = 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        command = None
        for language, body, *_ in _fenced_blocks(page.read_text()):
            if language == "bash":
                runs = [line for line in body.splitlines()
                        if line.startswith("python -m ringreduce explain")]
                command = runs[-1] if runs else None
            elif language == "text" and command is not None:
                argv = re.sub(r" --svg \S+", "", command).split()[1:]
                done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True,
                                      text=True, timeout=120)
                assert done.returncode == 0, done.stderr
                shown, printed = body.splitlines(), done.stdout.splitlines()
                assert any(printed[i:i + len(shown)] == shown for i in range(len(printed))), \
                    f"{page.name}: not what `{command}` prints:\n{body}"
                quoted += 1
    assert quoted >= 4  # docs/ring.md's first step, and three of --values


def _documented_commands() -> list[str]:
    """Every `python -m ringreduce explain|sim|info ...` the README and docs/ show, in a
    bash block or inline, its comment left out; not a bare mention of an option that
    takes a value (`explain --svg`)."""
    found = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for command in re.findall(r"python -m ringreduce (?:sim|explain|info)[^`|#\n]*",
                                  page.read_text()):
            command = command.strip()
            if not re.search(r"--(svg|timeline)$", command):
                found.add(command)
    return sorted(found)


@pytest.mark.parametrize("command", _documented_commands())
def test_every_documented_command_line_runs(command, tmp_path):
    # (From a review: only explain's quoted excerpts were run.) A figure it writes goes
    # to a folder of the test's own.
    argv = re.sub(r"(--(?:svg|timeline)) (\S+)", lambda m: f"{m[1]} {tmp_path / m[2]}",
                  command).split()[1:]
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{command}:\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), command
    for written in re.findall(r"--(?:svg|timeline) (\S+)", command):
        assert (tmp_path / written).stat().st_size > 0, command


def test_the_documented_command_lines_are_found():
    commands = _documented_commands()
    assert len(commands) >= 10, commands
    assert {"python -m ringreduce info", "python -m ringreduce sim --ranks 3 --bytes 12M "
            "--chunk 1M --timeline pipeline.png"} <= set(commands), commands


def test_the_limits_of_explain_values_are_the_ones_docs_ring_md_gives():
    from ringreduce.explain import MAX_VALUES_LINE, MAX_VALUES_RANKS, explain

    page = " ".join((ROOT / "docs" / "ring.md").read_text().split())
    most = 0
    while most < 1000:
        try:
            explain(4, most + 1, values=True)
        except ValueError:
            break
        most += 1
    assert (f"`--values` takes up to {MAX_VALUES_RANKS} ranks (a digit each) and as many "
            f"elements as keep a rank's numbers on a line of {MAX_VALUES_LINE} characters "
            f"({most} on 4 ranks)") in page


def test_readme_example_runs_on_two_ranks(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from launch import job_env, mpiexec

    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    script = tmp_path / "example.py"
    # Each rank prints to a file of its own: the two ranks' lines would interleave.
    script.write_text("import sys\nfrom mpi4py import MPI\n"
                      f"sys.stdout = open(r'{tmp_path}/out%d.txt' % MPI.COMM_WORLD.Get_rank(), 'w')\n"
                      + code)
    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    outputs = [(tmp_path / f"out{r}.txt").read_text().split(None, 1) for r in (0, 1)]
    assert [rank for rank, _ in outputs] == ["0", "1"]
    assert outputs[0][1] == outputs[1][1]  # the same numbers on both ranks


def test_the_mpi4py_comparison_runs_on_3_ranks(tmp_path):
    # docs/api.md's "Coming from mpi4py": each mpi4py call beside ringreduce's, asserted
    # equal; on 3 ranks, where blocks and row counts differ per rank.
    sys.path.insert(0, str(ROOT / "tests"))
    from launch import job_env, mpiexec

    code = re.search(r"```python\n(# from_mpi4py\.py\n.*?)```",
                     (ROOT / "docs" / "api.md").read_text(), re.S).group(1)
    script = tmp_path / "from_mpi4py.py"
    script.write_text(code + "print('all equal')\n")
    done = subprocess.run([mpiexec(), "-n", "3", sys.executable, "-m", "mpi4py", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("all equal") == 3, done.stdout + done.stderr


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_the_training_script_gives_the_output_shown_on_1_to_4_ranks(tmp_path, ranks):
    sys.path.insert(0, str(ROOT / "tests"))
    from launch import job_env, mpiexec

    page = (ROOT / "docs" / "training.md").read_text()
    code = re.search(r"```python\n(# train\.py:.*?)```", page, re.S).group(1)
    shown = re.search(r"```console\n\$ mpiexec -n 3 python -m mpi4py train.py\n(.*?)```",
                      page, re.S).group(1)
    (tmp_path / "train.py").write_text(code)
    done = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py",
                           "train.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180, env=job_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == shown


def test_the_training_table_is_the_stored_runs():
    # docs/training.md's table, row by row, against benchmarks/results/digits/*.json
    # (which tests/mpi/test_example.py holds to what the code trains now).
    page = (ROOT / "docs" / "training.md").read_text()
    rows = re.findall(r"^\| (\d) \| (None|fp16|bf16|PowerSGD\(rank=4\)) \| ([\d.]+) \| "
                      r"([\d.]+) \| ([\d.]+) \|", page, re.M)
    names = {"None": "", "fp16": "_fp16", "bf16": "_bf16", "PowerSGD(rank=4)": "_powersgd"}
    assert len(rows) == 6, rows
    for ranks, compression, loss, accuracy, megabytes in rows:
        path = ROOT / "benchmarks" / "results" / "digits" / f"ranks{ranks}{names[compression]}.json"
        run = json.loads(path.read_text())
        assert (loss, accuracy, megabytes) == (f"{run['loss'][-1]:.4f}",
                                               f"{run['test_accuracy'][-1]:.3f}",
                                               f"{run['bytes_sent_per_rank'] / 1e6:.1f}"), path


def test_the_readmes_links_lead_to_files_and_headings_that_exist():
    # README.md is not part of the site, so mkdocs does not check its links.
    from markdown.extensions.toc import slugify

    def headings(page: Path) -> set:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        return {slugify(title.strip(), "-") for title in re.findall(r"^#+ (.*)$", text, re.M)}

    readme = ROOT / "README.md"
    links = [link for link in re.findall(r"\]\(([^)\s]+)\)", readme.read_text())
             if not link.startswith(("http://", "https://"))]
    assert len(links) >= 10, links
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {link}: no such file"
        if anchor:
            assert anchor in headings(target), f"README.md links to {link}: no such heading"


# -- Every python block of the docs ------------------------------------------------------
#
# Every ```python block of README.md and docs/*.md runs, as it is, on 2 ranks (under
# `python -m mpi4py`, so that an error on one rank ends the job), unless the last
# non-blank line above it is an HTML comment `<!-- not run: why -->` (which neither the
# site nor GitHub shows). A block that imports cupy runs over tests/mpi/fake_cupy.py and
# the core's host emulation of a GPU, as tests/mpi/test_gpu_emulated.py does. A block not
# run (a synopsis, a fragment) is checked against the code instead: every call it makes
# on a name the page binds (by an import, or `comm = rr.Communicator(...)`) must fit the
# signature, and every attribute it names must exist.
# (The tests above check what some of these blocks print; these check that all run.)

DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!-- not run: (.+) -->")

# What a block that imports cupy runs first (as tests/mpi/emulated_bench_gpu.py does), in a
# namespace of its own, so that the block sees none of these names.
EMULATED_GPU = f"""\
import sys
sys.path.insert(0, {str(ROOT / "tests" / "mpi")!r})
import fake_cupy
fake_cupy.emulate_gpu()
"""


class PythonBlock(NamedTuple):
    page: str  # relative to the repository
    line: int
    code: str
    not_run: str | None  # why, where marked `<!-- not run: why -->`

    def __str__(self):
        return f"{self.page}:{self.line}"


def _python_blocks() -> list[PythonBlock]:
    blocks = []
    for page in DOC_PAGES:
        for fence in _fenced_blocks(page.read_text()):
            if fence.language == "python":
                marked = NOT_RUN.fullmatch(fence.before)
                blocks.append(PythonBlock(str(page.relative_to(ROOT)), fence.line, fence.body,
                                          marked and marked.group(1)))
    return blocks


PYTHON_BLOCKS = _python_blocks()


def test_the_python_blocks_are_found():
    # (a change of the fences' form must not leave the tests below with nothing to run)
    run = [str(block) for block in PYTHON_BLOCKS if block.not_run is None]
    assert len(run) >= 6, run
    assert {"README.md", "docs/index.md", "docs/api.md", "docs/gpu.md",
            "docs/training.md"} <= {block.page for block in PYTHON_BLOCKS}
    for page in DOC_PAGES:  # a marker that does not sit right above a block does nothing
        markers = sum(1 for line in page.read_text().splitlines()
                      if NOT_RUN.fullmatch(line.strip()))
        marked = [b for b in PYTHON_BLOCKS
                  if b.not_run and b.page == str(page.relative_to(ROOT))]
        assert markers == len(marked), (f"{page.name}: a `<!-- not run: why -->` that is not "
                                        "the last line above a ```python block")


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if b.not_run is None], ids=str)
def test_every_python_block_of_the_docs_runs_on_2_ranks(tmp_path, block):
    from launch import run_script

    if re.search(r"^\s*(import|from) torch\b", block.code, re.M):
        pytest.importorskip("torch", reason="the block shows a torch model, and torch is "
                            "not installed here (CI has none)")
    on_gpu = re.search(r"^\s*(import|from) cupy\b", block.code, re.M)
    # The block starts on its line of the page, so that a traceback's line numbers are
    # the page's; the emulation, if any, takes line 1.
    first_line = f"exec({EMULATED_GPU!r}, {{}})" if on_gpu else ""
    done = run_script(tmp_path, "block.py", first_line + "\n" * block.line + block.code,
                      timeout=60, cwd=tmp_path)
    assert done.returncode == 0, (
        f"the python block at {block} fails on 2 ranks (exit {done.returncode}; the "
        f"traceback's line numbers are the page's); mend it, or, if it is not meant to "
        f"run, put `<!-- not run: why -->` above it:\n"
        f"{done.stdout[-4000:]}{done.stderr[-4000:]}")


class _Instance(NamedTuple):
    """What `SomeClass(...)` stands for, or a call whose return annotation is SomeClass."""
    cls: type


class _Method(NamedTuple):
    """What `instance.method` stands for: the function, which takes self first."""
    function: typing.Callable


def _attributes_set_on_self(cls: type) -> set:
    """The names the methods of cls (and of its bases) assign as `self.name`: instance
    attributes, which the class itself does not have."""
    names = set()
    for klass in cls.__mro__[:-1]:
        try:
            tree = ast.parse(inspect.getsource(klass).lstrip())  # (a nested class is indented)
        except (OSError, TypeError):  # (defined in C)
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return names


def _returned_class(function):
    """The class a function's return annotation names, if it names one."""
    try:
        returned = typing.get_type_hints(function).get("return")
    except Exception:  # (an annotation that cannot be evaluated here: unknown)
        return None
    return returned if isinstance(returned, type) else None


def _api_problems(code: str, names: dict) -> tuple[list[str], int]:
    """(what in this code does not fit the API, how many calls and attributes were
    checked). names: what each name stands for (a module, class or function; or an
    _Instance), from the page's blocks before; the code's own imports and assignments
    are added to it, for the blocks after."""
    problems, checked, known = [], 0, {}  # known: id(node) -> what it stands for

    def meaning(node):
        """What an expression stands for, or None where it is nothing known."""
        if id(node) in known:
            return known[id(node)]
        known[id(node)] = found = _meaning(node)
        return found

    def _meaning(node):
        nonlocal checked
        if isinstance(node, ast.Name):
            return names.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = meaning(node.value)
            shown = ast.unparse(node)
            if owner is None:
                return None
            checked += 1
            if isinstance(owner, _Instance):
                cls = owner.cls
                if not hasattr(cls, node.attr):
                    if node.attr not in _attributes_set_on_self(cls):
                        problems.append(f"{shown}: {cls.__name__} has no attribute {node.attr!r}")
                    return None
                member = inspect.getattr_static(cls, node.attr)
                if isinstance(node.ctx, ast.Store):
                    if isinstance(member, property) and member.fset is None:
                        problems.append(f"{shown} = ...: {cls.__name__}.{node.attr} is read-only")
                    return None
                if isinstance(member, property):
                    return None
                return _Method(getattr(cls, node.attr))
            if not hasattr(owner, node.attr):
                problems.append(f"{shown}: {getattr(owner, '__name__', owner)} has no "
                                f"attribute {node.attr!r}")
                return None
            return getattr(owner, node.attr)
        if isinstance(node, ast.Call):
            target = meaning(node.func)
            if target is None or isinstance(target, _Instance):
                return None
            method = isinstance(target, _Method)
            function = target.function if method else target
            if not callable(function):
                problems.append(f"{ast.unparse(node)}: {ast.unparse(node.func)} is not callable")
                return None
            if not any(isinstance(a, ast.Starred) for a in node.args) and \
                    all(k.arg is not None for k in node.keywords):
                try:
                    signature = inspect.signature(function)
                except (TypeError, ValueError):  # (no signature to read: a builtin's)
                    signature = None
                if signature is not None:
                    checked += 1
                    arguments = [None] * (len(node.args) + method)  # (self first, for a method)
                    try:
                        signature.bind(*arguments, **{k.arg: None for k in node.keywords})
                    except TypeError as error:
                        problems.append(f"{ast.unparse(node)}: {error} (the signature is "
                                        f"{ast.unparse(node.func)}{signature})")
            if isinstance(function, type):
                return _Instance(function)
            returned = _returned_class(function)
            return _Instance(returned) if returned else None
        return None

    for statement in ast.parse(code).body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            for alias in statement.names:  # (one by one: a name gone spoils no other)
                one = (ast.Import([alias]) if isinstance(statement, ast.Import) else
                       ast.ImportFrom(statement.module, [alias], statement.level))
                scope = {}
                try:
                    exec(compile(ast.fix_missing_locations(ast.Module([one], [])), "<block>",
                                 "exec"), scope)
                except ImportError as error:
                    module = (statement.module or "" if isinstance(one, ast.ImportFrom)
                              else alias.name)
                    if module.split(".")[0] != "cupy":  # (which these tests do without)
                        problems.append(f"{ast.unparse(one)}: {error}")
                    continue
                del scope["__builtins__"]
                names.update(scope)
            continue
        for node in ast.walk(statement):  # (outermost first: a call before its arguments)
            if isinstance(node, (ast.Attribute, ast.Call)):
                meaning(node)
        for node in ast.walk(statement):  # a name bound here is unknown from now on, ...
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names[node.id] = None
        if isinstance(statement, ast.Assign):  # ... unless it is simply assigned
            for target in statement.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = meaning(statement.value)
    return problems, checked


def _pages_names_before(block: PythonBlock) -> dict:
    """What the names the page's blocks before this one bind stand for, as a reader
    following the page takes them (docs/gpu.md's fragment uses the comm made above)."""
    names = {}
    for earlier in PYTHON_BLOCKS:
        if earlier.page == block.page and earlier.line < block.line:
            _api_problems(earlier.code, names)
    return names


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if b.not_run], ids=str)
def test_every_call_in_a_python_block_not_run_fits_the_api(block):
    problems, checked = _api_problems(block.code, _pages_names_before(block))
    assert checked, f"{block} is not run, and nothing in it names the API: is it Python?"
    assert not problems, f"{block} (not run: {block.not_run}):\n" + "\n".join(problems)


def test_the_check_of_blocks_not_run_finds_what_does_not_fit():
    code = """
import ringreduce as rr
from ringreduce.optim import SGD, NoSuchOptimizer
comm = rr.Communicator(chunk=4)
comm.allreduce(x, "sum", None, 3)
comm.allreduce_asink(x)
comm.rank, comm.ranks
comm.transport = "MPI"
h = comm.allreduce_async(x)
h.wait(timeout=1, then=2)
rr.no_such_function()
opt = SGD(params, lr=0.1)
opt.step(grads)
opt.lr, opt.momentum, opt.nesterov
"""
    problems, checked = _api_problems(code, {})
    expected = ["cannot import name 'NoSuchOptimizer'",
                "rr.Communicator(chunk=4): got an unexpected keyword argument 'chunk'",
                "comm.allreduce(x, 'sum', None, 3): too many positional arguments",
                "comm.allreduce_asink: Communicator has no attribute 'allreduce_asink'",
                "comm.ranks: Communicator has no attribute 'ranks'",
                "comm.transport = ...: Communicator.transport is read-only",
                "h.wait(timeout=1, then=2): got an unexpected keyword argument 'then'",
                "rr.no_such_function: ringreduce has no attribute 'no_such_function'",
                "opt.nesterov: SGD has no attribute 'nesterov'"]
    for problem in expected:
        assert sum(problem in found for found in problems) == 1, (problem, problems)
    assert len(problems) == len(expected), problems
    assert checked >= 15
