#!/usr/bin/env bash
# Regenerates every figure in docs/images/ from the scripts in this repository.
#   bash scripts/figures.sh            the figures computed from the code (seconds)
#   bash scripts/figures.sh --measured also the measured ones (benchmarks; minutes)
# Sets up first where needed (scripts/bootstrap.sh), like the other scripts: the
# figures need the built extension, mpiexec and matplotlib, all in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
PY=.venv/bin/python
MPIEXEC=.venv/bin/mpiexec
OUT=${FIGURES_DIR:-docs/images}
mkdir -p "$OUT"

R=benchmarks/results/digits

if [ "${1:-}" = "--measured" ]; then
  # Five runs, as docs/performance.md summarises (summarize.py); the plot is run 1's.
  for i in 1 2 3 4 5; do
    $MPIEXEC -n 2 $PY -m mpi4py benchmarks/bench_allreduce.py \
        --json benchmarks/results/allreduce_p2_run$i.json \
        $( [ $i = 1 ] && echo --plot "$OUT/allreduce_busbw_p2.png" )
  done
  $MPIEXEC -n 2 $PY -m mpi4py benchmarks/fit_model.py --json benchmarks/results/model_p2.json \
      --plot "$OUT/cost_model_p2.png"
  $MPIEXEC -n 4 $PY -m mpi4py benchmarks/ps_vs_ring.py --mib 4 --plot "$OUT/ps_vs_ring_4.png"
  $MPIEXEC -n 2 $PY -m mpi4py benchmarks/wire_choice.py --seconds 420 \
      --json benchmarks/results/wire_choice_p2.json --plot "$OUT/wire_choice_p2.png"
  for n in 1 2 4; do
    $MPIEXEC -n $n $PY -m mpi4py examples/train_digits.py --json $R/ranks$n.json
  done
  for c in fp16 bf16 powersgd; do
    $MPIEXEC -n 2 $PY -m mpi4py examples/train_digits.py --compression $c --json $R/ranks2_$c.json
  done
fi

# Computed from the code and from the results above (after them, so that a --measured
# run draws its own): the explainer's ring, the pipeline, the cost model, the digits runs.
$PY -m ringreduce explain --ranks 4 --count 12 --svg "$OUT/ring_4_ranks.svg" > /dev/null
$PY -m ringreduce sim --ranks 3 --bytes 12M --chunk 1M --timeline "$OUT/pipeline_3_ranks.png" > /dev/null
$PY benchmarks/plot_cost_model.py --model benchmarks/results/model_p2.json \
    --measured 'benchmarks/results/allreduce_p2_run*.json' --plot "$OUT/cost_model_ranks.png" > /dev/null
$PY benchmarks/summarize.py benchmarks/results/allreduce_p2_run*.json \
    --plot "$OUT/speedup_p2.png" > /dev/null
$PY benchmarks/summarize.py benchmarks/results/allreduce_p2_1203_run*.json \
    --plot "$OUT/speedup_p2_1203.png" > /dev/null
$PY benchmarks/summarize.py benchmarks/results/allreduce_p2_streaming_run*.json \
    --plot "$OUT/speedup_p2_streaming.png" > /dev/null
$PY examples/compare_runs.py $R/ranks1.json $R/ranks2.json $R/ranks4.json \
    --plot "$OUT/digits_ranks.png" > /dev/null
$PY examples/compare_runs.py $R/ranks2.json $R/ranks2_fp16.json $R/ranks2_bf16.json \
    $R/ranks2_powersgd.json --plot "$OUT/digits_compression.png" > /dev/null

# Measured on a GPU by benchmarks/gpu_check.sh, on a lent machine (not rerun here): its
# OUTDIR/gpu_allreduce_p2.png is copied to $OUT/gpu_allreduce_p2.png, its JSON files to
# benchmarks/results/gpu_h200_*.json, from which these two are drawn:
$PY benchmarks/bench_gpu.py --replot benchmarks/results/gpu_h200_p4.json \
    --plot "$OUT/gpu_allreduce_p4.png" > /dev/null
$PY benchmarks/bench_gpu.py --replot benchmarks/results/gpu_h200_p2_mps.json \
    --plot "$OUT/gpu_allreduce_p2_mps.png" --note "under MPS" > /dev/null
