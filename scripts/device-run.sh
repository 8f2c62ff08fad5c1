#!/usr/bin/env bash
# One call of the lent GPU machine (see docs/perf-notes.md): the project's own
# CMake build there (no Debian packages to install: that machine has CMake,
# nvcc, cuBLAS, GoogleTest, nlohmann-json, CLI11 and libgomp, and no cblas.h,
# so the CPU ops build their own GEMM), then the steps asked for, each
# logging to $OUT (at most 8 files come back).
#
#   scripts/device-run.sh [STEPS]
#     STEPS: comma list of build, test, sanitize, verify, bench, step, prefill1m,
#            decode (step_bench --quick on the rows of DECODE_ROWS),
#            profile (ncu on one decode row; see the step),
#            trace (step_bench --trace: CUPTI kernel timeline of TRACE_ROWS)
#            (default: build,test,verify,sanitize,bench)
#   env: BUILD_DIR (default build-dev), TEST_FILTER (gtest filter for the GPU
#        test binaries), SANITIZE_FILTER, BENCH (space list of benchmarks,
#        default all), BENCH_ARGS, STEP_ARGS, PREFILL_LEN (default 1048560), JOBS,
#        PROFILE_ARGS, PROFILE_KERNELS, NCU_SKIP, NCU_COUNT,
#        DECODE_ROWS (';' list of step_bench arguments after --decode, default
#        '1 4096;1 4096 --serial;1 65536;1 1048512;128 65536'),
#        TRACE_ROWS (';' list, default '1 4096;1 1048512;128 65536')
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
steps=${1:-build,test,verify,sanitize,bench}
has() { [[ ",$steps," == *",$1,"* ]]; }
export PATH=$PATH:/usr/local/cuda/bin
b=${BUILD_DIR:-build-dev}
jobs=${JOBS:-$(nproc)}

if has build; then
  { nvidia-smi; nvcc --version | tail -2; cmake --version | head -1; g++ --version | head -1; } >"$OUT/build.log" 2>&1
  t0=$(date +%s)
  { cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_FUZZ=OFF &&
    cmake --build "$b" -j "$jobs"; } >>"$OUT/build.log" 2>&1
  rc=$?
  echo "== build: exit $rc in $(( $(date +%s) - t0 )) s"; grep -E "error|FAILED|dsv4: " "$OUT/build.log" | head -20
  [ $rc -eq 0 ] || exit $rc
fi
filter=${TEST_FILTER:-*}
if has test; then
  echo "== GPU tests"
  for t in sparse_attention_cuda_test backend_ops_test engine_cuda_test; do
    timeout 600 "$b/$t" --gtest_filter="$filter" >>"$OUT/test.log" 2>&1
    echo "$t: exit $?"
  done
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Which is|expected|    (rows|layer|output|vs|max)" "$OUT/test.log" | head -80
fi
if has verify; then
  echo "== verify"
  { "$b/dsv4" verify tests/golden mini-fp8 --device cuda; echo "exit $?"; } 2>&1 | tee "$OUT/verify.log" | tail -12
fi
if has sanitize; then
  echo "== compute-sanitizer"
  sf=${SANITIZE_FILTER:-'*SanitizerSmall*:*ZeroTokens*:*BadCalls*:QkvNormRope.FlashOneToken:Compressor.*C4A*Main*:IndexerCudaTest.Decode*512:IndexerCudaTest.Padded*:DeviceStepTest.*:LinearCudaTest.ZeroRows*'}
  for tool in memcheck racecheck synccheck initcheck; do
    for t in sparse_attention_cuda_test backend_ops_test; do
      echo "--- $tool $t" >>"$OUT/sanitizer.log"
      timeout 300 compute-sanitizer --tool "$tool" "$b/$t" --gtest_filter="$sf" >>"$OUT/sanitizer.log" 2>&1
      echo "exit $?" >>"$OUT/sanitizer.log"
    done
  done
  echo "--- memcheck dsv4 run" >>"$OUT/sanitizer.log"
  DSV4_RUNTIME_ENV=1 timeout 300 compute-sanitizer --tool memcheck "$b/dsv4" run --device cuda --requests 3 --prompt 300 --gen 4 \
    --budget 256 >>"$OUT/sanitizer.log" 2>&1
  echo "exit $?" >>"$OUT/sanitizer.log"
  grep -E "^--- |ERROR SUMMARY|RACECHECK SUMMARY|^exit|PASSED|FAILED" "$OUT/sanitizer.log"
fi
if has bench; then
  echo "== benchmarks"
  for x in ${BENCH:-sparse_attention_bench linear_bench fused_bench indexer_bench}; do
    args=${BENCH_ARGS:-}
    echo "### $x $args" >>"$OUT/bench.log"
    timeout 600 "$b/$x" $args >>"$OUT/bench.log" 2>&1
    echo "$x: exit $?" | tee -a "$OUT/bench.log"
  done
  tail -c 6000 "$OUT/bench.log"
fi
if has step; then
  echo "== step benchmark"
  timeout 590 "$b/step_bench" --json "$OUT/step.json" ${STEP_ARGS:-} 2>&1 | tee "$OUT/step.log"
fi
if has decode; then
  echo "== decode rows"
  IFS=';' read -ra rows <<<"${DECODE_ROWS:-1 4096;1 4096 --serial;1 65536;1 1048512;128 65536}"
  for r in "${rows[@]}"; do
    echo "### --decode $r" >>"$OUT/decode.log"
    timeout 300 "$b/step_bench" --quick --decode $r >>"$OUT/decode.log" 2>&1
    echo "exit $?" >>"$OUT/decode.log"
  done
  grep -E "^### |^\| [0-9]|^exit|rror" "$OUT/decode.log"
fi
if has trace; then
  echo "== kernel traces"
  IFS=';' read -ra rows <<<"${TRACE_ROWS:-1 4096;1 1048512;128 65536}"
  i=0
  for r in "${rows[@]}"; do
    i=$((i + 1))
    echo "### --decode $r --trace trace$i.csv"
    timeout 300 "$b/step_bench" --quick --decode $r --trace "$OUT/trace$i.csv" 2>&1 | grep -v "^engine"
    gzip -f "$OUT/trace$i.csv"
  done
fi
if has prefill1m; then
  echo "== 1M prefill"
  timeout 590 "$b/step_bench" --prefill ${PREFILL_LEN:-1048560} --json "$OUT/prefill1m.json" 2>&1 | tee "$OUT/prefill1m.log"
fi
if has profile; then
  # Kernel times of one decode row's first launches (PROFILE_ARGS, default
  # batch 1 at 4K; NCU_SKIP / NCU_COUNT launches; boost clocks, cold caches),
  # or with PROFILE_KERNELS (a regex) ncu's full set and per-instruction warp
  # samples of the first NCU_COUNT launches of those kernels.
  echo "== profile"
  pa=${PROFILE_ARGS:-"--decode 1 4096 --quick"}
  if [ -n "${PROFILE_KERNELS:-}" ]; then
    timeout 400 ncu --set full --warp-sampling-interval 0 --import-source no -k "regex:$PROFILE_KERNELS" \
      --launch-count ${NCU_COUNT:-1} -o "$OUT/prof" -f "$b/step_bench" $pa >"$OUT/profile.log" 2>&1
    echo "ncu exit $?"
    ncu -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass >"$OUT/sass.csv" 2>>"$OUT/profile.log"
    ncu -i "$OUT/prof.ncu-rep" --page details --print-details all >"$OUT/details.txt" 2>>"$OUT/profile.log"
    rm -f "$OUT/prof.ncu-rep"; gzip -f "$OUT/sass.csv"
  else
    timeout 400 ncu --clock-control none --cache-control all --metrics gpu__time_duration.sum,sm__cycles_active.max \
      --csv --launch-skip ${NCU_SKIP:-160} --launch-count ${NCU_COUNT:-400} "$b/step_bench" $pa >"$OUT/ncu.csv" 2>"$OUT/profile.log"
    echo "ncu exit $?"; gzip -f "$OUT/ncu.csv"
  fi
fi
