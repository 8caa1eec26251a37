"""Builds ringreduce._core against the MPI that `mpicc` names.

MPICC overrides; otherwise the mpicc beside this Python (a venv with the `mpich`
wheel) wins over the one on PATH. We ask the wrapper for its flags (`-show` for
MPICH, `--showme` for Open MPI) and compile with the ordinary C++ compiler, so the
extension links the same libmpi that mpi4py loads at run time. MPI is never part
of the isolated build environment: a library linked from there would vanish.
"""
import os
import shlex
import shutil
import subprocess
import sys
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup


def find_mpicc():
    candidates = [os.environ.get("MPICC"),
                  os.path.join(os.path.dirname(sys.executable), "mpicc"),
                  shutil.which("mpicc")]
    for candidate in candidates:
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    sys.exit("ringreduce: no MPI found. Install one (`pip install mpich`, or your system's "
             "MPI development package) or point MPICC at its mpicc.")


def mpi_flags(mpicc):
    for query in ("-show", "--showme"):
        result = subprocess.run([mpicc, query], capture_output=True, text=True)
        if result.returncode == 0 and result.stdout.strip():
            tokens = shlex.split(result.stdout)[1:]  # drop the compiler itself
            break
    else:
        sys.exit(f"ringreduce: {mpicc} answers neither -show nor --showme")
    flags = {"include_dirs": [], "library_dirs": [], "libraries": [], "extra_link_args": []}
    for token in tokens:
        if token.startswith("-I"):
            flags["include_dirs"].append(token[2:])
        elif token.startswith("-L"):
            flags["library_dirs"].append(token[2:])
            flags["extra_link_args"].append("-Wl,-rpath," + token[2:])
        elif token.startswith("-l"):
            flags["libraries"].append(token[2:])
        elif token.startswith("-Wl,") or token == "-pthread":
            flags["extra_link_args"].append(token)
    return flags


mpicc = find_mpicc()
print(f"ringreduce: building against {mpicc}")
core = Pybind11Extension(
    "ringreduce._core",
    sorted(glob("csrc/*.cc")),
    cxx_std=17,
    # The C API only: Open MPI's and MPICH's headers otherwise drag in the long-dead
    # MPI C++ bindings, whose symbols Open MPI's libmpi no longer exports.
    define_macros=[("OMPI_SKIP_MPICXX", "1"), ("MPICH_SKIP_MPICXX", "1")],
    # No FMA contraction: the core must round exactly like the numpy reference.
    extra_compile_args=["-O3", "-ffp-contract=off"],
    **mpi_flags(mpicc),
)

setup(packages=["ringreduce"], ext_modules=[core], cmdclass={"build_ext": build_ext})
