import gc
import os
import signal
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# `python -m pytest` puts the current directory on sys.path: from a checkout's
# root that would import its source folder, which has no compiled extension,
# in place of the installed build.
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != ROOT]
# Shared helpers (pairs.py, optimizer_cases.py, ...) live here, the tests in a
# folder per subsystem; pytest runs in importlib mode, so both go on sys.path
# (a test module that shares its models with others, test_overlap's, is
# imported by name).
SUBSYSTEMS = ("kernels", "runtime", "budget", "rules", "optimizer", "overlap", "distributed", "tools")
sys.path[:0] = [TESTS] + [os.path.join(TESTS, folder) for folder in SUBSYSTEMS]

import swap_optimizer  # noqa: E402

# A process started in the background (nohup, `cmd &` in a script) inherits
# SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the
# tests that deliver a Ctrl-C (signal.raise_signal, the runtime's injected
# interrupt) need Python's own, whatever launched the suite. (Its children,
# the subprocess tests, then start with SIGINT at its default again.)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _cuda_skip_reason():
    if not swap_optimizer.built_with_cuda():
        return "swap_optimizer was built without CUDA kernels"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    return None


CUDA_SKIP_REASON = _cuda_skip_reason()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))),
]
# Settings that select the packed fused Adam kernel for fp32 params (fp32
# states, which torch's update does not need): for tests calibrated on its
# store layout, or that compare the two update paths.
PACKED_KERNEL = dict(state_dtype=torch.float32)
requires_cuda = pytest.mark.skipif(CUDA_SKIP_REASON is not None, reason=str(CUDA_SKIP_REASON))


@pytest.fixture
def overlap_may_arm():
    """For a test that needs overlap's passes armed: they arm only where
    torch.compile has compiled nothing in the process
    (swap_optimizer/overlap/armed.py), so earlier tests' compiles are
    forgotten first."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters["frames"].clear()


@pytest.fixture(autouse=True)
def no_watch_left_behind():
    """Every test ends with no torch function mode left on the stack: an
    overlapping SwapOptimizer takes its watch off when its pass ends or when
    it goes (collected first: a test's optimizers are garbage by then)."""
    yield
    if torch._C._len_torch_function_stack():
        gc.collect()
    assert torch._C._len_torch_function_stack() == 0, "a SwapOptimizer watch was left on the mode stack"
