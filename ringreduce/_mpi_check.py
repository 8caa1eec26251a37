"""Whether ringreduce._core was built for the MPI that mpi4py loaded.

mpi4py loads its MPI library with its symbols global, so the core's MPI calls go to that
library whichever the core was linked against. Built against MPICH and run beside an
Open MPI mpi4py (or the reverse), the core hands MPI handles of one ABI to the other's
functions: the first call crashes. MPI_Get_library_version from the core names the
loaded library, not the one built for, so the headers' own family and handle size,
which the core reports without calling MPI, decide first.
"""
from __future__ import annotations

import os
import sys


_maps_before_core: str | None = None  # (see note_mpi4pys_library)


def _read_maps() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:  # (not Linux)
        return None


def note_mpi4pys_library() -> None:
    """Keeps the loader's map as it is before ringreduce._core loads: then the only MPI
    library in it is mpi4py's. (Once the core has loaded, one built against another
    MPI, even of the same family, has that one mapped too, at a lower address.)"""
    global _maps_before_core
    _maps_before_core = _read_maps()


def loaded_mpi_library(maps: str | None = None, family: str | None = None) -> str | None:
    """The path of the MPI library this process has loaded (mpi4py's), from the
    loader's map (`maps`, else as it was before the core loaded, else now): the first
    of `family` ("MPICH", "Open MPI"), or the first of any; None where it cannot tell."""
    if maps is None:
        maps = _maps_before_core or _read_maps()
        if maps is None:
            return None
    found = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(("libmpi.so",
                                                                        "libmpich.so")):
            found.append(fields[5])
    return next((path for path in found if family in (None, library_family(path))),
                found[0] if found else None)


def library_family(path: str) -> str | None:
    """The MPI family whose library this is, by its soname: Open MPI's libmpi.so.40
    (3.0 to 5.x), MPICH's libmpich.so.12 and libmpi.so.12 (MPICH's ABI: Intel MPI's
    too); None for another."""
    name = os.path.basename(path)
    if name.startswith("libmpich.so") or name.startswith("libmpi.so.12"):
        return "MPICH"
    if name.startswith("libmpi.so.4"):
        return "Open MPI"
    return None


def mpicc_of(library: str | None, family: str) -> str | None:
    """The mpicc of the MPI whose library this is: for a distribution's (in /usr/lib),
    the family's own name (Debian's mpicc.mpich, mpicc.openmpi); else bin/mpicc in one
    of the three folders above the library's (<prefix>/lib, as an mpich wheel in a venv
    and most installs lay it out, lib/x86_64-linux-gnu, Intel's intel64/lib/release);
    None where there is none."""
    if not library:
        return None
    candidates = []
    if library.startswith("/usr/lib"):
        import shutil  # (here: with bz2 and lzma, 1.5 ms of every rank's import otherwise)
        # A distribution's: its mpicc is named by family (/usr/bin/mpicc is whichever
        # MPI the alternatives chose).
        candidates.append(shutil.which("mpicc.openmpi" if family == "Open MPI"
                                       else "mpicc.mpich"))
    else:  # <prefix>/lib, lib64, lib/x86_64-linux-gnu, or Intel's intel64/lib/release
        folder = os.path.dirname(os.path.realpath(library))
        for _ in range(3):
            folder = os.path.dirname(folder)
            candidates.append(os.path.join(folder, "bin", "mpicc"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def _loaded_mpi_and_mpicc(loaded_version: str, maps: str | None) -> tuple:
    """(the library of the MPI this process loaded, its mpicc), each None if unknown."""
    family = loaded_family(loaded_version)
    library = loaded_mpi_library(maps, family)
    return library, mpicc_of(library, family)


def mpiexec_of_loaded_mpi(loaded_version: str, maps: str | None = None) -> str | None:
    """The launcher of the MPI this process loaded: beside its mpicc (see mpicc_of) and
    named like it (mpicc.mpich: mpiexec.mpich); None where there is none to be found."""
    mpicc = _loaded_mpi_and_mpicc(loaded_version, maps)[1]
    if mpicc is None:
        return None
    name = os.path.basename(mpicc)
    launcher = os.path.join(os.path.dirname(mpicc), "mpiexec" + name[len("mpicc"):])
    return launcher if os.access(launcher, os.X_OK) else None


def mpiexec_beside_python(or_on_path: bool = False) -> str | None:
    """The mpiexec in this Python's own folder (a virtual environment's bin/: the mpich
    wheel's, or the script that scripts/bootstrap.sh puts there to start a system MPI's),
    where an executable one is there; else, with or_on_path, the one a shell finds on
    PATH; else None. (Beside Python first: PATH's may be another MPI's, whose jobs run
    every process alone, as rank 0 of 1.)"""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    if not or_on_path:
        return None
    import shutil  # (here, as in mpicc_of: not in every rank's import)
    return shutil.which("mpiexec")


def rebuild_hint(loaded_version: str, maps: str | None = None) -> str:
    """What to do about a core built for another MPI: rebuild it with the mpicc of the
    one mpi4py loaded, named where it can be found."""
    library, mpicc = _loaded_mpi_and_mpicc(loaded_version, maps)
    where = f" ({library})" if library else ""
    return (f"Rebuild ringreduce with the mpicc of mpi4py's MPI{where}: "
            f"`MPICC={mpicc or '/path/to/mpicc'} pip install --force-reinstall --no-deps .` "
            "(installing by name, add --no-cache-dir, or pip may reuse a wheel built for "
            "another MPI)")


# The other way round, where ringreduce's MPI is the one meant (a system MPI, say, with
# PyPI's mpi4py wheel, which loads the MPI it finds and not MPICC's).
_OR_MPI4PY = ("\nOr, where ringreduce's MPI is the one you meant, rebuild mpi4py with its mpicc: "
              "`MPICC=/path/to/that/mpicc pip install --force-reinstall --no-cache-dir "
              "--no-binary=mpi4py mpi4py` (PyPI's mpi4py wheel loads the MPI it finds, not "
              "MPICC's)")


def first_line(library_version: str) -> str:
    """MPI_Get_library_version()'s first line, stripped (its name and version; "?" for
    none). Open MPI 4.1's text ends with its terminating NUL."""
    lines = library_version.replace("\0", "").strip().splitlines()
    return lines[0].strip() if lines else "?"


def loaded_family(library_version: str) -> str:
    """The family of the MPI whose MPI_Get_library_version() this is."""
    return "Open MPI" if library_version.lstrip().startswith("Open MPI") else "MPICH"


def cannot_load(error: str, loaded_version: str) -> str:
    """The message where ringreduce._core is built but fails to load (error: the
    loader's words), with the MPI that mpi4py loaded beside it."""
    return ("ringreduce._core is built but cannot load: " + error + "\n"
            f"  mpi4py loaded: {first_line(loaded_version)}\n"
            "The MPI library it was built against may have moved or gone (an mpich "
            "wheel uninstalled or upgraded, an environment copied elsewhere). "
            + rebuild_hint(loaded_version))


def check_same_mpi(built_for, loaded_version: str, loaded_comm_bytes: int | None,
                   core_version=None) -> None:
    """ImportError where the core was built for another MPI than the loaded one.
    built_for: (family, sizeof(MPI_Comm)) from the core's headers; loaded_version and
    loaded_comm_bytes: mpi4py's MPI_Get_library_version() and handle size;
    core_version: the core's own MPI_Get_library_version (a function: it calls MPI,
    so only once the ABI is known to fit)."""
    family, comm_bytes = built_for
    loaded = loaded_family(loaded_version)
    if (family != "other" and family != loaded) or (
            loaded_comm_bytes is not None and comm_bytes != loaded_comm_bytes):
        raise ImportError(
            "ringreduce._core was built for another MPI than the one mpi4py loaded:\n"
            f"  ringreduce: {family} headers (an MPI_Comm of {comm_bytes} bytes)\n"
            f"  mpi4py:     {first_line(loaded_version)}"
            + (f" (an MPI_Comm of {loaded_comm_bytes} bytes)" if loaded_comm_bytes else "")
            + "\n" + rebuild_hint(loaded_version) + _OR_MPI4PY)
    if core_version is not None and core_version().strip() != loaded_version.strip():
        raise ImportError(
            "ringreduce._core was built against a different MPI than the one mpi4py loaded:\n"
            f"  ringreduce: {first_line(core_version())}\n"
            f"  mpi4py:     {first_line(loaded_version)}\n" + rebuild_hint(loaded_version)
            + _OR_MPI4PY)


# What launchers tell each process of the job's size: Hydra (MPICH's mpiexec) and
# PMI-1/2 launchers, Open MPI's mpirun, and PMIx ones.
_LAUNCHED_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def launched_as_one_of(environ) -> tuple[str, int] | None:
    """(variable, size) where the launcher says this process is one of several, else
    None."""
    for name in _LAUNCHED_SIZE:
        try:
            size = int(environ.get(name, ""))
        except ValueError:
            continue
        if size > 1:
            return name, size
    return None


def warn_if_alone_by_mistake(world_size: int, environ, warn) -> None:
    """A job whose every process thinks it is rank 0 of 1, started by another MPI's
    mpiexec (or a launcher this MPI cannot talk to), would train p separate models,
    each on its own data, silently: say so, once, where MPI_COMM_WORLD has 1 rank while
    the launcher says more."""
    launched = launched_as_one_of(environ) if world_size == 1 else None
    if launched is not None:
        from mpi4py import MPI  # (initialised: world_size came from it)

        name, size = launched
        launcher = mpiexec_of_loaded_mpi(MPI.Get_library_version())
        warn(f"ringreduce: MPI_COMM_WORLD has 1 rank here, but the launcher said {size} "
             f"({name}={size}): every process runs alone, each its own rank 0 of 1. Its "
             "mpiexec belongs to another MPI than the one mpi4py loaded: start the job "
             "with that MPI's mpiexec (" + (launcher or "in a venv with the mpich wheel, "
                                             "its bin/mpiexec") + ")")
