#!/usr/bin/env bash
# Sets up everything ringreduce needs in ./.venv and builds it there; safe to re-run
# (it only reinstalls what changed). On a fresh machine it needs python3 (with venv)
# and a C++ compiler; MPI comes from PyPI's `mpich` wheel.
#
# To use a system MPI instead (MPICH or Open MPI), point MPICC at its mpicc:
#   MPICC=/usr/bin/mpicc bash scripts/bootstrap.sh
#   MPICC=/usr/bin/mpicc.mpich bash scripts/bootstrap.sh   # Debian's MPICH beside Open MPI
# Later runs keep it (scripts/test.sh and scripts/demo.sh run this one first);
# MPICC=wheel goes back to the mpich wheel.
# mpi4py is then built from source against that MPI, and so is ringreduce, and
# .venv/bin/mpiexec starts that MPI's launcher (scripts/mpiexec_for.sh finds it beside
# mpicc; MPIEXEC=/path/to/mpiexec names it where it is elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
deps_stamp="$VENV/.ringreduce-deps"

# The MPI the last run set up: "mpi=mpich-wheel", "mpi=/usr/bin/mpicc"; none yet: "".
chosen=$(head -n 1 "$deps_stamp" 2>/dev/null | cut -d' ' -f1 || true)

# The MPI chosen before stays, unless MPICC names another: a later run without MPICC
# (scripts/test.sh, scripts/demo.sh) used to swap a system MPI's set-up for the wheel's,
# and going back cost a new build of mpi4py. MPICC=wheel goes back to MPICH from PyPI.
if [ "${MPICC:-}" = wheel ]; then
  unset MPICC
elif [ -z "${MPICC:-}" ] && [ -n "$chosen" ] && [ "$chosen" != mpi=mpich-wheel ]; then
  echo "bootstrap: keeping $VENV's MPI, MPICC=${chosen#mpi=} (MPICC=wheel goes back to MPICH from PyPI)"
  export MPICC=${chosen#mpi=}
fi

# A mistyped MPICC: said now, before the dependencies of another MPI are uninstalled.
if [ -n "${MPICC:-}" ] && ! command -v "$MPICC" >/dev/null; then
  echo "bootstrap: MPICC=$MPICC: no such executable (MPICC=wheel uses MPICH from PyPI)" >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

deps_wanted="mpi=${MPICC:-mpich-wheel} $(cat scripts/requirements.txt)"
if [ "$(cat "$deps_stamp" 2>/dev/null)" != "$deps_wanted" ]; then
  echo "bootstrap: installing dependencies (${MPICC:-MPICH from PyPI})"
  "${PIP[@]}" install --upgrade pip
  if [ -n "${MPICC:-}" ]; then
    "${PIP[@]}" uninstall -y mpich mpi4py >/dev/null 2>&1 || true
    MPICC="$MPICC" "${PIP[@]}" install --no-binary=mpi4py --no-cache-dir mpi4py
  else
    # Back from a system MPI: its mpi4py, built for it, would stay (pip sees one
    # installed), and ringreduce then refuses to import; its launcher (below) is not
    # the wheel's.
    if [ "$chosen" != "mpi=mpich-wheel" ]; then
      "${PIP[@]}" uninstall -y mpi4py >/dev/null 2>&1 || true
    fi
    ! grep -qs "ringreduce bootstrap.sh" "$VENV/bin/mpiexec" || rm -f "$VENV/bin/mpiexec"
    "${PIP[@]}" install mpich mpi4py
  fi
  "${PIP[@]}" install -r scripts/requirements.txt
  echo "$deps_wanted" > "$deps_stamp"
fi

# A system MPI's launcher, where the mpich wheel's would be: the tests, scripts/demo.sh
# and an activated .venv start .venv/bin/mpiexec. The one on PATH may be another MPI's
# (Debian's /usr/bin/mpiexec is Open MPI's when both are installed), which starts every
# rank as a job of its own, of one rank. A script that execs it, not a link: MPICH's
# Hydra looks for hydra_pmi_proxy beside the path it was started by.
WRAPPER_MARK="# ringreduce bootstrap.sh: the launcher of MPICC's MPI"
if [ -n "${MPICC:-}" ]; then
  launcher=${MPIEXEC:-$(bash scripts/mpiexec_for.sh "$MPICC" || true)}
  if [ -n "$launcher" ] && ! launcher=$(command -v "$launcher"); then
    echo "bootstrap: MPIEXEC=${MPIEXEC:-}: no such executable" >&2
    exit 1
  elif [ -z "$launcher" ]; then
    echo "bootstrap: no mpiexec beside $MPICC: the tests will start the one on PATH;" \
         "name this MPI's with MPIEXEC=/path/to/mpiexec" >&2
  else
    wrapper=$(printf '#!/bin/sh\n%s\nexec %q "$@"\n' "$WRAPPER_MARK" "$launcher")
    if [ "$(cat "$VENV/bin/mpiexec" 2>/dev/null)" != "$wrapper" ]; then
      echo "$wrapper" > "$VENV/bin/mpiexec.new"
      chmod +x "$VENV/bin/mpiexec.new"
      # (Open MPI's variables let it run 2 ranks on 1 core, and as root; MPICH ignores them.)
      # Each rank 0 prints how many ranks it met: one job of 2 says "2" once, and two
      # jobs of 1 (another MPI's launcher) "1" twice. (Where both ranks printed, Open
      # MPI sometimes interleaved their lines: "22".)
      sizes=$(OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_ALLOW_RUN_AS_ROOT=1 \
              OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 "$VENV/bin/mpiexec.new" -n 2 \
              "$VENV/bin/python" -c 'from mpi4py import MPI; n = MPI.COMM_WORLD.allreduce(1)
if MPI.COMM_WORLD.rank == 0: print(n)' 2>"$VENV/.mpiexec-check.err" | tr '\n' ' ' || true)
      if [ "$sizes" != "2 " ]; then
        rm -f "$VENV/bin/mpiexec.new"
        echo "bootstrap: $launcher -n 2 did not start one job of 2 ranks (sizes: $sizes)." \
             "Is it the launcher of $MPICC's MPI? Name that one with MPIEXEC=/path/to/mpiexec." \
             "Its errors:" >&2
        tail -n 20 "$VENV/.mpiexec-check.err" >&2
        exit 1
      fi
      echo "bootstrap: $VENV/bin/mpiexec starts $launcher"
      mv -f "$VENV/bin/mpiexec.new" "$VENV/bin/mpiexec"
    fi
  fi
fi

# Rebuild the extension when its sources, the MPI or the build's settings change (the
# variables setup.py reads, and whether there is an nvcc: a CUDA toolkit installed
# after the first run), or when it is not the one this script built (a build by hand,
# with RINGREDUCE_SANITIZE say, would otherwise stay, and fail every import). No build
# isolation: the extension must link the MPI in this venv (or MPICC's), which mpi4py
# loads.
build_settings="cuda=${RINGREDUCE_CUDA:-auto} archs=${RINGREDUCE_CUDA_ARCHS:-}"
build_settings+=" sanitize=${RINGREDUCE_SANITIZE:-} cuda_home=${CUDA_HOME:-}:${CUDA_PATH:-}"
# (Every nvcc setup.py would find: on PATH, or in CUDA_HOME, CUDA_PATH, /usr/local/cuda.)
build_settings+=" nvcc=$(command -v nvcc || true) $( (ls "${CUDA_HOME:-/-}/bin/nvcc" \
  "${CUDA_PATH:-/-}/bin/nvcc" /usr/local/cuda/bin/nvcc 2>/dev/null || true) | tr '\n' ' ')"
build_wanted=$(echo "$deps_wanted $build_settings $(cat setup.py pyproject.toml csrc/* | sha256sum)" |
               tr '\n' ' ')  # (one line: the stamp's second is the built core's)
build_stamp="$VENV/.ringreduce-build"
built_core() { cat ringreduce/_core*.so 2>/dev/null | sha256sum; }
if [ "$(head -n 1 "$build_stamp" 2>/dev/null)" != "$build_wanted" ] || \
   [ "$(sed -n 2p "$build_stamp" 2>/dev/null)" != "$(built_core)" ] || \
   ! ls ringreduce/_core*.so >/dev/null 2>&1; then
  echo "bootstrap: building ringreduce (compiling the C++ core, and the CUDA part where nvcc is: 1-3 minutes)"
  "${PIP[@]}" install --no-build-isolation --no-deps -e .
  { echo "$build_wanted"; built_core; } > "$build_stamp"
fi
