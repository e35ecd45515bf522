import os

import pytest
import torch

import swap_optimizer


def test_built_with_cuda_is_a_bool():
    assert isinstance(swap_optimizer.built_with_cuda(), bool)


@pytest.mark.skipif(os.environ.get("SWAP_OPTIMIZER_REQUIRE_CUDA_BUILD") != "1",
                    reason="set SWAP_OPTIMIZER_REQUIRE_CUDA_BUILD=1 (as .ci/run does) to require the CUDA kernels")
def test_cuda_kernels_compiled_when_torch_is_a_cuda_build():
    if torch.version.cuda is None:
        pytest.skip("torch is a CPU build")
    assert swap_optimizer.built_with_cuda(), "torch is a CUDA build but the extension has no CUDA kernels"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("swap_optimizer::fused_adam_packed", "CUDA")
