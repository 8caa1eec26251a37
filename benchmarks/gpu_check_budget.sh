# The time budget of benchmarks/gpu_check.sh, which sources this (tests/test_benchmarks.py
# too). Whoever sources it sets BUDGET (seconds), T0 ($SECONDS at the start) and OUTDIR.

# A step's timeout: its own cap ($1), or what is left of the budget (less the 5 s that
# within() gives a step to end after its TERM), whichever is less; 0 once under 10 s are
# left.
cap() { local left=$((BUDGET - (SECONDS - T0) - 5)); [ "$left" -ge 10 ] || left=0
        echo $(( left < $1 ? left : $1 )); }

# "$@" under the timeout cap($1), or not started (status 124) once the budget is spent:
# `timeout 0` would never stop it.
within() { local limit; limit=$(cap "$1"); shift
  if [ "$limit" -eq 0 ]; then echo "(not started: the budget of $BUDGET s is spent)"; return 124; fi
  timeout -k 5 "$limit" "$@"; }

# Whether a benchmark table's step failed, from its status ($1), the limit it was
# started under ($2, a cap() of its own cap) and its own cap ($3). One stopped by
# timeout at a limit below its own cap ran out of budget, not into a hang: its table is
# incomplete, as a table never started is left out, and the tests before it decide the
# check. (Status 124: stopped by TERM; 137: by the KILL that follows.)
table_failed() {
  [ "$1" -eq 0 ] && return 1
  if { [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; } && [ "$2" -lt "$3" ]; then
    echo "(stopped at the budget of $BUDGET s: this table is incomplete)" \
      | tee -a "$OUTDIR/tests.txt"
    return 1
  fi
  return 0
}
