"""What an sdist carries: everything csrc/ holds (setuptools itself takes only the .cc
sources named in setup.py, and an sdist without the headers cannot build), and all that
the test suite needs to run from an unpacked sdist (all of tests/, and the examples,
benchmarks, docs, results and scripts the tests run or read); made on a machine with
neither MPI nor CUDA at hand."""
import os
import re
import shutil
import subprocess
import sys
import tarfile

from launch import ROOT, job_env

# The repository's files an sdist leaves out on purpose: CI's entry point, git's list of
# ignored files, and the raw traces behind one figure of docs/performance.md (4.4 MB,
# most of the results), which no test reads. Every other file goes in.
LEFT_OUT = {".ci/run", ".gitignore", "benchmarks/results/wire_choice_p2.json",
            "benchmarks/results/wire_choice_p2_backoff.json"}
# What a build, an install or a test run leaves in the tree, in an unpacked sdist (where
# there is no git to ask what the sources are).
NOT_SOURCES = re.compile(r"(^|/)(\.venv|\.git|build|dist|site|__pycache__|\.pytest_cache|"
                         r"[^/]*\.egg-info)/|\.(so|o|py[cod]|tmp)$|^(PKG-INFO|setup\.cfg|"
                         r"\.build-stamp)$")


def source_files():
    """The files an sdist could carry: the tracked ones in a git checkout; elsewhere the
    files on disk, less what builds and test runs leave."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                check=True, timeout=60).stdout.decode()
        return {name for name in listed.split("\0") if name and (ROOT / name).is_file()}
    return {str(path.relative_to(ROOT)) for path in ROOT.rglob("*")
            if path.is_file() and not NOT_SOURCES.search(str(path.relative_to(ROOT)))}


def test_sdist_carries_csrc_and_what_the_tests_need_and_needs_no_mpi_or_cuda(tmp_path):
    sources = source_files()
    tree = tmp_path / "tree"
    for name in sources:  # (a copy: an sdist made in place would write into the checkout)
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    # setup.py looks for MPI and CUDA only when it builds: this setting would stop it.
    done = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)],
                          cwd=tree, capture_output=True, text=True, timeout=120,
                          env=job_env({"RINGREDUCE_CUDA": "not a setting"}))
    assert done.returncode == 0, done.stdout + done.stderr
    (sdist,) = tmp_path.glob("ringreduce-*.tar.gz")
    with tarfile.open(sdist) as archive:
        carried = {member.name.split("/", 1)[1] for member in archive.getmembers()
                   if member.isfile()}
        top = sdist.name[:-len(".tar.gz")]
        requires = archive.extractfile(f"{top}/ringreduce.egg-info/requires.txt").read()
    made = {name for name in carried if NOT_SOURCES.search(name)}  # PKG-INFO, egg-info
    missing = sorted(sources - LEFT_OUT - carried)
    assert not missing, f"not in the sdist (add them to MANIFEST.in): {missing}"
    extra = sorted(carried - made - sources)
    assert not extra, f"in the sdist but not among the sources: {extra}"
    unwanted = sorted(LEFT_OUT & carried)
    assert not unwanted, f"in the sdist though LEFT_OUT here: {unwanted}"
    assert {"csrc/ring_schedule.h", "csrc/cuda_reduce.cu", "tests/conftest.py",
            "tests/mpi/conftest.py", "ringreduce/__init__.py", "mkdocs.yml"} <= carried
    # The extra that `explain --svg` and `sim --timeline` name where matplotlib is missing.
    # (in requires.txt: older setuptools write no Requires-Dist into an sdist's PKG-INFO)
    assert "\n[plot]\nmatplotlib\n" in "\n" + requires.decode() + "\n"


def test_no_test_reads_what_the_sdist_leaves_out():
    # The tests' own files, and what scripts/figures.sh (run by tests/test_docs.py) reads
    # when it is not asked to measure again: the --measured block writes, never reads.
    figures = (ROOT / "scripts" / "figures.sh").read_text()
    texts = {"scripts/figures.sh": re.sub(r'^if \[ "\$\{1:-\}" = "--measured" \]; then\n'
                                          r".*?^fi\n", "", figures, flags=re.M | re.S)}
    for path in (ROOT / "tests").rglob("*.py"):
        texts[str(path.relative_to(ROOT))] = path.read_text()
    for left_out in LEFT_OUT:
        base = os.path.basename(left_out)
        names = {left_out, base} if "/" in left_out and "." in base else {left_out}
        readers = sorted(path for path, text in texts.items()
                         if path != "tests/test_packaging.py" and any(n in text for n in names))
        assert not readers, f"{left_out} is left out of the sdist, but {readers} read it"
