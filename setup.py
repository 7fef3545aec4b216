"""Builds torch_hca._C against the torch that is already installed.

    pip install --no-build-isolation .      (or -e . for development)

The CUDA executor is built where torch has CUDA and the CUDA toolkit is found (CUDA_HOME, else
where nvcc is; set TORCH_HCA_NO_CUDA=1 to skip it), also without a GPU (then for the GPUs of
ARCHS_WITHOUT_A_GPU unless TORCH_CUDA_ARCH_LIST says otherwise); elsewhere the extension serves
CPU tensors only.
"""
import glob
import os
import runpy
import sys

from setuptools import setup

ISOLATED_BUILD = "pip-build-env-"  # the folder pip's isolated build puts its own packages in
REBUILD = "pip install --no-build-isolation ."
try:
    import torch
except ModuleNotFoundError:
    # pip's isolated build hides the installed torch, which the extension must be built against.
    sys.exit("torch_hca: setup.py builds against the installed torch and cannot import torch here"
             + (" (pip's isolated build environment hides it)" if ISOLATED_BUILD in " ".join(sys.path) else "")
             + f": install torch, then rerun with `{REBUILD}`")
if ISOLATED_BUILD in torch.__file__:
    print(f"torch_hca: WARNING: building for torch {torch.__version__} of pip's isolated build environment "
          f"({os.path.dirname(torch.__file__)}), not the torch installed; rerun with `{REBUILD}`", file=sys.stderr)
print(f"torch_hca: building for torch {torch.__version__} ({os.path.dirname(torch.__file__)})", file=sys.stderr)
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

CPU_FOLDERS = ("plan", "transport", "transport/control", "transport/shm", "transport/stream", "transport/nccl",
               "backend", "backend/group", "backend/calls", "backend/engines", "backend/ops")
CUDA_FOLDERS = ("transport/cuda", "backend/calls/cuda")


def sources(folders, patterns=("*.cpp",)):
    return sorted(f for folder in folders for p in patterns for f in glob.glob(os.path.join("csrc", folder, p)))


# GPUs the CUDA parts are compiled for when no GPU is here to ask (a login node, CI): Turing to
# Blackwell, the range of CUDA 13, with PTX for later ones. TORCH_CUDA_ARCH_LIST overrides it.
ARCHS_WITHOUT_A_GPU = "7.5;8.0;9.0;10.0;12.0+PTX"


def with_cuda():
    if torch.version.cuda is None or CUDA_HOME is None or os.environ.get("TORCH_HCA_NO_CUDA") == "1":
        return False
    if not os.path.exists(os.path.join(CUDA_HOME, "include", "cuda_runtime.h")):
        # torch takes CUDA_HOME from nvcc's folder when unset; a wrapper in /usr/local/bin misleads it
        print(f"torch_hca: CUDA_HOME={CUDA_HOME} has no include/cuda_runtime.h; set CUDA_HOME to the CUDA toolkit "
              "(e.g. /usr/local/cuda) to build the CUDA executor. Building for CPU tensors only.")
        return False
    if not torch.cuda.is_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", ARCHS_WITHOUT_A_GPU)
    return True


# No -std: torch's build adds the standard its headers need (C++17 for torch 2.11, C++20 for 2.13).
CXX_FLAGS = ["-O3"]
# A compiler that links its C++ runtime into shared objects statically (the lent GPU machines'
# does) left that copy's symbols exported: with Python's -Bsymbolic-functions the extension ran
# its own copy's functions on the process's copy's data (locale facets), and formatting an integer
# into a stream crashed. Hidden, the copy is whole; where the runtime is shared, nothing changes.
LINK_FLAGS = ["-Wl,--exclude-libs,ALL"] if sys.platform.startswith("linux") else []
if with_cuda():
    extension = CUDAExtension(
        "torch_hca._C",
        sources(CPU_FOLDERS) + sources(CUDA_FOLDERS, ("*.cpp", "*.cu")),
        extra_compile_args={"cxx": CXX_FLAGS + ["-DHCA_WITH_CUDA"], "nvcc": ["-O3", "-DHCA_WITH_CUDA"]},
        extra_link_args=LINK_FLAGS,
        libraries=["rt"],
    )
else:
    extension = CppExtension("torch_hca._C", sources(CPU_FOLDERS), extra_compile_args=CXX_FLAGS,
                             extra_link_args=LINK_FLAGS, libraries=["rt"])

class BuildExtensionNamingItsTorch(BuildExtension):
    """torch's build, which also writes the torch it built against beside the extension
    (torch_hca/built_for_torch.txt): importing the extension under another torch then names both
    versions, instead of failing on an undefined symbol."""

    def run(self):
        super().run()
        for ext in self.extensions:
            folder = os.path.dirname(self.get_ext_fullpath(ext.name))
            with open(os.path.join(folder, "built_for_torch.txt"), "w") as f:
                f.write(torch.__version__ + "\n")


HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = runpy.run_path(os.path.join(HERE, "torch_hca", "version.py"))["__version__"]
# The wheel's name says which torch it was built for (a local version label, e.g.
# 0.1.0+torch2.13.0.cpu): an extension runs only with the torch whose headers it was built from.
LOCAL_LABEL = "torch" + torch.__version__.replace("+", ".")

setup(
    name="torch_hca",
    version=f"{VERSION}+{LOCAL_LABEL}",
    description="TensorFlow's hierarchical-copy cross-device reductions as a PyTorch c10d backend ('hca')",
    packages=["torch_hca", "torch_hca.explain"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtensionNamingItsTorch},
    # torch 2.14+ loads this for init_process_group("hca") when torch_hca was not imported
    entry_points={"torch.distributed.backends": ["hca = torch_hca.backend:register"]},
    # torch itself is not required here: pip would fetch another build of it (GBs) over the one
    # installed, which the extension was built against
    install_requires=["tqdm"],
    python_requires=">=3.9",
)
