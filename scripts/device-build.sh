#!/usr/bin/env bash
# Builds the GPU test and benchmark as self-contained binaries (static
# libstdc++/libgcc and cudart, no OpenBLAS/json/CLI11) for the lent GPU
# machine, which lacks the project's Debian packages.
#
#   scripts/device-build.sh [OUT_DIR]     default OUT_DIR: devbin/
#
# GoogleTest comes from the static Debian libraries when present, otherwise
# from the sources in $GTEST_SRC (default: devbin/googletest, a copy of
# /usr/src/googletest made here so that the device can build too).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/devbin}
obj=${OBJ_DIR:-$root/build-dev}
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
cuda_lib=$(dirname "$(dirname "$nvcc")")/lib64
jobs=${JOBS:-2}
mkdir -p "$out" "$obj"

cuflags=(-std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo
         -Xcompiler=-Wall,-Wextra -I"$root/src" -I"$root/tests")
cxxflags=(-std=c++20 -O2 -Wall -Wextra -I"$root/src")

gtest_inc=()
gtest_objs=()
gtest_src=${GTEST_SRC:-$out/googletest}
if [ -f /usr/lib/x86_64-linux-gnu/libgtest.a ] && [ -f /usr/include/gtest/gtest.h ]; then
  gtest_objs=(/usr/lib/x86_64-linux-gnu/libgtest_main.a /usr/lib/x86_64-linux-gnu/libgtest.a)
else
  gtest_inc=(-I"$gtest_src/googletest/include" -I"$gtest_src/googletest")
  for f in gtest-all gtest_main; do
    o="$obj/$f.o"
    [ -f "$o" ] || g++ -std=c++20 -O2 "${gtest_inc[@]}" -c "$gtest_src/googletest/src/$f.cc" -o "$o"
    gtest_objs+=("$o")
  done
fi

compile() {  # src obj
  local src=$1 o=$2
  if [ ! -f "$o" ] || [ "$src" -nt "$o" ] || [ -n "$(find "$root/src" "$root/tests" "$root/bench" -newer "$o" \
       \( -name '*.h' -o -name '*.cuh' \) -print -quit)" ]; then
    case "$src" in
      *.cu) "$nvcc" "${cuflags[@]}" "${gtest_inc[@]}" -c "$src" -o "$o" ;;
      *) g++ "${cxxflags[@]}" -c "$src" -o "$o" ;;
    esac
  fi
}

srcs=(src/common/error.cpp src/numerics/e4m3.cpp src/numerics/quant.cpp src/cache/fp8_ds_mla.cpp
      src/attn/cuda/sparse_attention_cuda.cu src/attn/cuda/sparse_mla_plan.cu src/attn/cuda/sparse_mla_kernel.cu
      src/attn/cuda/sparse_mla_combine.cu tests/gpu/sparse_attention_cuda_test.cu bench/sparse_attention_bench.cu)
pids=()
for s in "${srcs[@]}"; do
  o="$obj/$(echo "$s" | tr '/' '_').o"
  compile "$root/$s" "$o" &
  pids+=($!)
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 0.2; done
done
for p in "${pids[@]}"; do wait "$p"; done

lib=()
for s in "${srcs[@]:0:8}"; do lib+=("$obj/$(echo "$s" | tr '/' '_').o"); done
link=(-static-libstdc++ -static-libgcc -L"$cuda_lib" -lcudart_static -lpthread -ldl -lrt)
g++ -o "$out/sparse_attention_cuda_test" "$obj/tests_gpu_sparse_attention_cuda_test.cu.o" "${lib[@]}" \
    "${gtest_objs[@]}" "${link[@]}"
g++ -o "$out/sparse_attention_bench" "$obj/bench_sparse_attention_bench.cu.o" "${lib[@]}" "${link[@]}"
ls -la "$out"
