"""SwapOptimizer under FSDP2 (DTensor shards) and DDP, on 2 ranks spawned by
tests/distributed_cases.py (gloo on 127.0.0.1; nccl variants need 2 GPUs)."""

import os
import re
import signal
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


def run_cases(cases, backend, work_dir):
    """Runs `cases` one after the other on the same two spawned ranks: {case:
    None where it passed, else what the run printed}. A case after the first
    failing one did not run and says so."""
    # A session of its own: on a timeout the ranks go with the parent (a hung
    # collective would otherwise keep them for gloo's 30-minute timeout).
    process = subprocess.Popen([sys.executable, SCRIPT, ",".join(cases), str(work_dir), backend], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=120 + 60 * len(cases))
        status = f"exit status {process.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        status = "timed out"
    passed = set(re.findall(rf"^(\w+) on {backend}: passed", stdout, flags=re.M))
    report = f"{status}:\n{stdout}\n{stderr[-6000:]}"
    failed = next((case for case in cases if case not in passed), None)

    def verdict(case):
        if case in passed:  # a non-zero exit with every case passed is the teardown's: all of them report it
            return report if process.returncode != 0 and failed is None else None
        return report if case == failed else f"not run: {failed} failed before it"
    return {case: verdict(case) for case in cases}


@pytest.fixture(scope="module")
def gloo_results(request, tmp_path_factory):
    """The ranks run every gloo case this session selected in one spawn: each
    spawn costs about as much as a case (7 s on 2 cores). (Under pytest-xdist
    each worker sees the whole selection and runs all of it.)"""
    selected = list(dict.fromkeys(item.callspec.params["case"] for item in request.session.items
                                  if getattr(item, "originalname", None) == "test_two_ranks_gloo"))
    return run_cases(selected, "gloo", tmp_path_factory.mktemp("gloo"))


# Variants of the cases above (FSDP2 with compact states, a budget, cut params,
# mixed precision; DDP overlap with a dropped layer): they run in the slow
# tier, which .ci/run runs too.
SLOW_CASES = {"fsdp2_split", "fsdp2_8bit", "fsdp2_bf16_moments", "fsdp2_mixed_precision", "fsdp2_budget",
              "ddp_overlap_layer_drop"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES else case
                                  for case in CASES])
def test_two_ranks_gloo(case, gloo_results):
    assert gloo_results[case] is None, f"{case} on gloo failed: {gloo_results[case]}"


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 CUDA GPUs and NCCL")
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_nccl(case, tmp_path):
    result = run_cases([case], "nccl", tmp_path)[case]
    assert result is None, f"{case} on nccl failed: {result}"


def test_every_case_is_documented():
    """docs/distributed.md says what each case checks."""
    with open(os.path.join(ROOT, "docs", "distributed.md")) as doc:
        documented = re.findall(r"^\| `(\w+)` \|", doc.read(), flags=re.M)
    assert "fsdp2_8bit" in CASES and sorted(documented) == sorted(CASES) and SLOW_CASES < set(CASES)
