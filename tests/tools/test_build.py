import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

import swap_optimizer
from conftest import ROOT


def test_built_with_cuda_is_a_bool():
    assert isinstance(swap_optimizer.built_with_cuda(), bool)


@pytest.mark.skipif(os.environ.get("SWAP_OPTIMIZER_REQUIRE_CUDA_BUILD") != "1",
                    reason="set SWAP_OPTIMIZER_REQUIRE_CUDA_BUILD=1 (as .ci/run does) to require the CUDA kernels")
def test_cuda_kernels_compiled_when_torch_is_a_cuda_build():
    if torch.version.cuda is None:
        pytest.skip("torch is a CPU build")
    assert swap_optimizer.built_with_cuda(), "torch is a CUDA build but the extension has no CUDA kernels"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("swap_optimizer::fused_adam_packed", "CUDA")


def test_importing_the_source_folder_says_the_extension_is_not_built_there(tmp_path):
    """A checkout's source folder has no _C; importing it (python run in the repo
    root) names the problem and the fix instead of a circular-import error."""
    import shutil
    source = os.path.join(ROOT, "swap_optimizer")
    shutil.copytree(source, tmp_path / "swap_optimizer", ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    out = subprocess.run([sys.executable, "-c", "import swap_optimizer"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0
    assert "the compiled extension (_C) is not built in" in out.stderr and "python -P" in out.stderr


def test_the_installed_build_is_the_one_under_test():
    """The package pip installed, with its compiled extension: never the
    checkout's source folder (tests/conftest.py keeps it off sys.path)."""
    dist = importlib.metadata.distribution("swap-optimizer")
    recorded = [dist.locate_file(f) for f in dist.files or [] if f.as_posix() == "swap_optimizer/__init__.py"]
    assert recorded, "swap-optimizer is not installed from a wheel: pip install --no-build-isolation ."
    assert os.path.samefile(swap_optimizer.__file__, recorded[0])
    assert os.path.dirname(swap_optimizer._C.__file__) == os.path.dirname(swap_optimizer.__file__)


def test_python_m_pytest_from_the_checkout_tests_the_installed_build():
    """`python -m pytest tests` puts the current directory, the checkout's root,
    on sys.path; it must still test the installed build."""
    root = ROOT
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/tools/test_build.py",
                          "-k", "installed_build_is_the_one_under_test"], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


def test_the_build_records_the_torch_it_was_compiled_against():
    info = swap_optimizer.build_info()
    assert info == {"torch": torch.__version__, "cuda": torch.version.cuda,
                    "cuda_kernels": swap_optimizer.built_with_cuda()}


OTHER_CUDA = "11.8" if torch.version.cuda != "11.8" else "12.1"


@pytest.mark.parametrize("recorded_torch, recorded_cuda", [
    ("2.13.0+cpu", None), ("2.99.0+cu999", "99.9"),
    pytest.param(torch.__version__, OTHER_CUDA, id="same_torch_other_cuda"),
])
def test_importing_with_another_torch_names_both_and_the_fix(tmp_path, recorded_torch, recorded_cuda):
    """A build made against another torch (pip's isolated build environment
    takes the newest from the index) is refused at import, before _C is
    loaded: the error names both torches and the rebuilding command. Faked by
    rewriting the installed build's record in a copy of the package. The same
    torch version built for another CUDA is another torch too."""
    import shutil
    installed = os.path.dirname(swap_optimizer.__file__)
    copy = tmp_path / "swap_optimizer"
    shutil.copytree(installed, copy, ignore=shutil.ignore_patterns("__pycache__"), copy_function=os.symlink)
    record = copy / "_build_info.py"
    text = record.read_text()
    record.unlink()
    record.write_text(text.replace(repr(torch.__version__), repr(recorded_torch))
                      .replace(f"CUDA_VERSION = {torch.version.cuda!r}", f"CUDA_VERSION = {recorded_cuda!r}"))
    out = subprocess.run([sys.executable, "-P", "-c", "import swap_optimizer"], cwd=tmp_path, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode != 0, f"a build recorded for {recorded_torch} and CUDA {recorded_cuda} was imported"
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith(f"ImportError: swap_optimizer was built against torch {recorded_torch} "
                            f"({f'CUDA {recorded_cuda}' if recorded_cuda else 'a CPU build'})"), error
    assert f"but this Python has torch {torch.__version__}" in error
    assert "pip install --no-build-isolation --force-reinstall --no-deps ." in error
    if recorded_torch != torch.__version__:
        return  # (a subprocess less: the true record is checked once, beside the record closest to it)
    # the same copy with the true record imports
    record.write_text(text)
    out = subprocess.run([sys.executable, "-P", "-c", "import swap_optimizer; print(swap_optimizer.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode == 0 and out.stdout.strip().startswith(str(tmp_path)), out.stderr[-2000:]
