"""device_budget_bytes: the planner keeps resident, per param, the state that
fits beside the staging and chooses swap_times and num_arenas by the cost
model. Results are bitwise identical at every resident share (0%, a middle
share, 100%), with split params and in every state mode, and equal torch's
AdamW within rtol 1e-5, atol 1e-6 (fp32, a few steps); the budget is never
exceeded by the runtime's own accounting (on CUDA, by max_memory_allocated);
the plan's bytes are memory_stats()'s exactly."""

from types import SimpleNamespace  # a plan summary as the cost model reads it: the plan alone

import numpy as np
import pytest
import torch
from torch import nn
from torch.testing import assert_close

import swap_optimizer as so
from swap_optimizer import _C
from conftest import PACKED_KERNEL, DEVICES, requires_cuda
from swap_optimizer.budget import StepCostModel, allocated

TRAIN_TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 4
SWAP_TIMES = 4
# A link and an update slow enough that every resident byte pays: the planner's
# choices then do not depend on this machine's measured bandwidth.
SLOW_LINK = StepCostModel(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, both_bytes_per_s=1.6e9,
                          update_bytes_per_s=1e11, batch_seconds=20e-6, step_seconds=100e-6)


class Stack(nn.Module):
    """Params in order: a (16,384), its bias, b (131,072: split at swap_times 4
    unless resident), c (65,536), d (16,384), a LayerNorm (resident by
    min_numel); b is param 2."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 512, bias=False)
        self.c = nn.Linear(512, 128, bias=False)
        self.d = nn.Linear(128, 128, bias=False)
        self.norm = nn.LayerNorm(128)

    def forward(self, x):
        return self.norm(self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x))))))))


def build(device, dtype=torch.float32):
    torch.manual_seed(0)
    return Stack().to(device=device, dtype=dtype)


def train(model, optimizer, steps, device, twin=None):
    """A twin (model, optimizer) is stepped with the same grads."""
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        rng = np.random.default_rng([5, step])
        x = torch.from_numpy(rng.standard_normal((16, 64), dtype=np.float32)).to(device, dtype)
        target = torch.from_numpy(rng.standard_normal((16, 128), dtype=np.float32)).to(device)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x).float(), target).backward()
        optimizer.step()
        if twin is not None:
            for p, q in zip(model.parameters(), twin[0].parameters()):
                q.grad = p.grad.clone()
            twin[1].step()


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)


def unbudgeted_device_bytes(device, dtype=torch.float32, **fields):
    """The device bytes (as the budget counts them) of the plan that keeps no
    param resident beyond min_numel, and the swappable state bytes."""
    optimizer = so.SwapOptimizer(adamw(build(device, dtype).parameters()), swap_times=SWAP_TIMES, num_arenas=2,
                                 cost_model=SLOW_LINK, **fields)
    chosen = optimizer.plan_report()["chosen"]
    stats = optimizer.memory_stats()
    return chosen["device_bytes"], stats["host_state_bytes"]


def budgets(device, dtype=torch.float32, **fields):
    """Budgets for a share of none (nothing beyond min_numel resident), about
    a third (b stays swapped and split), and all."""
    base, host = unbudgeted_device_bytes(device, dtype, **fields)
    return {"none": base, "middle": base + int(0.4 * host), "all": 4 * (base + host)}


def run(device, budget, dtype=torch.float32, **fields):
    model = build(device, dtype)
    optimizer = so.SwapOptimizer(adamw(model.parameters()), device_budget_bytes=budget, swap_times=SWAP_TIMES,
                                 num_arenas=2, cost_model=SLOW_LINK, **fields)
    train(model, optimizer, STEPS, device)
    params = [p.detach().clone() for p in model.parameters()]
    states = [{k: v.detach().clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    return params, states, optimizer


def assert_bitwise(first, second):
    (params_a, states_a), (params_b, states_b) = first, second
    for p, q in zip(params_a, params_b):
        assert torch.equal(p, q.to(p.device))
    for a, b in zip(states_a, states_b):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key].cpu(), b[key].cpu()), key


STATE_MODES = {
    "fp32": (torch.float32, {}),
    "bf16-params": (torch.bfloat16, {}),
    "bf16-masters": (torch.bfloat16, dict(master_weights=True)),
    "bf16-kahan": (torch.bfloat16, dict(kahan_summation=True)),
    "bf16-states": (torch.float32, dict(state_dtype=torch.bfloat16, rounding_seed=3)),
    "8-bit": (torch.float32, dict(state_dtype=torch.uint8)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(STATE_MODES))
def test_results_are_bitwise_at_every_resident_share(device, mode):
    dtype, fields = STATE_MODES[mode]
    runs, shares = {}, {}
    for name, budget in budgets(device, dtype, **fields).items():
        params, states, optimizer = run(device, budget, dtype, **fields)
        runs[name] = (params, states)
        stats = optimizer.memory_stats()
        shares[name] = stats["resident_share"]
        if name == "middle":  # the split param stays swapped; others went resident (torch's update
            # counts its temporaries too, so one param fewer may fit than with the packed kernel)
            assert stats["split_params"] == 1 and stats["plan"]["resident_params"] in ([0, 3, 4], [0, 3])
    assert shares["none"] < 0.01 < shares["middle"] < 0.9 < shares["all"] == 1.0
    assert_bitwise(runs["none"], runs["middle"])
    assert_bitwise(runs["none"], runs["all"])


@pytest.mark.parametrize("device", DEVICES)
def test_every_share_matches_torch_adamw(device):
    for budget in budgets(device).values():
        model = build(device)
        optimizer = so.SwapOptimizer(adamw(model.parameters()), device_budget_bytes=budget, cost_model=SLOW_LINK)
        twin_model = build(device)
        twin = (twin_model, torch.optim.AdamW(twin_model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1,
                                              foreach=False))
        train(model, optimizer, STEPS, device, twin)
        for p, q in zip(model.parameters(), twin_model.parameters()):
            assert_close(p, q, **TRAIN_TOL)
        for p, q in zip(model.parameters(), twin_model.parameters()):
            for key, value in twin[1].state[q].items():
                assert_close(optimizer.state[p][key].to(value.device), value, **TRAIN_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dicts_are_alike_at_every_share_and_load_into_torch(device):
    saved = []
    for budget in budgets(device).values():
        _, _, optimizer = run(device, budget)
        saved.append(optimizer.state_dict())
    for other in saved[1:]:
        assert other["param_groups"] == saved[0]["param_groups"]
        assert other["state"].keys() == saved[0]["state"].keys()
        for index, entry in saved[0]["state"].items():
            assert entry.keys() == other["state"][index].keys()
            for key, value in entry.items():
                assert value.dtype == other["state"][index][key].dtype
                assert torch.equal(value.cpu(), other["state"][index][key].cpu())
    plain = adamw(build(device).parameters())
    plain.load_state_dict(saved[1])
    assert all(torch.equal(plain.state[p]["exp_avg"].cpu(), saved[1]["state"][i]["exp_avg"].cpu())
               for i, p in enumerate(plain.param_groups[0]["params"]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls, kwargs", [(torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
                                         (torch.optim.Adagrad, dict(lr=0.05)),
                                         (torch.optim.RMSprop, dict(lr=1e-3, centered=True))],
                         ids=["sgd", "adagrad", "rmsprop"])
def test_other_optimizers_are_bitwise_torch_at_every_share(device, cls, kwargs):
    probe = so.SwapOptimizer(cls(build(device).parameters(), **kwargs), swap_times=SWAP_TIMES, num_arenas=2,
                             cost_model=SLOW_LINK)
    chosen, host = probe.plan_report()["chosen"]["device_bytes"], probe.memory_stats()["host_state_bytes"]
    shares = []
    for budget in (chosen, chosen + int(0.4 * host), 4 * (chosen + host)):
        model, twin_model = build(device), build(device)
        optimizer = so.SwapOptimizer(cls(model.parameters(), **kwargs), device_budget_bytes=budget,
                                     swap_times=SWAP_TIMES, num_arenas=2, cost_model=SLOW_LINK)
        plain = cls(twin_model.parameters(), **kwargs)
        train(model, optimizer, STEPS, device, (twin_model, plain))
        for p, q in zip(model.parameters(), twin_model.parameters()):
            assert torch.equal(p, q)
            for key, value in plain.state[q].items():
                assert torch.equal(torch.as_tensor(optimizer.state[p][key]).cpu(), torch.as_tensor(value).cpu())
        stats = optimizer.memory_stats()
        assert stats["resident_state_bytes"] + stats["peak_staging_bytes"] + stats["update_temporary_bytes"] <= budget
        shares.append(stats["resident_share"])
    assert shares[0] < shares[1] < shares[2] == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_arenas", [None, 3])
def test_the_budget_is_never_exceeded_and_the_plan_is_the_runtime_accounting(device, num_arenas):
    base, host = unbudgeted_device_bytes(device)
    for budget in range(base, base + host + 200_000, 97_000):
        model = build(device)
        optimizer = so.SwapOptimizer(adamw(model.parameters()), device_budget_bytes=budget, num_arenas=num_arenas,
                                     cost_model=SLOW_LINK)
        train(model, optimizer, 2, device)
        stats = optimizer.memory_stats()
        plan = stats["plan"]
        counted = allocated(stats["resident_state_bytes"]) + stats["peak_staging_bytes"]
        assert counted <= plan["device_bytes"]["total"] <= budget
        assert plan["device_bytes"]["resident_state"] == allocated(stats["resident_state_bytes"])
        assert plan["device_bytes"]["arenas"] + plan["device_bytes"]["step_table"] >= stats["peak_staging_bytes"]
        report = optimizer.plan_report()
        assert report["chosen"]["moved_bytes_each_way"] == stats["h2d_bytes"] == stats["d2h_bytes"]
        assert report["chosen"]["device_bytes"] == plan["device_bytes"]["total"]
        assert plan["swap_times"] == stats["batches"] or stats["batches"] < plan["swap_times"]
        if num_arenas is not None:
            assert plan["num_arenas"] == num_arenas


@pytest.mark.parametrize("fields", [{}, PACKED_KERNEL], ids=["torch-update", "packed-kernel"])
def test_the_planner_keeps_more_resident_as_the_budget_grows(fields):
    base, host = unbudgeted_device_bytes("cpu", **fields)
    moved = []
    for budget in (base, base + host // 3, base + 2 * host // 3, 4 * (base + host)):
        stats = so.SwapOptimizer(adamw(build("cpu").parameters()), device_budget_bytes=budget,
                                 cost_model=SLOW_LINK, **fields).plan_report()["chosen"]
        moved.append(stats["moved_bytes_each_way"])
    # all resident: nothing moves, but the packed kernel's step table (a float per param)
    steps = 4 * len(list(build("cpu").parameters())) if fields else 0
    assert moved == sorted(moved, reverse=True) and moved[-1] == steps


def test_the_planner_does_not_trade_a_split_for_thousands_of_batches():
    """With a per-batch cost, keeping resident all that fits would need the
    finest split; the planner stops where a batch more costs more than it saves."""
    base, host = unbudgeted_device_bytes("cpu")
    costly_batches = StepCostModel(1e9, 1e9, 1.6e9, 1e11, batch_seconds=0.05, step_seconds=0.0)
    optimizer = so.SwapOptimizer(adamw(build("cpu").parameters()), device_budget_bytes=base + host,
                                 cost_model=costly_batches)
    finest = optimizer._planning.lay_out(optimizer._planning.base, 1, 2).finest_swap_times
    assert optimizer.memory_stats()["plan"]["swap_times"] < finest


def test_precedence_of_swap_times_num_arenas_and_the_staging_cap():
    base, host = unbudgeted_device_bytes("cpu")
    fixed = so.SwapOptimizer(adamw(build("cpu").parameters()), device_budget_bytes=base + host, swap_times=3,
                             num_arenas=3, cost_model=SLOW_LINK)
    assert fixed.memory_stats()["plan"]["swap_times"] == 3 and fixed.memory_stats()["plan"]["num_arenas"] == 3
    capped = so.SwapOptimizer(adamw(build("cpu").parameters()), device_budget_bytes=base + host,
                              staging_budget_bytes=200_000, cost_model=SLOW_LINK)
    summary = capped._planning.choice.summary
    assert summary.staging_bytes <= 200_000
    with pytest.raises(ValueError, match="the smallest plan takes [0-9]+ bytes \\(the resident states, arenas at "
                                         "swap_times=3, .*or leave swap_times to the planner"):
        so.SwapOptimizer(adamw(build("cpu").parameters()), device_budget_bytes=base, swap_times=3, num_arenas=3,
                         min_numel=0)
    with pytest.raises(ValueError, match="staging_budget_bytes chooses swap_times; set one of swap_times and "
                                         "staging_budget_bytes"):
        so.SwapOptimizer(adamw(build("cpu").parameters()), swap_times=4, staging_budget_bytes=200_000)


def test_min_numel_and_state_keys_residents_count_against_the_budget():
    params = list(build("cpu").parameters())
    everything_resident = so.SwapOptimizer(adamw(params), min_numel=1 << 30).memory_stats()["resident_state_bytes"]
    with pytest.raises(ValueError, match="the states that min_numel=1073741824 and state_keys keep on the device "
                                         "alone take"):
        so.SwapOptimizer(adamw(build("cpu").parameters()), min_numel=1 << 30,
                         device_budget_bytes=everything_resident // 2)
    with pytest.raises(ValueError, match="device_budget_bytes=1000 is too small: the smallest plan takes"):
        so.SwapOptimizer(adamw(build("cpu").parameters()), device_budget_bytes=1000, min_numel=0)
    # exp_avg_sq stays resident and also joins each batch in its arena: counted in both.
    half = so.SwapOptimizer(adamw(build("cpu").parameters()), state_keys=("exp_avg",), swap_times=1,
                            device_budget_bytes=10 << 20, cost_model=SLOW_LINK, min_numel=1 << 20)
    device = half.memory_stats()["plan"]["device_bytes"]
    assert device["resident_state"] > 0 and device["arenas"] == 0  # nothing swappable at this min_numel
    keys = so.SwapOptimizer(adamw(build("cpu").parameters()), state_keys=("exp_avg",), swap_times=1, num_arenas=2,
                            cost_model=SLOW_LINK)
    report = keys.plan_report()["chosen"]["device_bytes_by_part"]
    stats = keys.memory_stats()
    # one batch holds every swappable param's exp_avg (from the host) and exp_avg_sq (from the resident store)
    assert report["arenas"] >= 2 * stats["host_state_bytes"] - 2 * stats["step_table_bytes"] - 4096
    assert report["resident_state"] >= stats["host_state_bytes"] - stats["step_table_bytes"]


def test_plan_report_prints_the_chosen_plan_and_its_neighbours():
    # (the packed kernel's report also advises its compact states)
    base, host = unbudgeted_device_bytes("cpu", **PACKED_KERNEL)
    optimizer = so.SwapOptimizer(adamw(build("cpu").parameters()), device_budget_bytes=base + host // 3,
                                 cost_model=SLOW_LINK, **PACKED_KERNEL)
    report = optimizer.plan_report()
    chosen = report["chosen"]
    assert chosen["fits"] and chosen["device_bytes"] <= base + host // 3 and 0 < chosen["resident_share"] < 1
    assert len(report["neighbours"]) >= 3
    # no neighbour is predicted faster and fits, or the planner would have taken it
    assert all(not r["fits"] or r["predicted_step_seconds"] >= chosen["predicted_step_seconds"] - 1e-12
               for r in report["neighbours"] if r["num_arenas"] <= 4)
    text = str(report)
    assert "swap_times" in text and "predicted step (ms)" in text and "state_dtype=torch.bfloat16" in text
    assert report["advice"] and all("yours to opt into" in line for line in report["advice"])


def test_the_cost_model_replays_the_pipeline_by_hand():
    """One queue for both directions (2 arenas), an instant update: the link
    moves every byte in and out one after another."""
    model = StepCostModel(h2d_bytes_per_s=1e6, d2h_bytes_per_s=5e5, both_bytes_per_s=1e6, update_bytes_per_s=1e30,
                          batch_seconds=0.0, step_seconds=0.5)
    plan = [dict(resident=False, host_bytes=1000, arena_bytes=1000) for _ in range(3)]
    assert model.predict(SimpleNamespace(batch_layout=plan), 2)["seconds"] == pytest.approx(3 * (1e-3 + 2e-3) + 0.5)
    # an update slower than the link: the step is the first copy in, every update, the last copy out
    slow = StepCostModel(1e6, 5e5, 2e6, update_bytes_per_s=1e5, batch_seconds=0.0, step_seconds=0.0)
    assert slow.predict(SimpleNamespace(batch_layout=plan), 3)["seconds"] == pytest.approx(1e-3 + 3 * 1e-2 + 2e-3)
    with pytest.raises(ValueError, match="StepCostModel.h2d_bytes_per_s must be a positive finite number"):
        StepCostModel(0, 1, 1, 1, 0, 0)


def test_the_cost_model_counts_the_resident_batch():
    """The resident batch updates first, beside the first copies in: with an
    update slower than the link, every rotating update comes after it."""
    slow = StepCostModel(1e6, 5e5, 2e6, update_bytes_per_s=1e5, batch_seconds=0.0, step_seconds=0.0)
    rotating = [dict(resident=False, host_bytes=1000, arena_bytes=1000) for _ in range(3)]
    resident = [dict(resident=True, host_bytes=0, arena_bytes=2000)]
    prediction = slow.predict(SimpleNamespace(batch_layout=resident + rotating), 3)
    # the resident update (2e-2 s), each rotating update (1e-2 s), the last copy out (2e-3 s)
    assert prediction["seconds"] == pytest.approx(2e-2 + 3 * 1e-2 + 2e-3)
    assert prediction["update_seconds"] == pytest.approx(2e-2 + 3 * 1e-2)
    # everything resident: its update, a batch's fixed cost and the step's
    alone = StepCostModel(1e6, 5e5, 2e6, update_bytes_per_s=1e5, batch_seconds=1e-3, step_seconds=0.5)
    assert alone.predict(SimpleNamespace(batch_layout=resident), 2)["seconds"] == pytest.approx(2e-2 + 1e-3 + 0.5)


def test_the_one_by_one_tries_never_take_a_plan_over_the_budget():
    """A param whose state fits the room left but whose plan does not (torch's
    temporaries for a resident call, which only a plan shows): the greedy fill
    takes it and gives it back, the one-by-one tries weigh it again and must
    refuse it, then keep the next param, which fits. A synthetic layout of
    three params of 4 KiB of state, each its own batch."""
    from swap_optimizer.budget import choose_for_budget
    state, temporaries = 4096, 4096  # keeping param 0 resident adds `temporaries` to the update

    def lay_out(swappable, swap_times, num_arenas):
        swapped = [i for i, s in enumerate(swappable) if s]
        resident = len(swappable) - len(swapped)
        plan = [dict(resident=True, host_bytes=0, arena_bytes=state * resident)] if resident else []
        plan += [dict(resident=False, host_bytes=state, arena_bytes=state) for _ in swapped]
        largest = state if swapped else 0
        return _C.StagingSummary(batch_layout=plan, batches=len(swapped), largest_arena_bytes=largest,
                                 resident_state_bytes=state * resident, step_table_bytes=0,
                                 update_temporary_bytes=0 if swappable[0] else temporaries,
                                 staging_bytes=min(num_arenas, len(swapped)) * largest, param_state_bytes=[state] * 3,
                                 swapped_state_bytes=state * len(swapped), moved_bytes=state * len(swapped),
                                 finest_swap_times=3, host_state_bytes=state * len(swapped), split_params=0)

    budget = 2 * state + state + 8 * 256  # two arenas, and room for one more param's state (and its alignment)
    best, weighed = choose_for_budget(lay_out, [True] * 3, [0, 1, 2], budget, swap_times=3, num_arenas=2,
                                      staging_cap=None, extra_bytes=0, cost_model=SLOW_LINK)
    assert [c.device["total"] for c in weighed if c.device["total"] > budget] == []
    assert best.resident_params == (1,)  # the greedy fill stops at param 0: only the one-by-one tries reach param 1
    assert best.device["total"] == 3 * state <= budget


@requires_cuda
def test_cuda_max_memory_allocated_stays_within_the_budget():
    base, host = unbudgeted_device_bytes("cuda")
    for budget in (base, base + host // 3, 4 * (base + host)):
        model = build("cuda")
        optimizer = so.SwapOptimizer(adamw(model.parameters()), device_budget_bytes=budget)
        train(model, optimizer, 1, "cuda")  # the first step creates the grads
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        torch.cuda.synchronize()
        resident = allocated(optimizer.memory_stats()["resident_state_bytes"])  # allocated before the step
        assert torch.cuda.max_memory_allocated() - before + resident <= budget
