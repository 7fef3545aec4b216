#!/usr/bin/env bash
# Builds torch_hca against another torch in a virtual environment of its own and runs the test
# suite there: `make check-torch TORCH=2.14.1`. pip's torch is a CUDA build, so on a machine
# without a GPU this is also the case of a login node or CI runner: the CUDA extension must
# build and link, `import torch_hca` work, CPU tests pass and CUDA tests skip.
#   TORCH_HCA_CHECK_VENV  where the environment lives (default ~/.cache/torch_hca/venv-torch-VERSION;
#                         kept, so a second run skips the ~3 GB download)
#   PYTEST_ARGS           passed to pytest (e.g. "-x -k collectives")
#   TORCH_SUITE           1 (default): then PyTorch's own distributed suite, as tools/torch_suite.py
#                         runs it (about 25 minutes); 0: the project's suite only
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: check_torch.sh TORCH_VERSION}
venv=${TORCH_HCA_CHECK_VENV:-$HOME/.cache/torch_hca/venv-torch-$version}
# torch guesses the toolkit from nvcc's folder, which a wrapper in /usr/local/bin makes wrong
[[ -z ${CUDA_HOME:-} && -d /usr/local/cuda ]] && export CUDA_HOME=/usr/local/cuda
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
# The machine's pip configuration may cap torch (a constraints file): the check's own environment
# reads none of it, and the machine stays as it is.
PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install -q "torch==$version" -r requirements-dev.txt \
    expecttest hypothesis  # what PyTorch's suite imports
# A copy of the working tree (tracked and new files, not ignored ones): the build must not
# replace the extension this checkout built against its own torch.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work"
cd "$work"
start=$SECONDS
"$venv/bin/python" -m pip install -q --no-build-isolation -e .
echo "check_torch: built against $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $((SECONDS - start)) s"
"$venv/bin/python" -c 'import torch, torch_hca; print(f"import torch_hca: CUDA build {torch_hca._C.has_cuda}, GPU {torch.cuda.is_available()}")'
# Both suites run whatever the first gives; the exit status is the first failure's.
status=0
start=$SECONDS
# shellcheck disable=SC2086
(cd tests && "$venv/bin/python" -m pytest -q -rs ${PYTEST_ARGS:-}) || status=$?
echo "check_torch: the project's suite ended ($status) in $((SECONDS - start)) s"
if [[ ${TORCH_SUITE:-1} == 1 ]]; then
    start=$SECONDS
    "$venv/bin/python" tools/torch_suite.py --backend hca -rfs || { s=$?; ((status)) || status=$s; }
    echo "check_torch: PyTorch's distributed suite with hca ended in $((SECONDS - start)) s"
fi
exit $status
