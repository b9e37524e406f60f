#!/usr/bin/env bash
# Everything one lent-GPU call does, in order: install pitgen (offline), then the named steps:
#   tests     GPU test suite (pytest -m gpu, 8 workers)
#   cpu-torch the CPU tests, here where torch is installed (CI has no torch: the tests that need
#             it skip there), 4 workers (at 12, the load pushed tests with wall-clock bounds past
#             them)
#   thorough  the kernel families' GPU property tests in Hypothesis's thorough profile
#             (PITGEN_HYPOTHESIS=thorough: >= 2000 fresh examples per family), 8 workers, stopped
#             after THOROUGH_TIMEOUT (500 s); per-test example counts in $LOGS/thorough-counts.txt.
#             THOROUGH_TESTS replaces the selection below, THOROUGH_SEED repeats a run
#             (docs/testing.md)
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck on one launch of every kernel
#             kind (SANITIZE_TOOLS picks)
#   example   build and run the standalone example against generated/ (make -C generated/example
#             run, ARCH=sm_90a on Hopper: the sm_90a kernels too)
#   tune      schedule sweep (scripts/tune_schedules.py)
#   tune-attention, tune-spmm, bench-rows (scripts/bench_rows.py)
#             the attention pipeline / SpMM gather-unroll sweeps (scripts/tune_<op>.py)
#   profile   measure the planner's cost profile (scripts/measure_profile.py)
#   ncu       Nsight Compute on scripts/profile_cases.py's cases (PROFILE_CASES, default
#             rows1x64-90): per case the report, its details page and its SASS lines summarised
#             by scripts/ncu_summary.py ($LOGS/ncu-CASE.*)
#   host      host time per steady-state call of each public op beside torch's
#             (scripts/host_time.py; results in $LOGS/host.json and host.md)
#   matmul, attention, moe, training, compiled, graphs, dynamic, rgcn, sage, conv, peers
#             one part of the benchmark suite (python3 -m pitgen.bench PART, i.e. pitgen bench;
#             STEP_ARGS adds options), results under $LOGS/bench
#   bench     every part of the suite in one process (BENCH_ARGS adds options, e.g. --quick)
#   wheel     the wheel in dist/ (python -m build here; carry dist) installed into its own
#             folder beside the image's torch, then pitgen rules / emit / tune run from outside
#             the checkout
# Logs and results go to $LOGS (default /tmp/pitgen-session) and are bundled into
# $OUT/session.tar when $OUT is set (a lent-GPU call returns few files).
set -u
LOGS=${LOGS:-/tmp/pitgen-session}; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PITGEN_CACHE=${PITGEN_CACHE:-/tmp/pitgen-cache}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$LOGS/install.log" 2>&1 \
  || { cat "$LOGS/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOGS/device.txt"
# The kernel families' property tests: every GPU test that uses Hypothesis, except those of
# operators composed of other families' kernels (training: the GEMM and SDDMM; the tuner's
# compile test: SpMM and SDDMM after 0.5 s of tuning per example). docs/testing.md says more.
THOROUGH_DEFAULT="tests/ --ignore=tests/test_gpu_training.py --ignore=tests/test_gpu_tune.py"
rc=0
for step in "$@"; do
  case $step in
    wheel)
      ( set -e   # the image's python is a venv: install beside it, not into a new one
        python3 -m pip install -q --no-deps --no-index --target /tmp/wheel-site dist/pitgen-*.whl
        cd /tmp && w=/tmp/wheel-site/bin
        export PYTHONPATH=/tmp/wheel-site:${PYTHONPATH%%:*}   # the wheel and the carried pycuda
        python3 -c "import pitgen; print(pitgen.__file__)"
        $w/pitgen --version
        $w/pitgen rules 'C[m,n] += A[m,k] * B[k,n]' | head -3
        $w/pitgen emit 'C[m,n] += A[m,k] * B[k,n]' --sparse A --micro-tile 32x1 --out /tmp/emitted
        PITGEN_CACHE=/tmp/wheel-cache $w/pitgen tune synthetic:cora --budget 1 --no-cache
      ) >"$LOGS/wheel.log" 2>&1; r=$?
      echo "wheel: exit $r"; tail -25 "$LOGS/wheel.log"; rc=$((rc | r)) ;;
    tests)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu ${TESTS:-tests/} -p no:cacheprovider -n 8 \
        >"$LOGS/gpu-tests.log" 2>&1; r=$?
      grep -v Warning "$LOGS/gpu-tests.log" | grep -v warner | tail -15; rc=$((rc | r)) ;;
    cpu-torch)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m "not gpu" ${TESTS:-tests/} -p no:cacheprovider \
        -n 4 >"$LOGS/cpu-torch-tests.log" 2>&1; r=$?
      grep -v Warning "$LOGS/cpu-torch-tests.log" | grep -v warner | tail -15; rc=$((rc | r)) ;;
    thorough)
      seed=${THOROUGH_SEED:-$(python3 -c "import random; print(random.randrange(2**32))")}
      limit=${THOROUGH_TIMEOUT:-500}
      echo "thorough: --hypothesis-seed=$seed, stopped after $limit s" | tee "$LOGS/thorough.log"
      python3 -m pytest --collect-only -q -m "gpu and hypothesis" ${THOROUGH_TESTS:-$THOROUGH_DEFAULT} \
        -p no:cacheprovider >"$LOGS/thorough-selection.txt" 2>&1
      # stopped like Ctrl-C at the limit: the tests that finished keep their statistics
      PITGEN_HYPOTHESIS=thorough timeout -k 10 $((limit + 40)) python3 scripts/pytest_within.py \
        $limit -q -m "gpu and hypothesis" ${THOROUGH_TESTS:-$THOROUGH_DEFAULT} -p no:cacheprovider \
        -n ${THOROUGH_WORKERS:-8} --hypothesis-show-statistics --hypothesis-seed=$seed \
        >>"$LOGS/thorough.log" 2>&1; r=$?
      python3 scripts/hypothesis_counts.py "$LOGS/thorough.log" --min 2000 \
        --expect "$LOGS/thorough-selection.txt" >"$LOGS/thorough-counts.txt"; c=$?
      grep -A12 -m 5 "Falsifying" "$LOGS/thorough.log"
      grep -E "passed|failed|error" "$LOGS/thorough.log" | tail -3; cat "$LOGS/thorough-counts.txt"
      echo "thorough: pytest exit $r, counts exit $c (1: a family below 2000 examples or never run)"
      rc=$((rc | r | c)) ;;
    sanitize)
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
        timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_launches.py \
          >"$LOGS/sanitize-$tool.log" 2>&1; r=$?
        echo "compute-sanitizer $tool: exit $r"; tail -2 "$LOGS/sanitize-$tool.log"; rc=$((rc | r))
      done ;;
    example)
      # on a Hopper GPU with the sm_90a kernels too (wgmma + TMA)
      cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
      arch=sm_${cap/./}; [ "$arch" = sm_90 ] && arch=sm_90a
      timeout 200 make -C generated/example run ARCH=$arch >"$LOGS/example.log" 2>&1; r=$?
      echo "example: exit $r"; tail -15 "$LOGS/example.log"; rc=$((rc | r)) ;;
    tune)
      timeout 240 python3 scripts/tune_schedules.py >"$LOGS/tune.log" 2>&1; tail -30 "$LOGS/tune.log" ;;
    tune-attention|tune-spmm|bench-rows)
      timeout ${STEP_TIMEOUT:-300} python3 scripts/${step/-/_}.py ${STEP_ARGS:-} >"$LOGS/$step.log" 2>&1; r=$?
      echo "$step: exit $r"; tail -40 "$LOGS/$step.log" ;;
    profile)
      timeout 200 python3 scripts/measure_profile.py --out "$LOGS" >"$LOGS/profile.log" 2>&1; tail -5 "$LOGS/profile.log" ;;
    ncu)
      for case in ${PROFILE_CASES:-rows1x64-90}; do
        p="$LOGS/ncu-$case"
        timeout 300 ncu --profile-from-start off --section SourceCounters --section WarpStateStats \
          --section SchedulerStats --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --import-source yes -f -o "$p" python3 scripts/profile_cases.py $case >"$p.log" 2>&1; r=$?
        ncu -i "$p.ncu-rep" --page details >"$p-details.txt" 2>&1
        ncu -i "$p.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$p-sass.csv.gz"
        python3 scripts/ncu_summary.py "$p-sass.csv.gz" >"$p-summary.txt" 2>&1
        echo "ncu $case: exit $r"; grep -E "Duration|Eligible Warps|Issued Warp" "$p-details.txt"
        head -40 "$p-summary.txt"; rc=$((rc | r))
      done ;;
    host)
      timeout 200 python3 scripts/host_time.py --json "$LOGS/host.json" --md "$LOGS/host.md" >"$LOGS/host.log" 2>&1; r=$?
      echo "host: exit $r"; grep -v Warning "$LOGS/host.log" | head -18; rc=$((rc | r)) ;;
    matmul|attention|moe|training|compiled|graphs|dynamic|rgcn|sage|conv|peers|bench)
      part=$step limit=300; [ $step = peers ] && limit=400; [ $step = bench ] && part= limit=570
      timeout ${STEP_TIMEOUT:-$limit} python3 -m pitgen.bench $part --out "$LOGS/bench" \
        ${STEP_ARGS:-} ${BENCH_ARGS:-} >"$LOGS/bench-$step.log" 2>&1; r=$?
      md=$step.md; [ $step = moe ] && md=moe_layer.md; [ $step = peers ] && md=summary.md
      echo "bench $step: exit $r"; tail -30 "$LOGS/bench/$md" 2>/dev/null || tail -30 "$LOGS/bench-$step.log"
      rc=$((rc | r)) ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
# (LOGS may be $OUT itself: then everything is there already)
if [ -n "${OUT:-}" ] && [ "$(realpath "$LOGS")" != "$(realpath "$OUT")" ]; then
  tar -C "$LOGS" -cf "$OUT/session.tar" . && cp "$LOGS/device.txt" "$OUT/"
fi
exit $rc
