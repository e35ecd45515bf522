"""Build of swap_optimizer._C with torch.utils.cpp_extension.

CUDA sources are compiled whenever torch is a CUDA build and nvcc is found, even
on a machine without a GPU; otherwise, or with SWAP_OPTIMIZER_CPU_ONLY=1, a
CPU-only extension is built; SWAP_OPTIMIZER_SANITIZE=address,undefined builds an
instrumented CPU-only one. TORCH_CUDA_ARCH_LIST defaults to 8.0;9.0+PTX only
when the user has not set it. MAX_JOBS is honoured by torch's ninja build.
"""

import glob
import os

from setuptools import find_packages, setup

# cpp_extension derives CUDA_HOME from the nvcc on PATH, which on some machines
# is a wrapper script outside the toolkit; prefer the conventional toolkit folder
# when the user has not named one.
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def _sanitizers():
    """SWAP_OPTIMIZER_SANITIZE=address,undefined builds an instrumented CPU-only
    extension (tests/cpp/run_sanitizers.sh runs the CPU suite on it)."""
    return os.environ.get("SWAP_OPTIMIZER_SANITIZE", "")


def _want_cuda():
    if os.environ.get("SWAP_OPTIMIZER_CPU_ONLY", "0") == "1" or _sanitizers():
        return False
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def _extension():
    with_cuda = _want_cuda()
    # The sources are C++17; the language flag is left to cpp_extension, which
    # passes the standard the installed torch's headers need (C++20 for torch 2.14, C++17 for 2.11).
    # No contraction into FMA anywhere: the vector path, the scalar tail and the
    # CUDA kernel must round identically (see csrc/kernels/adam_math.h).
    # at::parallel_for runs in parallel only where the caller was compiled with
    # OpenMP, as torch itself is; without it the CPU kernel is single-threaded.
    cxx_flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-Wno-unknown-pragmas"]
    link_flags = ["-fopenmp"]
    if _sanitizers():
        # vptr checks need RTTI from torch, which is not instrumented: off.
        sanitize = [f"-fsanitize={_sanitizers()}", "-fno-sanitize=vptr", "-fno-omit-frame-pointer",
                    "-fno-sanitize-recover=all"]
        cxx_flags = ["-O1", "-g", "-ffp-contract=off", "-fopenmp", "-Wno-unknown-pragmas"] + sanitize
        link_flags += sanitize
    sources = _sources("csrc/kernels/*.cpp") + _sources("csrc/kernels/cpu/*.cpp")
    sources += _sources("csrc/runtime/*.cpp") + _sources("csrc/bindings/*.cpp")
    macros = []
    if not with_cuda:
        return cpp_extension.CppExtension(
            "swap_optimizer._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags,
            define_macros=macros,
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH_LIST)
    macros.append(("SWAP_OPTIMIZER_WITH_CUDA", None))
    nvcc_flags = ["-O3", "--fmad=false", "-lineinfo"]
    sources += _sources("csrc/kernels/cuda/*.cu") + _sources("csrc/runtime/cuda/*.cpp")
    return cpp_extension.CUDAExtension(
        "swap_optimizer._C",
        sources,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
        define_macros=macros,
    )


class BuildExtensionAndRecordTorch(cpp_extension.BuildExtension):
    """Builds _C, then writes swap_optimizer/_build_info.py beside it: the torch
    and CUDA versions it was compiled against and the source folder. A C++
    extension runs only with that torch; swap_optimizer/__init__.py compares
    before loading _C, so a build against another torch (pip's isolated build
    environment takes the newest) fails with the fix instead of a missing
    libc10_cuda.so or a crash."""

    def run(self):
        super().run()
        import torch

        folder = os.path.join(ROOT if self.inplace else self.build_lib, "swap_optimizer")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "_build_info.py"), "w") as record:
            record.write('"""Written by setup.py when _C was built: what it was compiled against."""\n\n'
                         f"TORCH_VERSION = {torch.__version__!r}\n"
                         f"CUDA_VERSION = {torch.version.cuda!r}\n"
                         f"WITH_CUDA_KERNELS = {_want_cuda()!r}\n"
                         f"SOURCE_FOLDER = {ROOT!r}\n")


setup(
    packages=find_packages(include=["swap_optimizer", "swap_optimizer.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtensionAndRecordTorch},
)
