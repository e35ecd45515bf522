"""SwapOptimizer under FSDP2 (DTensor shards) and DDP, on 2 ranks spawned by
tests/distributed_cases.py (gloo on 127.0.0.1; nccl variants need 2 GPUs)."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, TESTS

SCRIPT = os.path.join(TESTS, "distributed_cases.py")
with open(SCRIPT) as _source:  # every case the script defines: none can be left out
    CASES = re.findall(r"^def case_(\w+)\(", _source.read(), flags=re.M)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch was built without torch.distributed")


def run_case(case, backend, tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, case, str(tmp_path), backend], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"{case} on {backend} failed:\n{out.stdout}\n{out.stderr[-6000:]}"
    assert f"{case} on {backend}: passed" in out.stdout


# Variants of the cases above (FSDP2 with compact states, a budget, cut params,
# mixed precision; DDP overlap with a dropped layer): each spawns two ranks for
# about 7 s, so they run in the slow tier, which .ci/run runs too.
SLOW_CASES = {"fsdp2_split", "fsdp2_8bit", "fsdp2_bf16_moments", "fsdp2_mixed_precision", "fsdp2_budget",
              "ddp_overlap_layer_drop"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES else case
                                  for case in CASES])
def test_two_ranks_gloo(case, tmp_path):
    run_case(case, "gloo", tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 CUDA GPUs and NCCL")
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_nccl(case, tmp_path):
    run_case(case, "nccl", tmp_path)


def test_every_case_is_documented():
    """docs/distributed.md says what each case checks."""
    with open(os.path.join(ROOT, "docs", "distributed.md")) as doc:
        documented = re.findall(r"^\| `(\w+)` \|", doc.read(), flags=re.M)
    assert "fsdp2_8bit" in CASES and sorted(documented) == sorted(CASES) and SLOW_CASES < set(CASES)
