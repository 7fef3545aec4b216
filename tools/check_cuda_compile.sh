#!/usr/bin/env bash
# Compiles the CUDA executor and the c10d glue with HCA_WITH_CUDA on, with nvcc against the
# installed torch's headers, so that a machine without a GPU (and a CPU-only torch) still
# catches compile errors in the CUDA path. Objects only: nothing is linked or run. Everything
# is compiled as C++17, the standard torch 2.11 builds with (the lent GPU machines' torch),
# also where the installed torch builds with C++20; the other sources are checked too.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! command -v nvcc >/dev/null; then
  echo "check_cuda_compile: nvcc not found, CUDA compile check skipped"
  exit 0
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# A CPU wheel lacks this generated header; CUDA wheels ship it.
mkdir -p "$out/shim/c10/cuda/impl"
echo '#pragma once' > "$out/shim/c10/cuda/impl/cuda_cmake_macros.h"
includes=$($PYTHON -c "
import sysconfig
from torch.utils.cpp_extension import include_paths
print(' '.join('-I' + p for p in include_paths() + [sysconfig.get_paths()['include']]))")
abi=$($PYTHON -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
flags=(-std=c++17 -O0 -w -DHCA_WITH_CUDA -D_GLIBCXX_USE_CXX11_ABI=$abi -I"$out/shim" $includes)
files=(csrc/transport/cuda/*.cu csrc/transport/cuda/*.cpp csrc/backend/calls/cuda/*.cpp csrc/backend/*.cpp csrc/backend/*/*.cpp)
others=$(find csrc -name '*.cpp' -not -path 'csrc/backend/*' -not -path 'csrc/transport/cuda/*' | sort)
# One compiler per core (xargs exits non-zero if any of them failed; set -e then stops here).
jobs=${JOBS:-$(nproc)}
export out
nvcc_one() { echo "nvcc -c $1"; nvcc "$@" -o "$out/$(basename "$1").o"; }
cxx_one() { echo "c++17 $1"; ${CXX:-g++} -std=c++17 -fsyntax-only -w "$@"; }
export -f nvcc_one cxx_one
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -I{} bash -c 'nvcc_one "$@"' _ {} -c "${flags[@]}"
echo "check_cuda_compile: ${#files[@]} files compiled"
printf '%s\n' $others | xargs -P "$jobs" -I{} bash -c 'cxx_one "$@"' _ {} -D_GLIBCXX_USE_CXX11_ABI=$abi $includes
echo "check_cuda_compile: $(wc -w <<< "$others") other files checked as C++17"
