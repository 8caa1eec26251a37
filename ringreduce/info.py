"""What this installation of ringreduce is made of, for a bug report or before a long job:

    python -m ringreduce info                  # this process: versions, MPI, CUDA, settings
    mpiexec -n 4 python -m ringreduce info     # and the ring those ranks make

Versions (ringreduce, Python, numpy, mpi4py, cupy, ml_dtypes), the MPI that mpi4py
loads and the one the core was built for, the mpiexec a shell would start (another MPI's
launcher starts every process as a job of its own, of one rank), CUDA, and the
RINGREDUCE_* settings in the environment. Under mpiexec, rank 0 also prints the ring
the ranks make (its order, the machines, the wire and why) and every way in which
another rank's installation differs from rank 0's, as where one node of a cluster has
another environment: ranks that disagree on versions may run different code.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata

import numpy as np
from mpi4py import MPI

from . import __version__, _core, _types, reference
from ._mpi_check import first_line, loaded_family, mpiexec_beside_python, mpiexec_of_loaded_mpi, \
    warn_if_alone_by_mistake

_SETTINGS = ("RINGREDUCE_TIMEOUT", "RINGREDUCE_SHM", "RINGREDUCE_RING", "RINGREDUCE_CUDA_AWARE")


def _version_of(*distributions: str) -> str:
    """The first installed distribution's version, without importing it ("not
    installed" where none is)."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def launcher_family(path: str, timeout: float = 10.0) -> str:
    """Which MPI an mpiexec belongs to, from its --version: "MPICH (Hydra 5.0.2)",
    "Open MPI 4.1.4", ..., or "unknown (why)"."""
    try:
        # (os.environ given: the C environment of a rank of an Open MPI job has the
        # job's own variables, with which a launcher thinks it runs inside that job.)
        done = subprocess.run([path, "--version"], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, env=dict(os.environ))
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({type(error).__name__})"
    text = done.stdout + done.stderr
    if "Intel(R) MPI" in text:  # (its launcher is a Hydra too)
        return "Intel MPI (MPICH's ABI)"
    if "HYDRA" in text:
        version = re.search(r"Version:\s*(\S+)", text)
        return f"MPICH (Hydra {version.group(1)})" if version else "MPICH (Hydra)"
    # "mpiexec (OpenRTE) 4.1.4", "mpirun (Open MPI) 5.0.3"
    version = re.search(r"\((?:Open ?RTE|Open MPI)\)\s*(\S+)", text)
    if version or "Open MPI" in text:
        return f"Open MPI {version.group(1)}" if version else "Open MPI"
    first = text.strip().splitlines()[0][:60] if text.strip() else "no output"
    return f"unknown ({first})"


def _launchers() -> list[tuple[str, str]]:
    """(where, path) of the mpiexec beside this Python and the one on PATH, each where
    there is one (PATH's only where it is another file)."""
    found = []
    beside = mpiexec_beside_python()
    if beside:
        found.append(("beside this Python", beside))
    on_path = shutil.which("mpiexec")
    if on_path and (not beside or os.path.realpath(on_path) != os.path.realpath(beside)):
        found.append(("on PATH", on_path))
    return found


def installation() -> dict:
    """What this process runs: every value a string, to compare rank by rank."""
    family, comm_bytes = _core.mpi_built_for()
    major, minor = MPI.Get_version()
    gpus = _core.cuda_device_count() if _core.cuda_built() else 0
    return {
        "ringreduce": f"{__version__} in {os.path.dirname(__file__)}",
        "Python": f"{platform.python_version()} ({sys.executable})",
        "numpy": np.__version__,
        "mpi4py": _version_of("mpi4py"),
        "MPI": f"{' '.join(first_line(MPI.Get_library_version()).split())} "
               f"(MPI {major}.{minor})",
        "core built for": f"{family} headers (an MPI_Comm of {comm_bytes} bytes)",
        "CUDA kernels": "built" if _core.cuda_built() else "not built (a CPU-only build)",
        "GPUs": str(gpus) if gpus else f"none ({_core.cuda_status()})",
        "GPU pointers to MPI": (f"{'yes' if _core.mpi_cuda_aware() else 'no'} "
                                f"({_core.mpi_cuda_aware_reason()})"),
        "cupy": _version_of("cupy", "cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x"),
        "bfloat16": ("yes (ml_dtypes " + _version_of("ml_dtypes") + ")"
                     if "bfloat16" in _types.supported_dtypes() else
                     "no (pip install ml_dtypes)"),
        "settings": " ".join(f"{name}={os.environ[name]}" for name in _SETTINGS
                             if name in os.environ) or "none set (the defaults)",
    }


def _lines(values: dict) -> list[str]:
    width = max(len(key) for key in values)
    return [f"{key:<{width}}  {value}" for key, value in values.items()]


def report(world=MPI.COMM_WORLD, launchers=None) -> str | None:
    """The report, on rank 0 of world (None on the others). Collective."""
    mine = installation()
    everyone = world.gather((mine, reference.machine_of_this_process()), root=0)
    ring = None
    if world.Get_size() > 1:
        from .communicator import Communicator

        try:
            with Communicator(world) as comm:
                ring = (comm.ring, comm.transport, comm.transport_reason, comm.chunk_bytes,
                        comm.timeout)
        except Exception as error:  # (the report says so: it is what the user must know)
            ring = f"{type(error).__name__}: {error}"
    if world.Get_rank() != 0:
        return None
    values, warnings = dict(mine), []
    wanted = loaded_family(MPI.Get_library_version())
    right = mpiexec_of_loaded_mpi(MPI.Get_library_version())
    for where, path in (_launchers() if launchers is None else launchers):
        family = launcher_family(path)
        values[f"mpiexec {where}"] = f"{path}: {family}"
        abi = "Open MPI" if family.startswith("Open MPI") else "MPICH"  # (Intel's too)
        if not family.startswith("unknown") and abi != wanted:
            warnings.append(f"warning: the mpiexec {where} is another MPI's than mpi4py's:\n"
                            "  a job it starts runs every process alone, as rank 0 of 1; "
                            f"start jobs with {wanted}'s mpiexec"
                            + (f", {right}" if right else ""))
    # (Under another MPI's mpiexec every process is rank 0 of 1, and prints this.)
    warn_if_alone_by_mistake(world.Get_size(), os.environ,
                             lambda text: warnings.append("warning: " + text.replace(
                                 "ringreduce: ", "", 1)))
    # Alone, where no Communicator is made (under mpiexec the ring's line shows its
    # refusal), every setting one would refuse.
    if world.Get_size() == 1:
        from .communicator import _default_timeout, _settings_refused

        refused = "a Communicator refuses this setting"
        warnings += [f"warning: {refused}: {why}" for why in _settings_refused()]
        try:
            _default_timeout(refused)
        except ValueError as error:
            warnings.append(f"warning: {error}")
    lines = _lines(values) + warnings
    if ring is not None:
        lines.append("")
        lines.extend(_ring_lines(everyone, ring))
    return "\n".join(lines)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _ring_text(order) -> str:
    """The ring's order, shortened for many ranks (in rank order, or the ends of it)."""
    size = len(order)
    if size > 8 and list(order) == list(range(size)):
        return f"0 -> 1 -> ... -> {size - 1} -> 0 (rank order)"
    shown = [str(r) for r in order] if size <= 16 else \
        [str(r) for r in order[:8]] + ["..."] + [str(r) for r in order[-4:]]
    return " -> ".join(shown) + f" -> {order[0]}"


def _ring_lines(everyone, ring) -> list[str]:
    size = len(everyone)
    machines = list(dict.fromkeys(machine for _, machine in everyone))
    hosts = [m.split("/")[0] for m in machines]
    lines = [f"{size} ranks on {len(machines)} machine{'s' * (len(machines) > 1)}: "
             + ", ".join(f"{host} ({sum(m == machine for _, m in everyone)})"
                         for host, machine in zip(hosts, machines))]
    if isinstance(ring, str):
        lines.append(f"no ring: making a Communicator raised {ring}")
    else:
        order, transport, reason, chunk, timeout = ring
        lines.append("ring: " + _ring_text(order))
        lines.append(f"wire: {transport}" + (f" ({reason})" if reason else ""))
        # Through shared memory a chunk is at most a slot: 256 KiB chunks alone read as
        # if every call's chunks were that large.
        slot = transport == "shared memory" and chunk > _core.SHM_SLOT_BYTES
        lines.append(f"chunk: {chunk} bytes"
                     + (f" ({_core.SHM_SLOT_BYTES} through shared memory, a slot, which calls "
                        f"of up to {_core.SHM_MAX_BYTES} bytes may take)" if slot else "")
                     + "; timeout: " + ("none" if timeout is None else f"{timeout:g} s"))
    # Grouped by what differs and how: on a cluster, whole machines do.
    first, differ = everyone[0][0], []
    for key in first:
        ranks_of: dict = {}
        for r, (theirs, _) in enumerate(everyone):
            if theirs[key] != first[key]:
                ranks_of.setdefault(theirs[key], []).append(r)
        for value, ranks in ranks_of.items():
            where = list(dict.fromkeys(everyone[r][1].split("/")[0] for r in ranks))
            on = ", ".join(where[:3]) + (", ..." if len(where) > 3 else "")
            differ.append(f"{key} {value} on rank{'s' * (len(ranks) > 1)} {_ranges(ranks)} "
                          f"({on}); rank 0: {first[key]}")
    lines.append("every rank runs the same installation" if not differ else
                 "ranks whose installation differs from rank 0's:")
    lines.extend("  " + line for line in differ)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ringreduce info",
        description="What this installation is made of: versions, the MPI mpi4py loads and "
        "the one ringreduce was built for, the mpiexec a shell would start, CUDA, settings. "
        "Under mpiexec (mpiexec -n 4 python -m ringreduce info), rank 0 also prints the "
        "ring the ranks make and where any rank's installation differs from rank 0's.")
    parser.parse_args(argv)
    text = report()
    if text is not None:
        print(text, flush=True)
    return 0
