"""Builds the strata_torch extension against libstrata.

Build libstrata first (from the repository root):
    cargo build --release -p libstrata            # add --features cuda for GPUs
then, here:
    python setup.py build_ext --inplace
STRATA_LIB_DIR overrides where libstrata.so is found (default: ../../target/release).
"""
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
lib_dir = os.path.abspath(os.environ.get("STRATA_LIB_DIR", os.path.join(root, "target", "release")))

setup(
    name="strata_torch",
    ext_modules=[
        CppExtension(
            name="strata_torch",
            sources=["strata_torch.cpp"],
            include_dirs=[os.path.join(root, "include")],
            library_dirs=[lib_dir],
            libraries=["strata"],
            # No -std: BuildExtension picks the standard this torch needs
            # (C++17 before torch 2.10, C++20 since).
            extra_compile_args=["-O2"],
            # Find libstrata.so at run time where it was built.
            extra_link_args=[f"-Wl,-rpath,{lib_dir}"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
