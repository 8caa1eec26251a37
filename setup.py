"""Builds ringreduce._core against the MPI that `mpicc` names, with CUDA kernels where
nvcc is found (RINGREDUCE_CUDA=0 forces them off, =1 on).

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

from setuptools import setup

try:
    import pybind11
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError:  # pip's isolated build installs it; --no-build-isolation does not
    sys.exit("ringreduce: building needs pybind11>=2.12; with --no-build-isolation, first "
             "pip install 'pybind11>=2.12' 'setuptools>=64' wheel")


def find_mpicc():
    named = os.environ.get("MPICC")
    if named and not shutil.which(named):  # (a typo would build against another MPI)
        sys.exit(f"ringreduce: MPICC={named}: no such executable (unset MPICC to build "
                 "against the mpicc beside this Python, or on PATH)")
    candidates = [named,
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


def find_nvcc():
    """(nvcc, CUDA home) if the CUDA build is wanted and possible, else None."""
    wanted = os.environ.get("RINGREDUCE_CUDA") or "auto"
    if wanted not in ("auto", "0", "1"):
        sys.exit(f"ringreduce: RINGREDUCE_CUDA must be 0 (no CUDA build), 1 (a CUDA build, "
                 f"or fail) or unset (a CUDA build where nvcc is found); got {wanted!r}")
    if wanted == "0":
        return None
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc") or next(
        (os.path.join(h, "bin", "nvcc") for h in homes
         if h and os.path.exists(os.path.join(h, "bin", "nvcc"))), None)
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    home = next((h for h in homes
                 if h and os.path.exists(os.path.join(h, "include", "cuda_runtime.h"))), None)
    if nvcc and home:
        return nvcc, home
    if wanted == "1":
        sys.exit("ringreduce: RINGREDUCE_CUDA=1 but no nvcc with a CUDA toolkit was found "
                 "(set CUDA_HOME)")
    return None


def cuda_gencode(nvcc):
    """Real code for the GPU generations the toolkit knows, and PTX for the newest."""
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    known = {int(a.split("_")[1]) for a in listed.split() if a.startswith("compute_")}
    archs = sorted(known & {75, 80, 86, 89, 90, 100, 120}) or [80, 90]
    # RINGREDUCE_CUDA_ARCHS="90" builds for those only: quicker where the GPU is known.
    wanted = os.environ.get("RINGREDUCE_CUDA_ARCHS", "").replace(",", " ").split()
    if wanted:
        archs = sorted(int(a) for a in wanted)
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return flags + [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]


def add_mpi_and_cuda(ext):
    """MPI's flags (and CUDA's, where it builds) for the extension, found only when it is
    built: an sdist, or pip's metadata step, needs neither."""
    mpicc = find_mpicc()
    cuda = find_nvcc()
    print(f"ringreduce: building against {mpicc}; CUDA: {cuda[1] if cuda else 'no'}")
    flags = mpi_flags(mpicc)
    if cuda:
        ext.define_macros.append(("RINGREDUCE_WITH_CUDA", "1"))
        flags["include_dirs"].append(os.path.join(cuda[1], "include"))
        flags["library_dirs"].append(os.path.join(cuda[1], "lib64"))
        # The static runtime: the extension still imports on machines without CUDA.
        flags["libraries"] += ["cudart_static", "rt", "dl", "pthread"]
    for key, values in flags.items():
        setattr(ext, key, values + getattr(ext, key))
    return cuda


class BuildWithCuda(build_ext):
    """Compiles csrc/*.cu with nvcc first, then links the objects into the extension."""

    def build_extension(self, ext):
        # (Without one, nvcc's "failed to preprocess host compiler properties", or a
        # missing file, is all a build would say.)
        # What compiles the C++ files: compiler_so (gcc, which takes C++ too where g++ is
        # installed), or in newer setuptools compiler_so_cxx; and what links them,
        # compiler_cxx (g++), in every setuptools (linker_so_cxx's first word is replaced
        # by it). gcc without g++ failed at the first C++ file, or at the link, with a
        # traceback.
        compiles = "compiler_so_cxx" if getattr(self.compiler, "compiler_so_cxx", None) \
            else "compiler_so"
        for name in (compiles, "compiler_cxx"):
            command = getattr(self.compiler, name, None)
            if command and not shutil.which(command[0]):
                sys.exit(f"ringreduce: no C++ compiler: {command[0]} was not found (install "
                         "g++, e.g. apt install build-essential, or set CC and CXX)")
        cuda = add_mpi_and_cuda(ext)
        if cuda:
            nvcc, _ = cuda
            os.makedirs(self.build_temp, exist_ok=True)
            for source in sorted(glob("csrc/*.cu")):
                obj = os.path.join(self.build_temp, os.path.basename(source) + ".o")
                # -fmad=false: no fused multiply-adds, so GPU results round like the CPU's.
                command = [nvcc, "-std=c++17", "-O3", "-fmad=false", "--expt-relaxed-constexpr",
                           "-Xcompiler", "-fPIC", *cuda_gencode(nvcc), "-c", source, "-o", obj]
                print(" ".join(command))
                subprocess.run(command, check=True)
                ext.extra_objects.append(obj)
        # Always link afresh: a build folder left by another build (another venv's MPI, or
        # RINGREDUCE_CUDA=0 where this one asks for CUDA) holds an extension newer than the
        # sources, which setuptools would otherwise ship as it is. It compiles every source
        # whenever it links, so this costs only builds where nothing changed.
        self.force = True
        super().build_extension(ext)


# Older pybind11 reads a dtype's itemsize at numpy 1's offset: under numpy 2 every array
# would look 0 bytes long, and calls would return garbage.
if tuple(int(part) for part in pybind11.__version__.split(".")[:2]) < (2, 12):
    sys.exit(f"ringreduce: pybind11 {pybind11.__version__} cannot read numpy 2's dtypes; "
             "install pybind11>=2.12 (pip install -U pybind11)")
core = Pybind11Extension(
    "ringreduce._core",
    sorted(glob("csrc/*.cc")),
    cxx_std=17,
    # The MPI C API only: Open MPI's and MPICH's headers otherwise drag in the
    # long-dead MPI C++ bindings, whose symbols Open MPI's libmpi lacks.
    define_macros=[("OMPI_SKIP_MPICXX", "1"), ("MPICH_SKIP_MPICXX", "1")],
    # No FMA contraction: the core must round exactly like the numpy reference.
    extra_compile_args=["-O3", "-ffp-contract=off"],
)

# RINGREDUCE_SANITIZE=address (ASan with UBSan) or thread (TSan) instruments the core for
# the checks in docs/development.md; its -O1 comes after, and wins over, the -O3 above.
SANITIZERS = {"address": "address,undefined", "thread": "thread"}
sanitize = os.environ.get("RINGREDUCE_SANITIZE")
if sanitize:
    if sanitize not in SANITIZERS:
        sys.exit(f"ringreduce: RINGREDUCE_SANITIZE must be address or thread; got {sanitize!r}")
    flags = [f"-fsanitize={SANITIZERS[sanitize]}", "-fno-omit-frame-pointer", "-g"]
    core.extra_compile_args += flags + ["-O1"]
    core.extra_link_args += flags

setup(packages=["ringreduce"], ext_modules=[core], cmdclass={"build_ext": BuildWithCuda})
