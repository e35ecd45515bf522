"""Compact states and Kahan summation for an optimizer wrapped on the user's
word: a hand-written Lion (optimizer_cases.Lion) under trust_per_param_step
and trust_elementwise_step, its state's kind named by trusted_state_kinds.

Its first update of each param runs whole (it learns the param's states) and
later ones batch by batch; both decode and encode the compact states alike,
so the runs are bitwise across swap_times, cuts and overlap, a resume from a
state dict is bitwise the run that went on, and each step is the plain Lion's
update from the decoded states (the reference: compact.quantize, the op's
twin in Python, and torch's bf16 casts). Its training parity is in
test_compact_rules_parity.py (slow tier)."""

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import swap_optimizer as so
from conftest import DEVICES
from optimizer_cases import BY_NAME, Lion
from pairs import give_grads, same_bits
from test_optimizer_capabilities import mesh  # noqa: F401  (a fixture: a one-rank process group)
from swap_optimizer import compact

CASE = BY_NAME["Lion"]
KINDS = {"exp_avg": "signed"}
TRUST = dict(trust_per_param_step=True, trust_elementwise_step=True, trusted_state_kinds=KINDS, min_numel=0)
# mode -> (SwapOptimizer settings, param dtype)
MODES = {
    "bf16": (dict(state_dtype=torch.bfloat16, rounding_seed=7), torch.float32),
    "8bit": (dict(state_dtype=torch.uint8, rounding_seed=7), torch.float32),
    "kahan": (dict(kahan_summation=True), torch.bfloat16),
    "kahan-bf16": (dict(kahan_summation=True, state_dtype=torch.bfloat16, rounding_seed=7), torch.bfloat16),
}
BITWISE = dict(rtol=0, atol=0)


def make_lion(params):
    return Lion(params, lr=1e-2, betas=(0.8, 0.9))


# Params whose compact states are cut too (a piece holds at least 64 KiB of
# state): the case table's first param is too small for that under 8-bit.
LARGE = [(512, 256), (16384,), (24, 20), (5,)]


def large_params(dtype, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    return [nn.Parameter(torch.randn(*shape, generator=generator).to(device, dtype)) for shape in LARGE]


def run(mode, steps, first_step=0, params=None, device="cpu", **settings):
    fields, dtype = MODES[mode]
    params = CASE.params(dtype, device)() if params is None else params
    optimizer = so.SwapOptimizer(make_lion(params), **dict(TRUST, **fields, **settings))
    for step in range(first_step, first_step + steps):
        give_grads(step, params)
        optimizer.step()
    return params, optimizer


def assert_runs_bitwise(first, second, what):
    (params, optimizer), (other_params, other) = first, second
    for i, (p, q) in enumerate(zip(params, other_params)):
        assert same_bits(p, q), f"{what}: param {i} differs"
    ours, theirs = optimizer.state_dict()["state"], other.state_dict()["state"]
    assert ours.keys() == theirs.keys(), what
    for index, entry in theirs.items():
        assert ours[index].keys() == entry.keys(), (what, index)
        for key, value in entry.items():
            assert_close(torch.as_tensor(ours[index][key]), torch.as_tensor(value), **BITWISE,
                         msg=lambda m: f"{what}: state {index}/{key}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_bitwise_across_swap_times_arenas_and_cuts(mode, device):
    """Whole params (swap_times=1) and params cut across 8 batches in 3
    arenas: params and every state bitwise; the compact states stored as
    the mode says."""
    dtype = MODES[mode][1]
    whole = run(mode, 4, params=large_params(dtype, device), swap_times=1)
    cut = run(mode, 4, params=large_params(dtype, device), swap_times=8, num_arenas=3)
    assert cut[1].memory_stats()["split_params"] >= 1
    assert_runs_bitwise(cut, whole, mode)
    params, optimizer = cut
    entry = optimizer.state[params[0]]  # (128, 256): compact in every mode
    if mode == "8bit":
        assert entry["exp_avg_codes"].dtype == torch.uint8 and "exp_avg" not in entry
    else:
        assert entry["exp_avg"].dtype == (torch.float32 if mode == "kahan" else torch.bfloat16)
    assert ("compensation" in entry) == mode.startswith("kahan")


@pytest.mark.parametrize("mode, each_way", [("bf16", 2.0), ("8bit", 1.02), ("kahan", 6.0), ("kahan-bf16", 4.0)])
def test_bytes_moved_per_param(mode, each_way):
    """Bytes per param each way, on params of at least 4,096 elements: one
    state of 2 bytes (bf16) or 1 plus a float32 scale per 256 elements
    (8-bit); with Kahan a bf16 param's float32 state and its bf16
    compensation, or a bf16 state and the compensation. The exact run: 4."""
    fields, dtype = MODES[mode]
    params = [nn.Parameter(torch.randn(64, 256, dtype=dtype)) for _ in range(2)]
    optimizer = so.SwapOptimizer(make_lion(params), **dict(TRUST, **fields))
    give_grads(0, params)
    optimizer.step()
    assert optimizer.memory_stats()["bytes_per_param_each_way"] == pytest.approx(each_way, rel=0.01)


@pytest.mark.parametrize("mode", MODES)
def test_overlap_forward_is_bitwise_the_run_without(mode):
    """Deferred beside the next forward (random copy and compute delays):
    losses, params and states bitwise the run without overlap."""
    fields, dtype = MODES[mode]
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 96), nn.Tanh(), nn.Linear(96, 64), nn.Tanh(),
                              nn.Linear(64, 8)).to(dtype)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        optimizer = so.SwapOptimizer(make_lion(model.parameters()), **dict(TRUST, **fields), swap_times=4,
                                     num_arenas=3, **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=100, compute_delay_us=100, seed=5)
        losses = []
        for step in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).to(dtype)
            optimizer.zero_grad()
            loss = model(x).float().square().mean()
            loss.backward()
            losses.append(loss.detach())
            optimizer.step()
        if overlap:
            assert optimizer._overlap._last_step_deferred
        runs.append((losses, (list(model.parameters()), optimizer)))
    assert torch.equal(torch.stack(runs[0][0]), torch.stack(runs[1][0]))
    assert_runs_bitwise(runs[1][1], runs[0][1], f"{mode} overlap")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["bf16", "8bit"])
def test_each_step_is_the_plain_update_from_the_decoded_state(mode, device):
    """Step 1 (whole, learning) and step 2 (batch by batch): the params are
    the plain Lion's update from the state as stored before the step,
    decoded; 8-bit codes are compact.quantize's of the plain update's state
    (the signed map: trusted_state_kinds' 'signed'), bf16 states are within
    a bf16 rounding of it (an ulp: at most 2**-7 of the value)."""
    fields, dtype = MODES[mode]
    params = CASE.params(dtype, device)()
    optimizer = so.SwapOptimizer(make_lion(params), **dict(TRUST, **fields), swap_times=4)
    decoded = [None] * len(params)  # the state as stored, decoded (None: none yet)
    for step in range(2):
        reference = [nn.Parameter(p.detach().clone()) for p in params]
        plain = make_lion(reference)
        for i, q in enumerate(reference):
            if decoded[i] is not None:
                plain.state[q]["exp_avg"] = decoded[i].clone()
        give_grads(step, params, reference)
        optimizer.step()
        plain.step()
        for i, (p, q) in enumerate(zip(params, reference)):
            assert same_bits(p, q), f"{mode} step {step}: param {i}"
            entry, exact = optimizer.state[p], plain.state[q]["exp_avg"]
            if mode == "8bit" and p.numel() >= compact.MIN_QUANTIZED_NUMEL:
                codes, absmax = compact.quantize(exact, "exp_avg")  # (on the CPU)
                assert torch.equal(entry["exp_avg_codes"], codes) and torch.equal(entry["exp_avg_absmax"], absmax), \
                    f"8-bit step {step}: param {i}'s codes are not the signed map's of the plain state"
                decoded[i] = compact.dequantize(codes, absmax, "exp_avg").to(device)
            elif mode == "8bit":  # (a small param's state stays exact)
                assert torch.equal(entry["exp_avg"], exact.cpu())
                decoded[i] = exact
            else:
                stored, exact = entry["exp_avg"], exact.cpu()
                assert stored.dtype == torch.bfloat16
                assert ((stored.float() - exact).abs() <= (exact.abs() * 2 ** -7)).all(), \
                    f"bf16 step {step}: param {i}'s state is more than a bf16 rounding from the plain state"
                decoded[i] = stored.float().to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_a_state_dict_resumes_bitwise(mode, device):
    """Saved after 3 steps and loaded into a new SwapOptimizer (another
    swap_times) on copies of the params: the next 3 steps are bitwise those
    of the run that went on (its first one runs whole, learning the loaded
    states, and decodes and encodes them as a batch would, the rounding's
    count and seed included)."""
    params, optimizer = run(mode, 3, device=device, swap_times=4)
    saved = copy.deepcopy(optimizer.state_dict())
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for step in range(3, 6):
        give_grads(step, params)
        optimizer.step()
    fields, _ = MODES[mode]
    resumed = so.SwapOptimizer(make_lion(copies), **dict(TRUST, **dict(fields, rounding_seed=None)
                                                        if "rounding_seed" in fields else fields), swap_times=3)
    resumed.load_state_dict(saved)
    for step in range(3, 6):
        give_grads(step, copies)
        resumed.step()
    assert_runs_bitwise((copies, resumed), (params, optimizer), f"{mode} resume")


@pytest.mark.parametrize("mode", MODES)
def test_the_state_dict_loads_into_the_plain_lion(mode):
    """dequantize_state_dict gives the plain Lion's format: exp_avg decoded
    (8-bit) or as stored, no compensation nor rounding count; a plain Lion
    loads it and steps from the states SwapOptimizer held."""
    params, optimizer = run(mode, 2)
    plain_dict = so.dequantize_state_dict(optimizer.state_dict())
    for entry in plain_dict["state"].values():
        assert set(entry) == {"exp_avg"}
    plain = make_lion([nn.Parameter(p.detach().clone()) for p in params])
    plain.load_state_dict(plain_dict)
    for i, p in enumerate(params):
        entry = optimizer.state[p]
        if "exp_avg_codes" in entry:
            held = compact.dequantize(entry["exp_avg_codes"], entry["exp_avg_absmax"], "exp_avg")
        else:
            held = entry["exp_avg"]
        state = plain.state[plain.param_groups[0]["params"][i]]["exp_avg"]
        assert state.dtype == p.dtype
        assert torch.equal(state, held.to(p.dtype)), f"param {i}"


@pytest.mark.parametrize("device", DEVICES)
def test_kahan_is_the_float32_update_rounded_with_its_remainder(device):
    """Kahan on bf16 params is, bit for bit, the plain Lion stepping a float32
    copy (param + compensation) with float32 grads and states, rounded back
    to the param, the remainder kept as the bf16 compensation."""
    params, optimizer = run("kahan", 5, device=device, swap_times=4)
    for i, start in enumerate(CASE.params(torch.bfloat16, device)()):
        param, compensation = start.detach().clone(), torch.zeros_like(start)
        stand_in = nn.Parameter(param.float())
        plain = make_lion([stand_in])
        for step in range(5):
            grads = CASE.params(torch.bfloat16, device)()
            give_grads(step, grads)  # (the same grads as the run's param i)
            with torch.no_grad():
                stand_in.copy_(param.float() + compensation.float())
            stand_in.grad = grads[i].grad.float()
            plain.step()
            param = stand_in.detach().bfloat16()
            compensation = (stand_in.detach() - param.float()).bfloat16()
        assert same_bits(params[i], param), f"param {i}"
        assert same_bits(optimizer.state[params[i]]["compensation"], compensation.cpu()), f"compensation {i}"
        assert same_bits(optimizer.state[params[i]]["exp_avg"], plain.state[stand_in]["exp_avg"].cpu()), f"state {i}"


class HalfStateLion(Lion):
    """Lion keeping its state in bf16 whatever its param's dtype."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]["exp_avg"]
                update = state.float().mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                state.copy_(state.float().mul(beta2).add_(p.grad, alpha=1 - beta2))


@pytest.mark.parametrize("make, settings, error, message", [
    (Lion, dict(trust_per_param_step=True, trust_elementwise_step=True, state_dtype=torch.bfloat16),
     ValueError, "needs trusted_state_kinds"),
    (Lion, dict(trust_per_param_step=True, state_dtype=torch.uint8, trusted_state_kinds=KINDS),
     ValueError, "needs trust_elementwise_step=True too"),
    (Lion, dict(trust_per_param_step=True, kahan_summation=True),
     ValueError, "needs trust_elementwise_step=True too"),
    (Lion, dict(trusted_state_kinds=KINDS), ValueError, "set it too"),
    (Lion, dict(trust_per_param_step=True, trusted_state_kinds={"exp_avg": "momentum"}),
     ValueError, "must be a dict of state name -> one of"),
], ids=["no-kinds", "compact-not-elementwise", "kahan-not-elementwise", "kinds-untrusted", "unknown-kind"])
def test_what_is_refused_at_the_wrap(make, settings, error, message):
    params = CASE.params(torch.bfloat16 if settings.get("kahan_summation") else torch.float32)()
    with pytest.raises(error, match=message):
        so.SwapOptimizer(make(params), **settings)


@pytest.mark.parametrize("make, settings, error, message", [
    (Lion, dict(state_dtype=torch.uint8, trusted_state_kinds={"momentum": "signed"}),
     ValueError, "trusted_state_kinds .* does not name it"),
    (HalfStateLion, dict(state_dtype=torch.bfloat16), TypeError, "is torch.bfloat16, but its update ran"),
], ids=["state-not-named", "state-in-another-dtype"])
def test_what_is_refused_at_the_first_step_changes_nothing(make, settings, error, message):
    """A learned state the kinds do not name, or kept in another dtype than
    its update runs the param in: refused at the first step (the probe sees
    it on copies): params unchanged, no state kept."""
    params = CASE.params()()
    before = [p.detach().clone() for p in params]
    optimizer = so.SwapOptimizer(make(params), **dict(TRUST, **settings))
    give_grads(0, params)
    with pytest.raises(error, match=message):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert not optimizer.state


def test_kinds_that_compact_nothing_warn():
    with pytest.warns(UserWarning, match="names no state that is stored compact"):
        so.SwapOptimizer(Lion(CASE.params()()), **dict(TRUST, trusted_state_kinds={"exp_avg": None}),
                         state_dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", MODES)
def test_dtensor_params_are_bitwise_local_ones(mode, mesh):
    """DTensor params sharded on dim 0 (FSDP2's layout) on a one-rank mesh:
    params and states bitwise the same SwapOptimizer on plain tensors; the
    param-shaped states (bf16 ones, 8-bit codes, the compensation) DTensors
    with the params' placements, 8-bit scales this rank's own."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    fields, dtype = MODES[mode]
    local_params = CASE.params(dtype)()
    params = [nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in local_params]
    swapped, local = (so.SwapOptimizer(make_lion(ps), **dict(TRUST, **fields), swap_times=4)
                      for ps in (params, local_params))
    for step in range(3):
        give_grads(step, local_params)
        for p, q in zip(params, local_params):
            p.grad = distribute_tensor(q.grad.clone(), mesh, [Shard(0)])
        swapped.step()
        local.step()
    for i, (p, q) in enumerate(zip(params, local_params)):
        assert same_bits(p.to_local(), q), f"{mode}: param {i}"
        assert swapped.state[p].keys() == local.state[q].keys()
        for key, value in local.state[q].items():
            mine = swapped.state[p][key]
            if torch.is_tensor(value) and value.shape == q.shape:
                assert isinstance(mine, DTensor) and mine.placements == p.placements, (i, key)
                mine = mine.to_local()
            assert_close(torch.as_tensor(mine), torch.as_tensor(value), **BITWISE, msg=lambda m: f"{i}/{key}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_a_new_param_group_keeps_the_stored_states(mode):
    """add_param_group lays the store out again from what it holds (the
    store's forms, read back as the states they hold): every stored value
    bitwise as before, and the new group's param learns its states at its
    first step."""
    params, optimizer = run(mode, 2, swap_times=4)
    before = copy.deepcopy(optimizer.state_dict()["state"])
    fields, dtype = MODES[mode]
    added = nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(9)).to(dtype))
    optimizer.add_param_group({"params": [added]})
    after = optimizer.state_dict()["state"]
    assert after.keys() == before.keys()
    for index, entry in before.items():
        assert after[index].keys() == entry.keys()
        for key, value in entry.items():
            assert_close(torch.as_tensor(after[index][key]), torch.as_tensor(value), **BITWISE)
    give_grads(2, params + [added])
    optimizer.step()
    assert optimizer.state[added].keys() == optimizer.state[params[0]].keys()


def test_a_state_written_in_the_plain_form_is_encoded():
    """An entry replaced through `state` with the plain Lion's form (a float32
    exp_avg) under 8-bit states: the store encodes it as compact.quantize does,
    and the next step starts from it."""
    params, optimizer = run("8bit", 1)
    values = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(4)) * 1e-3
    optimizer.state[params[0]] = {"exp_avg": values.clone()}
    reference = nn.Parameter(params[0].detach().clone())
    plain = make_lion([reference])
    plain.state[reference]["exp_avg"] = compact.dequantize(*compact.quantize(values, "exp_avg"), "exp_avg")
    give_grads(1, params)
    reference.grad = params[0].grad.clone()
    optimizer.step()
    plain.step()
    assert same_bits(params[0], reference)


class FailsOnce(Lion):
    """Lion whose update of its second param raises once (as an out-of-memory
    error would), the first time `armed` is set."""

    armed = False

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if FailsOnce.armed and p.grad is not None and p.numel() == 16384:
                    FailsOnce.armed = False
                    raise torch.OutOfMemoryError("simulated")
        return super().step(closure)


@pytest.mark.parametrize("mode", ["kahan", "kahan-bf16", "8bit"])
def test_a_failed_first_update_after_a_load_loses_nothing(mode):
    """The first step after load_state_dict updates each param whole (it
    learns the loaded states); one that fails there gives every param back,
    and its compensation and states stay as loaded: the retried step goes on
    bitwise as the run that was saved (a restore that bumped the params'
    versions read as a write outside step(), which zeroes a compensation)."""
    fields, dtype = MODES[mode]
    params, optimizer = run(mode, 2, swap_times=4)
    saved = copy.deepcopy(optimizer.state_dict())
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    give_grads(2, params)
    optimizer.step()
    resumed = so.SwapOptimizer(FailsOnce(copies, lr=1e-2, betas=(0.8, 0.9)), **dict(TRUST, **fields), swap_times=4)
    resumed.load_state_dict(saved)
    before = [p.detach().clone() for p in copies]
    give_grads(2, copies)
    FailsOnce.armed = True
    with pytest.raises(RuntimeError, match="simulated"):
        resumed.step()
    assert all(same_bits(p, q) for p, q in zip(copies, before))
    resumed.step()
    assert_runs_bitwise((copies, resumed), (params, optimizer), f"{mode} retried")


class ExtraStateForLargeParams(Lion):
    """Lion that keeps one more state for params of 4,096 elements or more:
    the probe, on the smallest param of each dimensionality, does not see it."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.numel() >= 4096:
                    self.state[p]["seen"] = torch.ones_like(p)


def test_a_state_not_named_found_at_a_first_update_changes_nothing():
    """Under 8-bit states, a param-shaped state trusted_state_kinds does not
    name that only larger params keep: the probe passes, the first update of
    such a param refuses, and every param updated before it gets its value
    back; no state is kept."""
    params = [nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    params.append(nn.Parameter(torch.randn(8, 8)))  # the 2-D param the probe takes
    before = [p.detach().clone() for p in params]
    optimizer = so.SwapOptimizer(ExtraStateForLargeParams(params), **dict(TRUST, state_dtype=torch.uint8))
    give_grads(0, params)
    with pytest.raises(ValueError, match="state 'seen' of param 0 is param-shaped, and trusted_state_kinds"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before)) and not optimizer.state


def test_a_checkpoint_saved_under_other_kinds_is_decoded_by_its_own_map():
    """8-bit codes saved under one kind ('running_max', the unsigned map) and
    loaded where trusted_state_kinds says another ('signed'): decoded by the
    map they were saved with (the state dict names it), then encoded by this
    store's, never read by the wrong map."""
    params, optimizer = run("8bit", 2, trusted_state_kinds={"exp_avg": "running_max"})
    saved = optimizer.state_dict()
    assert saved["param_groups"][0]["swap_state_format"]["states"]["exp_avg"]["code_map"] == "unsigned"
    values = compact.dequantize(saved["state"][0]["exp_avg_codes"], saved["state"][0]["exp_avg_absmax"],
                                "exp_avg", "unsigned")
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    loaded = so.SwapOptimizer(make_lion(copies), **dict(TRUST, **MODES["8bit"][0]))
    loaded.load_state_dict(saved)
    codes, absmax = compact.quantize(values, "exp_avg")
    assert torch.equal(loaded.state[copies[0]]["exp_avg_codes"], codes)
    assert torch.equal(loaded.state[copies[0]]["exp_avg_absmax"], absmax)


def test_a_bf16_checkpoint_loads_into_kahan_on_fp32_params_without_its_rounding_count():
    """The rounding's own count (swap_rounding_step) of a bf16-state
    checkpoint is no state of the optimizer's: a store that keeps none
    (Kahan, which does nothing on fp32 params) drops it."""
    params, optimizer = run("bf16", 2)
    saved = optimizer.state_dict()
    assert "swap_rounding_step" in saved["state"][0]
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    with pytest.warns(UserWarning, match="applies to 16-bit params"):
        loaded = so.SwapOptimizer(make_lion(copies), **dict(TRUST, kahan_summation=True))
    loaded.load_state_dict(saved)
    assert all(set(entry) == {"exp_avg"} for entry in loaded.state_dict()["state"].values())


def test_a_state_kept_exact_stays_in_the_dtype_the_optimizer_keeps():
    """Under a compact state_dtype, a state named None in trusted_state_kinds
    is exact: HalfStateLion's bf16 state beside fp32 params stays bf16, and
    the run is bitwise the plain HalfStateLion's."""
    plain_params, params = CASE.params()(), CASE.params()()
    plain = HalfStateLion(plain_params, lr=1e-2)
    with pytest.warns(UserWarning, match="names no state that is stored compact"):
        optimizer = so.SwapOptimizer(HalfStateLion(params, lr=1e-2), **dict(
            TRUST, trusted_state_kinds={"exp_avg": None}), state_dtype=torch.uint8, swap_times=4)
    for step in range(3):
        give_grads(step, plain_params, params)
        plain.step()
        optimizer.step()
    for p, q in zip(params, plain_params):
        assert same_bits(p, q)
        assert same_bits(optimizer.state[p]["exp_avg"], plain.state[q]["exp_avg"])
