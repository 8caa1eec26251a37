"""What an sdist carries: everything csrc/ holds (setuptools itself takes only the .cc
sources named in setup.py, and an sdist without the headers cannot build), made on a
machine with neither MPI nor CUDA at hand."""
import shutil
import subprocess
import sys
import tarfile

from launch import ROOT, job_env


def test_sdist_carries_all_of_csrc_and_needs_no_mpi_or_cuda(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for name in ("csrc", "ringreduce"):
        shutil.copytree(ROOT / name, tree / name,
                        ignore=shutil.ignore_patterns("*.so", "*.o", "__pycache__"))
    # setup.py looks for MPI and CUDA only when it builds: this setting would stop it.
    done = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)],
                          cwd=tree, capture_output=True, text=True, timeout=120,
                          env=job_env({"RINGREDUCE_CUDA": "not a setting"}))
    assert done.returncode == 0, done.stdout + done.stderr
    (sdist,) = tmp_path.glob("ringreduce-*.tar.gz")
    with tarfile.open(sdist) as archive:
        carried = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    wanted = {f"csrc/{path.name}" for path in (ROOT / "csrc").iterdir()}
    assert wanted <= carried, sorted(wanted - carried)
    assert {"setup.py", "pyproject.toml", "README.md", "ringreduce/__init__.py"} <= carried
