#!/usr/bin/env bash
# Prints the mpiexec that belongs to the MPI of the mpicc given (a path or a name on
# PATH), or nothing (exit 1) where there is none. It is the launcher beside that mpicc
# and named like it: mpicc -> mpiexec, mpicc.mpich -> mpiexec.mpich. Links are followed
# and the last match wins: Debian's /usr/bin/mpicc leads, through /etc/alternatives,
# to mpicc.openmpi or mpicc.mpich, while /usr/bin/mpiexec is an alternative of its own
# that may name the other MPI. A launcher of another MPI would start N singletons of
# one rank each instead of one job of N ranks.
set -euo pipefail
path=$(command -v "${1:?usage: mpiexec_for.sh MPICC}") || exit 1
found=""
for _ in 1 2 3 4 5 6 7 8 9 10; do
  name=${path##*/}
  dir=$(dirname "$path")
  if [[ $name == mpicc* ]] && [ -x "$dir/mpiexec${name#mpicc}" ]; then
    found="$dir/mpiexec${name#mpicc}"
  fi
  [ -L "$path" ] || break
  target=$(readlink "$path")
  [[ $target == /* ]] || target="$dir/$target"
  path=$target
done
[ -n "$found" ] || exit 1
echo "$found"
