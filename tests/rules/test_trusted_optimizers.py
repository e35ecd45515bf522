"""Optimizers SwapOptimizer has no declaration for (the user's own, or from a
package): refused by default; with trust_per_param_step=True their states are
learned at each param's first update and streamed, bitwise the plain
optimizer's; what breaks the contract and can be seen is refused, and a
refused first step changes nothing."""

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import swap_optimizer as so
from conftest import DEVICES
from optimizer_cases import Lion
from pairs import assert_same_state, bits, give_grads, run_pair, same_bits

SHAPES = [(256, 700), (70000,), (64, 300), (5,)]  # the first two are large enough to be cut into pieces


def make_params(dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    return [nn.Parameter(torch.randn(*s, generator=generator).to(device, dtype)) for s in SHAPES]


class RowScaled(torch.optim.Optimizer):
    """States of every sort a trusted optimizer may keep: an fp32 param-shaped
    moment (whatever the param's dtype), a per-row whole state, a 0-dim step
    tensor on the param's device and a Python number."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), device=p.device)
                    state["updates"] = 0
                    state["moment"] = torch.zeros_like(p, dtype=torch.float32)
                    state["row_scale"] = torch.ones(p.shape[0] if p.dim() > 1 else 1, 1, device=p.device)
                state["step"] += 1
                state["updates"] += 1
                grad = p.grad.float().reshape(state["row_scale"].shape[0], -1)
                state["row_scale"].mul_(0.9).add_(grad.abs().mean(dim=1, keepdim=True), alpha=0.1)
                state["moment"].mul_(0.9).add_((grad / state["row_scale"]).reshape(p.shape), alpha=0.1)
                p.add_(state["moment"].to(p.dtype), alpha=-group["lr"] / state["step"].item() ** 0.5)


class GroupCounter(Lion):
    """Lion that counts steps in its param group, as timm's Adan does."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        super().step(closure)


def vouched_pair(make, steps=6, device="cpu", dtype=torch.float32, **settings):
    """The plain optimizer and the wrapped one (trust_per_param_step) over
    make_params: bitwise, param groups included."""
    return run_pair(make, lambda: make_params(dtype, device), steps, exact=True, trust_per_param_step=True,
                    **settings)


def test_refused_by_default_with_the_setting_named():
    with pytest.raises(TypeError, match="got Lion.*pass trust_per_param_step=True"):
        so.SwapOptimizer(Lion(make_params()))
    with pytest.raises(ValueError, match="trust_elementwise_step=True is a second promise"):
        so.SwapOptimizer(Lion(make_params()), trust_elementwise_step=True)
    with pytest.raises(TypeError, match="cannot wrap LBFGS"):  # trusted or not
        so.SwapOptimizer(torch.optim.LBFGS(make_params()), trust_per_param_step=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("elementwise", [False, True])
def test_a_hand_written_lion_is_bitwise_the_plain_one(device, elementwise):
    """Across swap_times {1, 2, 4, 16} x num_arenas {2, 3}; its params are cut
    into pieces only with the second promise."""
    for swap_times in (1, 2, 4, 16):
        for num_arenas in (2, 3):
            swapped = vouched_pair(Lion, device=device, swap_times=swap_times, num_arenas=num_arenas,
                                  trust_elementwise_step=elementwise).swapped
            stats = swapped.memory_stats()
            assert stats["swapped_state_keys"] == ["exp_avg"]
            assert (stats["split_params"] >= 1) == (elementwise and swap_times > 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_learned_states_of_every_kind(device, dtype):
    """fp32 moments of bf16 params, whole per-row states, 0-dim tensors and
    numbers: bitwise, whole states never cut, scalars kept where torch keeps
    them."""
    swapped = vouched_pair(RowScaled, device=device, dtype=dtype, swap_times=4, trust_elementwise_step=True).swapped
    stats = swapped.memory_stats()
    assert stats["split_params"] == 0  # every param keeps a whole state
    assert stats["swapped_state_keys"] == ["moment", "row_scale"]
    entry = swapped.state[swapped.param_groups[0]["params"][0]]
    assert entry["moment"].dtype == torch.float32 and entry["moment"].device.type == "cpu"
    assert entry["step"].device.type == device and entry["updates"] == 6
    # the layouts a caller without the optimizer asks for are the learned ones the store was built from
    layouts = swapped._rule.layouts_for(swapped.param_groups)
    assert layouts == swapped._rule._layouts_now and all(layouts)


class OutOfPlaceLion(Lion):
    """Lion whose step makes a new moment each update rather than writing the
    one it has (state["exp_avg"] = ..., as many hand-written optimizers do):
    each step's new tensor is what the store must keep."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                exp_avg = state.get("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((exp_avg * beta1 + p.grad * (1 - beta1)).sign(), alpha=-group["lr"])
                state["exp_avg"] = exp_avg * beta2 + p.grad * (1 - beta2)


@pytest.mark.parametrize("device", DEVICES)
def test_a_state_replaced_at_every_update_is_kept(device, monkeypatch):
    """Whole params and split params' pieces (whose batches the rule stages
    in C++, _C.staged_rows), at several batchings: bitwise the plain optimizer."""
    staged = []
    stage = so._C.staged_rows
    monkeypatch.setattr(so._C, "staged_rows", lambda *args: staged.append(stage(*args)) or staged[-1])
    for swap_times in (2, 5, 16):
        staged.clear()
        stats = vouched_pair(OutOfPlaceLion, device=device, swap_times=swap_times,
                             trust_elementwise_step=True).swapped.memory_stats()
        assert stats["split_params"] >= 1 and stats["swapped_state_keys"] == ["exp_avg"]
        # every batch of every step; at the first, whose params are updated whole to learn their
        # states, the store's batches have no grads (None: nothing to stage)
        batches = stats["batches"]
        assert len(staged) == 6 * batches and staged[:batches] == [None] * batches and None not in staged[batches:]


def test_a_group_value_the_step_writes_the_same_from_every_call():
    """timm's Adan keeps a step counter in the param group: every batch call
    writes the same value, which the group then holds, as the plain one."""
    plain, swapped, *_ = vouched_pair(GroupCounter, swap_times=4, trust_elementwise_step=True)
    assert swapped.param_groups[0]["step"] == plain.param_groups[0]["step"] == 6


class CallSize(Lion):
    """Writes into its group how many params the call held: per-param updates,
    but a group value that depends on the batch."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["call_size"] = len(group["params"])
        super().step(closure)


def test_a_group_value_that_differs_between_calls_raises_naming_it():
    params = make_params()
    swapped = so.SwapOptimizer(CallSize(params), trust_per_param_step=True, swap_times=2, min_numel=0)
    give_grads(0, params)
    swapped.step()  # first updates run one param per call: the same value each time
    give_grads(1, params)
    with pytest.raises(RuntimeError, match="wrote param group 0's 'call_size' as 1 in one call and 3 in another"):
        swapped.step()
    with pytest.raises(RuntimeError, match="partly updated; step\\(\\) refuses"):  # the torn-batch rule
        swapped.step()


class GlobalNorm(Lion):
    """Scales every update by the grad norm over the call's params (as LAMB's
    clipping or Prodigy's d): its step combines params."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            norm = torch.stack([p.grad.norm() for p in group["params"] if p.grad is not None]).norm()
            group["norm"] = norm
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(norm)
        super().step(closure)


class TrustRatio(Lion):
    """Scales each param's update by its own norm (LAMB's trust ratio): per
    param, but not elementwise."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(p.norm() / (p.grad.norm() + 1e-12))
        super().step(closure)


class CarriedScale(Lion):
    """Scales each grad by a factor that changes from one param to the next
    in its call (as pytorch_optimizer's ApolloDQN divides eps once per param)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            scale = 1.0
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)
                    scale *= 0.5
        super().step(closure)


class SharedCounter(Lion):
    """Keeps a counter for all params in its state, under a key that is not
    a param (as pytorch_optimizer's MADGRAD does)."""

    def step(self, closure=None):
        self.state["k"] = self.state.get("k", 0) + 1
        super().step(closure)


class WritesAttribute(Lion):
    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        super().step(closure)


class Subclassed(torch.Tensor):
    pass


class SubclassState(Lion):
    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("codes", torch.zeros_like(p).as_subclass(Subclassed))


class ScheduleFree(Lion):
    def train(self):
        pass

    def eval(self):
        pass


@pytest.mark.parametrize("make, elementwise, error, message", [
    (GlobalNorm, False, RuntimeError,
     "update of param 2 changes when another param is in the same call: its step combines"),
    (TrustRatio, True, RuntimeError, "trust_elementwise_step=True, but TrustRatio's update of param 2 cut in two"),
    (CarriedScale, False, RuntimeError, "update of param 2 changes when another param is in the same call"),
    (WritesAttribute, False, RuntimeError, "wrote the optimizer's attribute\\(s\\) \\['calls'\\]"),
    (SharedCounter, False, RuntimeError, "keeps state under \\[\"'k'\"\\], keys that are not params"),
    (SubclassState, False, TypeError, "is a Subclassed with layout torch.strided, not a plain strided tensor"),
])
def test_what_breaks_the_contract_is_refused_at_the_first_step_and_changes_nothing(make, elementwise, error, message):
    params = make_params()
    swapped = so.SwapOptimizer(make(params), trust_per_param_step=True, trust_elementwise_step=elementwise,
                               swap_times=4, min_numel=0)
    before = [p.detach().clone() for p in params]
    give_grads(0, params)
    with pytest.raises(error, match=message):
        swapped.step()
    assert all(same_bits(p, q) for p, q in zip(params, before))
    assert not swapped.state and "norm" not in swapped.param_groups[0]


def test_trust_ratio_without_the_elementwise_promise_runs_whole():
    swapped = vouched_pair(TrustRatio, swap_times=4).swapped
    assert swapped.memory_stats()["split_params"] == 0


class CounterFromTheStart(Lion):
    """Keeps a counter for all params in its state from __init__ on (as
    pytorch_optimizer's SPAM does)."""

    def __init__(self, params):
        super().__init__(params)
        self.state["total_step"] = 1  # (not 0: a truthy non-dict value must be refused too, not iterated)


def test_state_under_a_key_that_is_not_a_param_is_refused_at_wrap_time():
    with pytest.raises(ValueError, match="CounterFromTheStart keeps state under \\[\"'total_step'\"\\], keys that"):
        so.SwapOptimizer(CounterFromTheStart(make_params()), trust_per_param_step=True)


def test_states_touched_outside_step_are_refused():
    with pytest.raises(TypeError, match="cannot wrap ScheduleFree: its train\\(\\) and eval\\(\\) read or write"):
        so.SwapOptimizer(ScheduleFree(make_params()), trust_per_param_step=True)


def test_state_dict_round_trips_with_the_plain_optimizer_mid_run():
    """Saved from the swapped one into a plain one and back: both go on
    bitwise as a plain run that never left; a state loaded before the first
    step is learned from the loaded entries."""
    reference = make_params()
    plain = Lion(reference)
    params = make_params()
    swapped = so.SwapOptimizer(Lion(params), trust_per_param_step=True, trust_elementwise_step=True,
                               swap_times=4, min_numel=0)
    for step in range(3):
        give_grads(step, reference, params)
        plain.step()
        swapped.step()
    other = make_params()
    with torch.no_grad():
        for p, q in zip(other, params):
            p.copy_(q)
    moved = Lion(other)
    moved.load_state_dict(swapped.state_dict())
    resumed_params = make_params()
    with torch.no_grad():
        for p, q in zip(resumed_params, params):
            p.copy_(q)
    resumed = so.SwapOptimizer(Lion(resumed_params), trust_per_param_step=True, swap_times=4, min_numel=0)
    resumed.load_state_dict(moved.state_dict())
    assert resumed.memory_stats()["swapped_state_keys"] == ["exp_avg"]
    for step in range(3, 6):
        give_grads(step, reference, other, resumed_params)
        plain.step()
        moved.step()
        resumed.step()
    for p, q, r in zip(reference, other, resumed_params):
        assert same_bits(p, q) and same_bits(p, r)


def test_step_hooks_run_once_per_step():
    params = make_params()
    swapped = so.SwapOptimizer(Lion(params), trust_per_param_step=True, swap_times=8, min_numel=0)
    calls = []
    swapped.register_step_pre_hook(lambda *args: calls.append("pre"))
    handle = register_optimizer_step_post_hook(lambda *args: calls.append("global post"))
    try:
        for step in range(2):
            give_grads(step, params)
            swapped.step()
    finally:
        handle.remove()
    assert calls == ["pre", "global post"] * 2


def test_an_interrupt_during_a_learning_step_lets_it_finish():
    """Ctrl-C while the first updates are learned: the step finishes, then
    the signal's handler runs."""
    import signal

    params = make_params()

    class Interrupting(Lion):
        def step(self, closure=None):
            signal.raise_signal(signal.SIGINT)
            super().step(closure)

    reference = make_params()
    plain = Lion(reference)
    swapped = so.SwapOptimizer(Interrupting(params), trust_per_param_step=True, swap_times=4, min_numel=0)
    for step in range(2):
        give_grads(step, reference, params)
        plain.step()
        with pytest.raises(KeyboardInterrupt):
            swapped.step()
    assert all(same_bits(p, q) for p, q in zip(reference, params))
    assert bits(swapped.state_dict()["state"][0]["exp_avg"]).equal(bits(plain.state_dict()["state"][0]["exp_avg"]))


class HalvesGrads(Lion):
    """Changes each grad in place before its update."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        super().step(closure)


def test_a_failure_after_the_first_updates_changes_nothing():
    """state_keys naming a state the optimizer does not keep is found once its
    first updates have run: the params and their grads get their values back
    and no state is kept; with the name fixed, training then matches."""
    params, reference = make_params(), make_params()
    swapped = so.SwapOptimizer(HalvesGrads(params), trust_per_param_step=True, swap_times=4, min_numel=0,
                               state_keys=("exp_avgg",))
    give_grads(0, params, reference)
    with pytest.raises(ValueError, match="\\['exp_avgg'\\] are not states of HalvesGrads here"):
        swapped.step()
    assert all(same_bits(p, q) and same_bits(p.grad, q.grad) for p, q in zip(params, reference))
    assert not swapped.state


class StateAtUpdate(Lion):
    """Counts each param's updates in its state, and adds state `key` at
    update `at` (new_state gives its value)."""

    at, key = 2, "ema"

    @staticmethod
    def new_state(p):
        return p.detach().clone()

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["updates"] = state.get("updates", 0) + 1
                if state["updates"] == self.at:
                    state[self.key] = self.new_state(p)


class GroupTensorCounter(Lion):
    """Counts steps in a 0-dim tensor in its param group, in place."""

    def step(self, closure=None):
        for group in self.param_groups:
            group.setdefault("count", torch.zeros(())).add_(1)
        super().step(closure)


class AttributeTensorCounter(Lion):
    def __init__(self, params):
        super().__init__(params)
        self.counter = torch.zeros(())

    def step(self, closure=None):
        self.counter.add_(1)
        super().step(closure)


class AttributeListRenewed(Lion):
    """Replaces the tensor in a list it keeps with a new one, made once the
    old one is gone: the new one may take the old one's address, with the
    same version (the strict check holds what it compares)."""

    def __init__(self, params):
        super().__init__(params)
        self.history = [torch.zeros(())]

    def step(self, closure=None):
        self.history.pop()
        self.history.append(torch.zeros(()))
        super().step(closure)


@pytest.mark.parametrize("make, message", [
    (StateAtUpdate, "states change after a param's first update \\(\\['exp_avg', 'updates'\\], then \\['ema', "),
    (AttributeTensorCounter, "changed the optimizer's attribute\\(s\\) \\['counter'\\] in place"),
    (AttributeListRenewed, "changed the optimizer's attribute\\(s\\) \\['history'\\] in place"),
])
def test_what_the_probe_sees_over_two_updates_is_refused(make, message):
    params = make_params()
    swapped = so.SwapOptimizer(make(params), trust_per_param_step=True, swap_times=4, min_numel=0)
    before = [p.detach().clone() for p in params]
    give_grads(0, params)
    with pytest.raises(RuntimeError, match=message):
        swapped.step()
    assert all(same_bits(p, q) for p, q in zip(params, before)) and not swapped.state


def test_a_group_tensor_changed_in_place_counts_once_per_step():
    """Every call starts from a copy of the group's tensor: after 3 steps the
    group holds 3, as the plain optimizer's does."""
    plain, swapped, *_ = vouched_pair(GroupTensorCounter, steps=3, swap_times=4, trust_elementwise_step=True)
    assert swapped.param_groups[0]["count"].item() == plain.param_groups[0]["count"].item() == 3


def test_an_optimizer_that_stepped_before_it_was_wrapped_is_probed_too():
    """Wrapped after a plain step (its params have state), or resumed through
    load_state_dict: the first step still checks the contract."""
    params = make_params()
    plain = GlobalNorm(params)
    give_grads(0, params)
    plain.step()
    swapped = so.SwapOptimizer(plain, trust_per_param_step=True, swap_times=4, min_numel=0)
    before = [p.detach().clone() for p in params]
    give_grads(1, params)
    with pytest.raises(RuntimeError, match="changes when another param is in the same call"):
        swapped.step()
    assert all(same_bits(p, q) for p, q in zip(params, before))


class SignDescent(torch.optim.Optimizer):
    """Keeps no state at all."""

    def __init__(self, params):
        super().__init__(params, dict(lr=1e-3))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def test_a_stateless_optimizer_is_learned_once():
    """Its first update shows it keeps nothing: later steps run through the
    pipeline (one resident batch), not the first-update path again."""
    swapped = vouched_pair(SignDescent, steps=1, swap_times=4).swapped
    runtime = swapped._runtime
    params = swapped.param_groups[0]["params"]
    for step in range(1, 3):
        give_grads(step, params)
        swapped.step()
    assert swapped._runtime is runtime and swapped.memory_stats()["host_state_bytes"] == 0


def test_states_from_the_host_store_are_not_held_to_the_params_device():
    """A vouched-for optimizer's own states must be on their param's device;
    the same states read back from the host store (a re-layout on CUDA) are
    not refused for being on the host. (A meta param stands in for CUDA.)"""
    from swap_optimizer.rules.declarations import ELEMENT
    from swap_optimizer.rules.vouched_for import _learn_layout

    param = torch.empty(3, 4, device="meta")
    entry = {"exp_avg": torch.zeros(3, 4), "step": 1}
    with pytest.raises(TypeError, match="is on cpu, its param on meta"):
        _learn_layout(0, param, entry, "Lion", check_device=True)
    assert [s.kind for s in _learn_layout(0, param, entry, "Lion")] == [ELEMENT, "scalar"]


class RemovesGroupKey(Lion):
    def step(self, closure=None):
        for group in self.param_groups:
            group.pop("note", None)
        super().step(closure)


class StateAtTheThirdUpdate(StateAtUpdate):
    """A 'late' state that appears only at a param's third update: past the
    probe's two, found in the pipeline."""

    at, key = 3, "late"

    @staticmethod
    def new_state(p):
        return 0


def test_a_step_that_removes_a_group_key_is_refused_and_changes_nothing():
    params = make_params()
    optimizer = RemovesGroupKey(params)
    optimizer.param_groups[0]["note"] = "kept"
    swapped = so.SwapOptimizer(optimizer, trust_per_param_step=True, swap_times=4, min_numel=0)
    before = [p.detach().clone() for p in params]
    give_grads(0, params)
    with pytest.raises(RuntimeError, match="step removed \\['note'\\] from param group 0"):
        swapped.step()
    assert all(same_bits(p, q) for p, q in zip(params, before)) and swapped.param_groups[0]["note"] == "kept"


class MomentumAfterWarmup(torch.optim.Optimizer):
    """Keeps no state for its first three steps (a warm-up counted in its
    group), then a momentum buffer."""

    def __init__(self, params):
        super().__init__(params, dict(lr=1e-3))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["seen"] = group.get("seen", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["seen"] > 3:
                    self.state[p].setdefault("buf", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                    p.add_(self.state[p]["buf"], alpha=-group["lr"])
                else:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class MomentDroppedAtTheThirdUpdate(StateAtUpdate):
    """Sets its moment to None at a param's third update."""

    at, key = 3, "exp_avg"

    @staticmethod
    def new_state(p):
        return None


@pytest.mark.parametrize("make, steps, message", [
    (StateAtTheThirdUpdate, 2, "left param 0 with states \\['exp_avg', 'late', 'updates'\\]"),
    (MomentDroppedAtTheThirdUpdate, 2, "kept no 'exp_avg' for param 0, which it kept at its first update"),
    # learned as stateless at its first update, a param that later gets a
    # state cannot keep it: never a state silently thrown away
    (MomentumAfterWarmup, 3, "left param 0 with states \\['buf'\\], but it kept at its first update"),
])
def test_states_that_change_later_tear_the_batch(make, steps, message):
    """States that change past the probe's two updates: that step raises and
    its batch is torn (the next step refuses until a load)."""
    params = make_params()
    swapped = so.SwapOptimizer(make(params), trust_per_param_step=True, swap_times=4, min_numel=0)
    for step in range(steps):
        give_grads(step, params)
        swapped.step()
    give_grads(steps, params)
    with pytest.raises(RuntimeError, match=message):
        swapped.step()
    with pytest.raises(RuntimeError, match="partly updated; step\\(\\) refuses"):
        swapped.step()


@pytest.mark.parametrize("device", DEVICES)
def test_a_device_budget_keeps_part_of_a_vouched_for_optimizers_state_resident(device):
    """Its states are learned at the first step (whose whole-param updates the
    budget must hold: about 2.2 MB of temporaries here); the store laid out
    for them then follows the budget, bitwise the plain optimizer. All
    resident would take 4.3 MB (1.07 MB of states, and the resident batch's
    call's temporaries), all swapped 0.86 MB."""
    slow_link = so.StepCostModel(1e9, 1e9, 1.6e9, 1e11, batch_seconds=20e-6, step_seconds=100e-6)
    budget = 2_500_000
    swapped = vouched_pair(Lion, device=device, swap_times=8, num_arenas=2, trust_elementwise_step=True,
                          device_budget_bytes=budget, cost_model=slow_link).swapped
    stats = swapped.memory_stats()
    assert 0 < stats["resident_share"] < 1 and stats["plan"]["device_bytes"]["total"] <= budget
    assert stats["resident_state_bytes"] + stats["peak_staging_bytes"] + stats["update_temporary_bytes"] <= budget


class MaskedLion(Lion):
    """Lion that makes a state in its __init__ (a mask of the weights it
    updates, as pytorch_optimizer's SaRA does) and reads it in every step."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["mask"] = (p.detach().abs() < 1.0).to(p.dtype)

    def grad_of(self, p):
        return p.grad * self.state[p]["mask"]  # KeyError without the state made in __init__


@pytest.mark.parametrize("elementwise", [False, True])
def test_a_state_made_in_init_is_kept_and_stays_bitwise(elementwise):
    """The first update of each param runs whole, from the state it already
    has (the probe's copies too): the mask is kept beside the moment."""
    plain, swapped, *_ = vouched_pair(lambda ps: MaskedLion(ps), swap_times=4, trust_elementwise_step=elementwise)
    assert all(set(entry) == {"mask", "exp_avg"} for entry in swapped.state.values())
    assert swapped.memory_stats()["swapped_state_keys"] == ["mask", "exp_avg"]


class NeedsOutsideValue(Lion):
    """A step that reads a value its states do not hold (set outside step())."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.state[p]["outside"])
        super().step(closure)


def test_an_error_inside_a_vouched_for_step_is_a_refusal_that_changes_nothing():
    params = make_params()
    optimizer = NeedsOutsideValue(params)
    swapped = so.SwapOptimizer(optimizer, min_numel=0, swap_times=2, trust_per_param_step=True)
    give_grads(0, params)
    before = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match=r"NeedsOutsideValue's own step raised KeyError: 'outside', where "
                                           r"SwapOptimizer ran it .* keep its state on the device") as raised:
        swapped.step()
    assert isinstance(raised.value.__cause__, KeyError)
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, params))
    assert not any(swapped.state.values())


class TupleCounter(Lion):
    """Lion with a group step counter kept in a tuple and bumped in place (a
    group value a vouched-for step changes)."""

    def __init__(self, params):
        super().__init__(params)
        for group in self.param_groups:
            group["count"] = (torch.zeros(()),)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"][0].add_(1)
            group["lr"] = 1e-3 / float(group["count"][0])
        return super().step(closure)


def test_a_tensor_inside_a_tuple_group_value_changed_in_place_is_followed():
    """Each call gets its own copy of the tuple; what the calls write into it
    (the same in every call) becomes the group's, as in the plain run."""
    plain, swapped, *_ = vouched_pair(lambda ps: TupleCounter(ps), steps=4, swap_times=2)
    assert swapped.param_groups[0]["count"][0].item() == plain.param_groups[0]["count"][0].item() == 4


def test_a_resume_relearns_from_the_loaded_state_without_laying_the_store_out_again(monkeypatch):
    """After load_state_dict each param's next update runs whole from its
    loaded state (it might hold state made outside a step); when that update
    keeps the states the store already holds, they are written in place: no
    second store (bitwise the plain optimizer all along)."""
    a, b = make_params(), make_params()
    plain, first = Lion(a), so.SwapOptimizer(Lion(b), min_numel=0, swap_times=4, trust_per_param_step=True)
    for step in range(3):
        give_grads(step, a, b)
        plain.step()
        first.step()
    saved = first.state_dict()
    del first
    resumed = so.SwapOptimizer(Lion(b), min_numel=0, swap_times=2, trust_per_param_step=True)
    resumed.load_state_dict(saved)
    layouts = []
    real_lay_out = type(resumed._rule)._lay_out  # the store is laid out by the rule
    monkeypatch.setattr(type(resumed._rule), "_lay_out", lambda self, *args, **kw: layouts.append(1) or
                        real_lay_out(self, *args, **kw))
    for step in range(3, 6):
        give_grads(step, a, b)
        plain.step()
        resumed.step()
    assert not layouts, "the first step after the load laid the store out again"
    assert not resumed._rule._not_updated
    for p, q in zip(a, b):
        assert same_bits(p, q)
    assert_same_state(plain, resumed)


class RunsOutOfMemory(Lion):
    @torch.no_grad()
    def step(self, closure=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_running_out_of_memory_inside_a_vouched_for_step_stays_an_out_of_memory_error():
    """Not the advice to keep the state on the device: the error of a lack of
    memory is raised as it is (and refuses nothing)."""
    params = make_params()
    swapped = so.SwapOptimizer(RunsOutOfMemory(params), min_numel=0, trust_per_param_step=True)
    give_grads(0, params)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        swapped.step()
