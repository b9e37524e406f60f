#!/usr/bin/env bash
# Everything one lent-GPU call does, in order: install pitgen (offline), GPU tests, sanitizers,
# benchmarks. Usage: scripts/device_session.sh [tests] [sanitize] [bench] [profile]; logs go to
# $OUT (or ./device-logs).
set -u
OUT=${OUT:-$PWD/device-logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PITGEN_CACHE=${PITGEN_CACHE:-/tmp/pitgen-cache}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pitgen-install.log 2>&1 \
  || { cat /tmp/pitgen-install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
rc=0
for step in "$@"; do
  case $step in
    tests)
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -n 8 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
      rc=$((rc | ${PIPESTATUS[0]})) ;;
    sanitize)
      for tool in memcheck racecheck; do
        timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_launches.py \
          >"$OUT/sanitize-$tool.log" 2>&1; r=$?
        echo "compute-sanitizer $tool: exit $r"; tail -4 "$OUT/sanitize-$tool.log"; rc=$((rc | r))
      done ;;
    bench)
      timeout ${BENCH_TIMEOUT:-200} python3 scripts/bench_matmul.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    tune)
      timeout 240 python3 scripts/tune_schedules.py 2>&1 | tee "$OUT/tune.log" | tail -40 ;;
    profile)
      timeout 200 python3 scripts/measure_profile.py --out "$OUT" 2>&1 | tail -20 ;;
    *) echo "unknown step $step"; rc=1 ;;
  esac
done
exit $rc
