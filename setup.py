"""Builds torch_hca._C against the torch that is already installed.

    pip install --no-build-isolation .      (or -e . for development)

The CUDA executor is built where torch has CUDA and nvcc is found (set TORCH_HCA_NO_CUDA=1 to
skip it); elsewhere the extension serves CPU tensors only.
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

CPU_FOLDERS = ("plan", "transport", "transport/control", "transport/shm", "transport/stream", "transport/nccl",
               "backend")
CUDA_FOLDERS = ("transport/cuda", "backend/cuda")


def sources(folders, patterns=("*.cpp",)):
    return sorted(f for folder in folders for p in patterns for f in glob.glob(os.path.join("csrc", folder, p)))


def with_cuda():
    return torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("TORCH_HCA_NO_CUDA") != "1"


CXX_FLAGS = ["-O3", "-std=c++17"]
if with_cuda():
    extension = CUDAExtension(
        "torch_hca._C",
        sources(CPU_FOLDERS) + sources(CUDA_FOLDERS, ("*.cpp", "*.cu")),
        extra_compile_args={"cxx": CXX_FLAGS + ["-DHCA_WITH_CUDA"], "nvcc": ["-O3", "-std=c++17", "-DHCA_WITH_CUDA"]},
        libraries=["rt"],
    )
else:
    extension = CppExtension("torch_hca._C", sources(CPU_FOLDERS), extra_compile_args=CXX_FLAGS, libraries=["rt"])

setup(
    name="torch_hca",
    version="0.1.0",
    description="TensorFlow's hierarchical-copy cross-device reductions as a PyTorch c10d backend ('hca')",
    packages=["torch_hca"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
)
