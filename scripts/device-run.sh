#!/usr/bin/env bash
# What one call of the lent GPU machine runs (see docs/perf-notes.md): the
# carried binaries from scripts/device-build.sh (rebuilt there if they do not
# start), the GPU tests, compute-sanitizer on a small filter, the SASS
# resource summary and the benchmark. Logs go to $OUT.
#
#   scripts/device-run.sh [STEPS]   STEPS: comma list of env,test,sanitize,sass,bench (default: all)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
steps=${1:-env,test,sanitize,sass,bench}
has() { [[ ",$steps," == *",$1,"* ]]; }
export PATH=$PATH:/usr/local/cuda/bin

bin=devbin
if ! ./devbin/sparse_attention_cuda_test --gtest_list_tests >/dev/null 2>&1; then
  echo "carried binaries do not start here; building with nvcc on the device" | tee "$OUT/build.log"
  GTEST_SRC=$root/devbin/googletest OBJ_DIR=/tmp/dsv4-obj JOBS=16 scripts/device-build.sh /tmp/dsv4-bin >>"$OUT/build.log" 2>&1
  bin=/tmp/dsv4-bin
fi

if has env; then
  { nvidia-smi; nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks.max.sm --format=csv; uname -a; } >"$OUT/env.log" 2>&1
fi
if has test; then
  echo "== tests"
  timeout 300 "$bin/sparse_attention_cuda_test" 2>&1 | tee "$OUT/test.log" | grep -E "^\[  (PASSED|FAILED|  OK|SKIPPED) |FAILED|Failure|rows .* max rel|expected|Which is|^\[==========\]"
fi
if has sanitize; then
  echo "== compute-sanitizer"
  filter='*SanitizerSmall*:*ZeroTokens*:*BadCalls*:*NanCode*:*SmallHeadCount*'
  for tool in memcheck racecheck synccheck initcheck; do
    echo "--- $tool" >>"$OUT/sanitizer.log"
    timeout 300 compute-sanitizer --tool "$tool" "$bin/sparse_attention_cuda_test" --gtest_filter="$filter" \
      >>"$OUT/sanitizer.log" 2>&1
    echo "exit $?" >>"$OUT/sanitizer.log"
  done
  grep -E "^--- |ERROR SUMMARY|RACECHECK SUMMARY|^exit|PASSED|FAILED" "$OUT/sanitizer.log"
fi
if has sass; then
  cuobjdump -res-usage "$bin/sparse_attention_bench" >"$OUT/sass.txt" 2>&1
  cuobjdump -sass "$bin/sparse_attention_bench" >>"$OUT/sass.txt" 2>&1
  echo "== SASS: $(grep -c HMMA "$OUT/sass.txt") HMMA, $(grep -c -E 'LDL|STL' "$OUT/sass.txt") local loads/stores"
fi
if has bench; then
  echo "== benchmark"
  "$bin/sparse_attention_bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
