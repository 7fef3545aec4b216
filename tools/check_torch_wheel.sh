#!/usr/bin/env bash
# Compiles every torch_hca source (CUDA parts included) against another torch wheel's headers,
# links the extension against that wheel's libraries, and lists the symbols that do not resolve
# there: a check, without a GPU, that one source tree builds for the GPU machine's torch.
#   bash tools/check_torch_wheel.sh torch==2.11.0      # downloads the wheel (~530 MB, CUDA 13 build)
#   bash tools/check_torch_wheel.sh path/to/torch-*.whl
# Needs nvcc and the CUDA toolkit's headers (CUDA_HOME, default /usr/local/cuda). Nothing runs.
set -euo pipefail
cd "$(dirname "$0")/.."
spec=${1:?usage: check_torch_wheel.sh torch==VERSION | WHEEL}
PYTHON=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [[ -f $spec ]]; then wheel=$(realpath "$spec"); else
  $PYTHON -m pip download -q --no-deps -d "$work" "$spec"
  wheel=$(ls "$work"/torch-*.whl)
fi
(cd "$work" && unzip -q "$wheel" 'torch/include/*' 'torch/lib/*' 'torch/version.py')
T=$work/torch
echo "torch $(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$T/version.py")"
pyinc=$($PYTHON -c "import sysconfig; print(sysconfig.get_paths()['include'])")
flags=(-std=c++17 -O0 -w -DHCA_WITH_CUDA -D_GLIBCXX_USE_CXX11_ABI=1 -I"$T/include"
       -I"$T/include/torch/csrc/api/include" -I"$pyinc" -I"$CUDA_HOME/include")
mkdir -p "$work/obj"
for f in $(find csrc -name '*.cpp' -o -name '*.cu' | sort); do
  if [[ $f == *.cu ]]; then
    nvcc "${flags[@]}" -Xcompiler -fPIC -c "$f" -o "$work/obj/$(echo "$f" | tr / _).o"
  else
    g++ "${flags[@]}" -fPIC -c "$f" -o "$work/obj/$(echo "$f" | tr / _).o"
  fi
  echo "compiled $f"
done
g++ -shared -o "$work/_C.so" "$work"/obj/*.o -L"$T/lib" -L"$CUDA_HOME/lib64" -lc10 -lc10_cuda -ltorch -ltorch_cpu \
  -ltorch_cuda -ltorch_python -lcudart
# Symbols of c10/at/torch/c10d the extension needs that the wheel's libraries do not define.
for lib in "$T"/lib/lib{c10,c10_cuda,torch,torch_cpu,torch_cuda,torch_python}.so; do
  nm -D --defined-only --demangle "$lib" | cut -d' ' -f3-
done | sort -u > "$work/defined"
missing=$(nm -u --demangle "$work/_C.so" | sed 's/^ *U //' | grep -E '^(c10|at|torch|c10d)::' | sort -u |
          comm -23 - "$work/defined")
if [[ -n $missing ]]; then
  echo "unresolved against this wheel:"
  echo "$missing"
  exit 1
fi
echo "check_torch_wheel: every source compiled and every torch symbol resolves"
