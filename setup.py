"""Builds veragged._C: the planner and the kernels, as a CPU-only or a CUDA extension.

Environment:
  VERAGGED_CUDA=1 / =0   force the CUDA or the CPU-only build (default: auto, see below)
  TORCH_CUDA_ARCH_LIST   CUDA architectures (unset: the visible GPUs', or 9.0 with none; CI: 9.0)
  DEBUG=1                -O0 -g
  MAX_JOBS               parallel compile jobs (ninja)
"""

import glob
import os
import re
import subprocess
import sys

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def nvcc_version():
    """The release of CUDA_HOME's nvcc as 'major.minor', or None when there is none."""
    if CUDA_HOME is None:
        return None
    try:
        out = subprocess.check_output([os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"])
    except (OSError, subprocess.CalledProcessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out.decode())
    return f"{found.group(1)}.{found.group(2)}" if found else None


def choose_cuda():
    """Returns (build_cuda, reason). VERAGGED_CUDA forces the answer either way."""
    forced = os.environ.get("VERAGGED_CUDA", "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"VERAGGED_CUDA must be 0, 1 or unset, got {forced!r}")
    nvcc = nvcc_version()
    if forced == "0":
        return False, "VERAGGED_CUDA=0"
    if forced == "1":
        if torch.version.cuda is None or nvcc is None:
            raise RuntimeError(
                f"VERAGGED_CUDA=1 needs a CUDA build of torch and nvcc; got torch.version.cuda="
                f"{torch.version.cuda!r}, nvcc={nvcc!r} (CUDA_HOME={CUDA_HOME!r})"
            )
        return True, "VERAGGED_CUDA=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is not a CUDA build"
    if nvcc is None:
        return False, f"no nvcc found (CUDA_HOME={CUDA_HOME!r})"
    if nvcc.split(".")[0] != torch.version.cuda.split(".")[0]:
        return False, f"nvcc {nvcc} and torch's CUDA {torch.version.cuda} differ in major version"
    return True, f"torch CUDA {torch.version.cuda}, nvcc {nvcc}"


def openmp():
    """Whether to build with -fopenmp: torch's ATen runs its parallel_for on OpenMP (libgomp,
    which the extension then shares with torch) and the compiler is GCC-compatible on Linux."""
    backend = torch.__config__.parallel_info()
    return sys.platform.startswith("linux") and "parallel backend: OpenMP" in backend


DEFAULT_ARCHS = "9.0"  # Hopper (H100/H200), the GPUs this project is run on


def make_extension():
    build_cuda, reason = choose_cuda()
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cu = sorted(glob.glob("csrc/**/cuda/*.cu", recursive=True)) if build_cuda else []
    sources = f"{len(cpp)} C++ and {len(cu)} CUDA sources"
    if build_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # torch picks the architectures of the visible GPUs; with none it has nothing to pick.
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
        sources += f", no GPU visible: TORCH_CUDA_ARCH_LIST={DEFAULT_ARCHS}"
    print(f"veragged: {'CUDA' if build_cuda else 'CPU-only'} build ({reason}; {sources})", flush=True)
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    macros = [("VERAGGED_WITH_CUDA", "1")] if build_cuda else []
    args = {"cxx": opt + ["-Wall", "-Wextra", "-Wno-unused-parameter"], "nvcc": opt}
    link = []
    if openmp():
        # at::parallel_for is inline: without -fopenmp it runs every loop on one thread.
        args["cxx"].append("-fopenmp")
        link.append("-fopenmp")
    kind = CUDAExtension if build_cuda else CppExtension
    return kind(
        "veragged._C",
        cpp + cu,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=macros,
        extra_compile_args=args,
        extra_link_args=link,
    )


setup(
    packages=find_packages(include=["veragged", "veragged.*"]),
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildExtension},
)
