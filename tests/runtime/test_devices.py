"""Devices are resolved where they enter: `"cuda"` and `torch.device("cuda")`
mean the current GPU, and C++ is always handed an index (CUDA's own calls
reject -1, torch's "no index"). The CPU tests stand in for a machine with two
GPUs whose current one is cuda:1, record what reaches `_C`, and check that it
is never unindexed, and that `cuda:0` stays cuda:0 although it is not the
current device. The CUDA tests call each entry for real with "cuda",
torch.device("cuda") and "cuda:0" (scripts/gpu_check.sh runs them first)."""

import json

import pytest
import torch

from swap_optimizer import StepCostModel, SwapOptimizer, _C, budget
from swap_optimizer.bench import __main__ as bench_main
from swap_optimizer.budget import AutoBudget
from swap_optimizer.devices import resolve_device

from conftest import requires_cuda

CURRENT = 1  # the simulated current GPU
UNINDEXED = ["cuda", torch.device("cuda")]


class Reached(Exception):
    """The entry got as far as _C (the test stops it there: no GPU here)."""


@pytest.fixture
def two_gpus(monkeypatch):
    """torch as on a machine with two GPUs whose current one is cuda:1; what
    reaches _C is recorded (device arguments), and stops the call."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: CURRENT)
    seen = []

    def record(name, stop=True, value=None):
        def call(device, *args, **kwargs):
            seen.append((name, device))
            if stop:
                raise Reached(name)
            return value
        return call

    monkeypatch.setattr(_C, "measure_copy_bandwidth", record("measure_copy_bandwidth", stop=False,
                                                             value=(1e9, 1e9, 2e9)))
    monkeypatch.setattr(_C, "free_device_bytes", record("free_device_bytes", stop=False, value=1 << 30))
    monkeypatch.setattr(budget, "_measured_update", record("fused update probe", stop=False, value=1e11))
    budget._measured_link.cache_clear()
    yield seen
    budget._measured_link.cache_clear()


def test_resolve_device_names_the_current_gpu_and_keeps_an_explicit_index(two_gpus):
    for device in UNINDEXED:
        assert resolve_device(device) == torch.device("cuda", CURRENT)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)  # not the current device, and kept
    assert resolve_device(0) == torch.device("cuda", 0)  # an int names that GPU, as torch.device(0) does
    assert resolve_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"cuda:2 does not exist: this machine has 2 CUDA device\(s\)"):
        resolve_device("cuda:2")
    with pytest.raises(ValueError, match="is not a device"):
        resolve_device("gpu")


def test_resolve_device_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="torch sees no CUDA GPU here"):
        resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def assert_indexed(seen, expected_index):
    assert seen, "nothing reached _C"
    for name, device in seen:
        assert isinstance(device, torch.device) and device.type == "cuda", (name, device)
        assert device.index == expected_index, f"{name} got {device}"


@pytest.mark.parametrize("device", UNINDEXED + ["cuda:0"], ids=["str", "torch.device", "cuda:0"])
def test_step_cost_model_hands_c_an_index(two_gpus, device):
    model = StepCostModel.for_device(device)
    assert model.h2d_bytes_per_s == 1e9 and model.update_bytes_per_s == 1e11
    assert_indexed(two_gpus, 0 if device == "cuda:0" else CURRENT)
    assert {name for name, _ in two_gpus} == {"measure_copy_bandwidth", "fused update probe"}


def test_step_cost_model_measures_the_current_gpu_once_however_it_is_named(two_gpus):
    for device in UNINDEXED:
        StepCostModel.for_device(device)
    assert [name for name, _ in two_gpus].count("measure_copy_bandwidth") == 1  # one cache entry: cuda:1


@pytest.mark.parametrize("device", UNINDEXED + ["cuda:0"], ids=["str", "torch.device", "cuda:0"])
def test_auto_budget_hands_c_an_index(two_gpus, monkeypatch, device):
    read = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: read.append(d) or 3 << 20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: read.append(d) or 1 << 20)
    auto = AutoBudget(warmup_steps=1, headroom_bytes=0)
    budget_bytes = auto.derive(device, held_bytes=0)
    assert budget_bytes == (1 << 30) + (1 << 20) - (3 << 20)
    index = 0 if device == "cuda:0" else CURRENT
    assert_indexed(two_gpus, index)
    assert read == [torch.device("cuda", index)] * 2


@pytest.mark.parametrize("argv", [[], ["--device", "cuda"], ["--device", "cuda:0"]], ids=["default", "cuda", "cuda:0"])
def test_bench_hands_c_an_index(two_gpus, monkeypatch, argv):
    """README command 1 on a GPU machine: no --device picks "cuda"."""
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (1 << 40, 1 << 40))
    monkeypatch.setattr(bench_main, "built_with_cuda", lambda: True)
    monkeypatch.setattr(bench_main, "make_modes", lambda device, *args: (_ for _ in ()).throw(Reached(str(device))))
    with pytest.raises(Reached) as reached:
        bench_main.main(argv + ["--quick"])
    index = 0 if argv[-1:] == ["cuda:0"] else CURRENT
    assert_indexed(two_gpus, index)
    assert reached.value.args == (f"cuda:{index}",) and made_current == [torch.device("cuda", index)]


def test_bench_refuses_a_gpu_this_machine_does_not_have(two_gpus, monkeypatch, capsys):
    monkeypatch.setattr(bench_main, "built_with_cuda", lambda: True)
    with pytest.raises(SystemExit):
        bench_main.main(["--device", "cuda:5", "--quick"])
    assert "cuda:5 does not exist" in capsys.readouterr().err and not two_gpus


def test_least_over_ranks_reduces_on_the_resolved_device(two_gpus, monkeypatch):
    made_on = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "nccl")
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op: None)
    monkeypatch.setattr(torch, "tensor", lambda values, dtype, device: made_on.append(device) or real_tensor(
        values, dtype=dtype))
    assert AutoBudget.least_over_ranks(5, "cuda") == 5
    assert made_on == [torch.device("cuda", CURRENT)]


# ------------------------------------------------------------------- CUDA
DEVICE_NAMES = ["cuda", torch.device("cuda"), "cuda:0"]
DEVICE_IDS = ["str", "torch.device", "cuda:0"]


@requires_cuda
@pytest.mark.parametrize("device", DEVICE_NAMES, ids=DEVICE_IDS)
def test_c_entries_take_every_spelling_of_the_gpu_cuda(device):
    h2d, d2h, both = _C.measure_copy_bandwidth(device if isinstance(device, torch.device) else torch.device(device),
                                               1 << 20, 2)
    assert h2d > 0 and d2h > 0 and both > 0
    free = _C.free_device_bytes(torch.device(device))
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory


@requires_cuda
@pytest.mark.parametrize("device", DEVICE_NAMES, ids=DEVICE_IDS)
def test_python_entries_take_every_spelling_of_the_gpu_cuda(device):
    model = StepCostModel.for_device(device)
    assert model.h2d_bytes_per_s > 0 and model.update_bytes_per_s > 0
    auto = AutoBudget(warmup_steps=0, headroom_bytes=0)
    assert auto.derive(device, held_bytes=0) > 0
    assert auto.measured["free_bytes"] > 0


@requires_cuda
@pytest.mark.parametrize("argv", [[], ["--device", "cuda"], ["--device", "cuda:0"]], ids=["default", "cuda", "cuda:0"])
def test_bench_runs_on_every_spelling_of_the_gpu_cuda(tmp_path, argv):
    report = tmp_path / "bench.json"
    assert bench_main.main(argv + ["--quick", "--swap-times", "4", "--num-arenas", "2", "--json", str(report)]) == 0
    env = json.loads(report.read_text())["environment"]
    assert env["device"] == "cuda:0" and env["device_name"]


@requires_cuda
def test_auto_budget_on_the_gpu_uses_its_real_free_memory_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)).cuda()
    opt = SwapOptimizer(torch.optim.AdamW(model.parameters()), device_budget_bytes="auto", auto_warmup_steps=1)
    for _ in range(3):
        model(torch.randn(4, 256, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    measured = opt.memory_stats()["auto_budget"]["measured"]
    assert measured["free_bytes"] > 0 and measured["peak_bytes"] > 0 and measured["budget_bytes"] > 0


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_gpu_that_is_not_the_current_one_stays_itself_cuda():
    with torch.cuda.device(0):
        assert resolve_device("cuda:1") == torch.device("cuda", 1)
        assert _C.free_device_bytes(torch.device("cuda", 1)) > 0
        p = torch.nn.Parameter(torch.randn(1000, device="cuda:1"))
        opt = SwapOptimizer(torch.optim.AdamW([p]), swap_times=2)
        p.grad = torch.randn_like(p)
        opt.step()
        assert opt.state[p]["exp_avg"].device.type == "cpu"
