"""Builds torch_hca._C against the torch that is already installed.

    pip install --no-build-isolation .      (or -e . for development)
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def sources(*folders):
    found = []
    for folder in folders:
        found += sorted(glob.glob(os.path.join("csrc", folder, "*.cpp")))
    return found


setup(
    name="torch_hca",
    version="0.1.0",
    description="TensorFlow's hierarchical-copy cross-device reductions as a PyTorch c10d backend ('hca')",
    packages=["torch_hca"],
    ext_modules=[
        CppExtension(
            "torch_hca._C",
            sources("plan", "transport", "transport/control", "transport/shm", "transport/nccl", "backend"),
            extra_compile_args=["-O3", "-std=c++17"],
            libraries=["rt"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
)
