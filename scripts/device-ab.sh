#!/usr/bin/env bash
# A/B of GPU changes in one call of the lent machine: the tree as it is (H)
# against the tree with each patch applied (V1, V2, ...), built in one build
# directory (patch, rebuild, copy the binaries aside, reverse the patch), then
# each variant's tests, then the benchmark rows, every variant in turn within
# a round so that the machine's drift touches all alike.
#
#   scripts/device-ab.sh PATCH...   (patches for `patch -p1`, relative to the root;
#                                    A+B is one variant: A, then B applied)
#   env: BUILD_DIR (default build-dev), ROUNDS (default 2),
#        AB_BINS (space list of binaries to keep per variant; default the
#          benchmarks and GPU test binaries below),
#        AB_TESTS (';' list of "binary gtest-filter" run on every variant but H;
#          default the indexer's tests),
#        AB_ROWS (';' list of "binary arguments"; each prints the last line of
#          its standard output matching AB_GREP, default: its last line)
# Logs go to $OUT (build.log, ab.log); the summary to stdout. At the end the
# build directory is rebuilt from the tree as it is (H).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-/tmp/dsv4-out}
mkdir -p "$OUT"
b=${BUILD_DIR:-build-dev}
rounds=${ROUNDS:-2}
bins=${AB_BINS:-indexer_bench step_bench linear_bench fused_bench sparse_attention_bench backend_ops_test engine_cuda_test sparse_attention_cuda_test dsv4}
tests=${AB_TESTS:-"backend_ops_test IndexerCudaTest.*:IndexerCpuTwin.*"}
rows=${AB_ROWS:-"indexer_bench --format mxfp4 --topk 512 --tokens 8192 --context 65536;indexer_bench --format mxfp4 --topk 512 --tokens 128 --context 65536"}
grep_for=${AB_GREP:-}
[ $# -ge 1 ] || { echo "usage: $0 PATCH..." >&2; exit 1; }
# apply V (A+B+...: each in turn; none where one fails) or, with -R, reverse it
# (in the opposite order).
apply() {
  local parts i
  IFS='+' read -ra parts <<<"$1"
  if [ "${2:-}" = -R ]; then
    for ((i = ${#parts[@]} - 1; i >= 0; i--)); do patch -p1 -R -s --no-backup-if-mismatch <"${parts[i]}" || return 1; done
  else
    for ((i = 0; i < ${#parts[@]}; i++)); do
      patch -p1 -s --dry-run <"${parts[i]}" >/dev/null && patch -p1 -s --no-backup-if-mismatch <"${parts[i]}" && continue
      for ((i--; i >= 0; i--)); do patch -p1 -R -s --no-backup-if-mismatch <"${parts[i]}"; done  # the ones applied
      return 1
    done
  fi
}
for p in "$@"; do  # each applies (a stacked one by applying it, then reversing it)
  apply "$p" >/dev/null && apply "$p" -R >/dev/null || { echo "$p does not apply to the tree" >&2; exit 1; }
done

keep() {  # the built binaries into $b/$1/
  mkdir -p "$b/$1"
  for x in $bins; do cp "$b/$x" "$b/$1/" || return 1; done
}
t0=$(date +%s)
BUILD_DIR=$b scripts/device-run.sh build || exit 1
keep H || exit 1
variants=(H)
i=0
for p in "$@"; do
  i=$((i + 1))
  apply "$p" || exit 1
  cmake --build "$b" >>"$OUT/build.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] && keep "V$i"
  apply "$p" -R || exit 1
  [ $rc -eq 0 ] || { echo "V$i ($p): build failed"; grep -E "error" "$OUT/build.log" | tail -10; exit 1; }
  echo "V$i = $p, built at $(($(date +%s) - t0)) s"
  variants+=("V$i")
done

echo "== tests"
for v in "${variants[@]:1}"; do
  IFS=';' read -ra list <<<"$tests"
  for t in "${list[@]}"; do
    read -r bin filter <<<"$t"
    echo "--- $v $bin $filter" >>"$OUT/ab.log"
    timeout 600 "$b/$v/$bin" --gtest_filter="${filter:-*}" >>"$OUT/ab.log" 2>&1
    echo "$v $bin: exit $? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/ab.log" | tail -1)"
  done
done

echo "== rows (every variant in turn, $rounds rounds)"
IFS=';' read -ra list <<<"$rows"
for r in $(seq "$rounds"); do
  for row in "${list[@]}"; do
    read -r bin args <<<"$row"
    for v in "${variants[@]}"; do
      echo "--- $r $v $row" >>"$OUT/ab.log"
      timeout 600 "$b/$v/$bin" $args >"$OUT/row.txt" 2>>"$OUT/ab.log"
      rc=$?
      cat "$OUT/row.txt" >>"$OUT/ab.log"
      if [ -n "$grep_for" ]; then line=$(grep -E "$grep_for" "$OUT/row.txt" | tail -1); else line=$(tail -1 "$OUT/row.txt"); fi
      echo "$r $v $row: ${line}$([ $rc -eq 0 ] || echo " (exit $rc)")"
    done
  done
done
rm -f "$OUT/row.txt"
# The build directory's own binaries are the last variant's. The next call
# copies the tree in again with its old modification times, older than
# those objects, so its `cmake --build` would not rebuild them (run AT3 ran
# a variant's dsv4 that way): rebuild the tree as it is now, while the
# reversed files are newer than the objects.
cmake --build "$b" >>"$OUT/build.log" 2>&1 || echo "rebuilding the tree as it is failed (see build.log)"
echo "done at $(($(date +%s) - t0)) s (the build directory holds the tree as it is again)"
