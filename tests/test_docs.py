"""The documentation site builds with no warnings, and every figure in it comes from a
script in this repository."""
import os
import json
import re
import subprocess
import sys
from pathlib import Path

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
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {"ring_4_ranks.svg", "cost_model_ranks.png"} <= {p.name for p in tmp_path.iterdir()}


def _fenced_blocks(page: str):
    """(language, body) of each fenced block of a Markdown page, in order."""
    blocks, language, body = [], None, []
    for line in page.splitlines():
        if line.startswith("```"):
            if language is None:
                language, body = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(body)))
                language = None
        elif language is not None:
            body.append(line)
    return blocks


def test_every_excerpt_of_explain_in_the_docs_is_what_it_prints():
    # A `text` block after a `bash` block that runs `python -m ringreduce explain` quotes
    # what that command prints (its drawing left out): the block's lines, one after
    # another, as they are in the output.
    quoted = 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        command = None
        for language, body in _fenced_blocks(page.read_text()):
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
