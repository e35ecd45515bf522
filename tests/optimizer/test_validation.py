"""Every misuse gets a clear error naming the fix, and changes nothing."""

import gc

import pytest
import torch

import swap_optimizer as so
from conftest import PACKED_KERNEL
from swap_training import build_model, loss_of, params_of, state_tensors, swap_optimizer, train
from optimizer_cases import Lion


def params(n=2048, count=2):
    return [torch.nn.Parameter(torch.randn(n)) for _ in range(count)]


class KeepsAdamStep(torch.optim.AdamW):
    pass


class OwnStep(torch.optim.AdamW):
    def step(self, closure=None):
        return super().step(closure)


class HandWrittenLion(torch.optim.Optimizer):
    """An optimizer of the user's own (no declaration covers it)."""

    def __init__(self, params):
        super().__init__(params, dict(lr=1e-4))


@pytest.mark.parametrize("make, error, message", [
    (lambda: HandWrittenLion(params()), TypeError, "wraps torch.optim's .*Adam.* got HandWrittenLion"),
    (lambda: OwnStep(params()), TypeError, "got OwnStep"),
    (lambda: torch.optim.Adam(params(), capturable=True), ValueError, "capturable=True.*capturable=False"),
    (lambda: torch.optim.AdamW(params(), differentiable=True), ValueError, "differentiable=True"),
    (lambda: torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))]), TypeError,
     "complex.*view_as_real"),
    (lambda: torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]), TypeError,
     "float64; supported are float32, bfloat16 and float16"),
    (lambda: torch.optim.AdamW([torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4, device="meta"))]),
     ValueError, "param 1 is on meta but earlier params are on cpu"),
])
def test_unsupported_optimizers_and_params(make, error, message):
    with pytest.raises(error, match=message):
        so.SwapOptimizer(make())


def test_supported_variants_are_accepted():
    so.SwapOptimizer(KeepsAdamStep(params()))
    so.SwapOptimizer(torch.optim.AdamW(params(), fused=True))
    so.SwapOptimizer(torch.optim.AdamW(params(), foreach=True))  # only how torch would run it: accepted
    with pytest.raises(TypeError, match="already a SwapOptimizer"):
        so.SwapOptimizer(so.SwapOptimizer(torch.optim.AdamW(params())))


@pytest.mark.parametrize("fields, message", [
    (dict(swap_times=0), "swap_times must be an int >= 1"),
    (dict(swap_times=2.5), "swap_times must be an int >= 1"),
    (dict(swap_times=True), "swap_times must be an int >= 1"),
    (dict(min_numel=-1), "min_numel must be an int >= 0"),
    (dict(num_arenas=1), "num_arenas must be an int >= 2"),
    (dict(state_dtype=torch.float16), "state_dtype must be None .*, torch.float32, torch.bfloat16 or torch.uint8"),
    (dict(master_weights="yes"), "master_weights must be True or False"),
    (dict(pin_memory=None), "pin_memory must be True or False"),
    (dict(keep_arenas=1), "keep_arenas must be True or False"),
    (dict(staging_budget_bytes=0), "staging_budget_bytes must be an int >= 1"),
    (dict(unscale_in_step="yes"), "unscale_in_step must be True or False"),
    # (the packed kernel checks Adam's names; torch's update, the states its group keeps)
    (dict(state_keys=("exp_avg", "momentum_buffer")), "\\['momentum_buffer'\\] are not states of AdamW"),
    (dict(state_keys=("exp_avg", "momentum_buffer"), **PACKED_KERNEL), "unknown state key\\(s\\) \\['momentum_buffer'\\]"),
    (dict(state_keys="exp_avg"), "sequence of names"),
    (dict(state_keys=("exp_avg", "exp_avg")), "names a key twice"),
    (dict(state_keys=(k for k in ["exp_avg", "bogus"])), "\\['bogus'\\] are not states of AdamW"),
    (dict(swaptimes=4), "unknown setting\\(s\\) \\['swaptimes'\\]"),
])
def test_bad_config_values(fields, message):
    with pytest.raises(ValueError, match=message):
        so.SwapOptimizer(torch.optim.AdamW(params()), **fields)


def test_config_and_fields_combine():
    config = so.SwapOptimizerConfig(swap_times=4, state_keys=["exp_avg"])
    assert config.state_keys == ("exp_avg",)
    opt = so.SwapOptimizer(torch.optim.AdamW(params(count=5)), config, num_arenas=3)
    assert opt.config.swap_times == 4 and opt.config.num_arenas == 3
    with pytest.raises(TypeError, match="SwapOptimizerConfig"):
        so.SwapOptimizer(torch.optim.AdamW(params()), config={"swap_times": 4})
    with pytest.raises(Exception):
        config.swap_times = 2  # frozen


def trained(**fields):
    model = build_model("mlp", "cpu")
    optimizer = swap_optimizer("adamw", model.parameters(), swap_times=2, **fields)
    train("mlp", model, optimizer, 2, "cpu")
    optimizer.zero_grad()
    loss_of("mlp", model, 5, "cpu").backward()
    return model, optimizer


def break_amsgrad(model, optimizer):
    optimizer.param_groups[0]["amsgrad"] = True


def break_lr(model, optimizer):
    optimizer.param_groups[0]["lr"] = -1.0


def break_capturable(model, optimizer):
    optimizer.param_groups[0]["capturable"] = True


def break_param_dtype(model, optimizer):
    model.half()


def break_grad_sparse(model, optimizer):
    p = next(model.parameters())
    p.grad = p.grad.to_sparse()


@pytest.mark.parametrize("breaker, error, message, fields", [
    (break_amsgrad, ValueError, "amsgrad cannot change after wrapping", PACKED_KERNEL),
    (break_amsgrad, ValueError, "has stepped with \\['step', 'exp_avg', 'exp_avg_sq'\\]", {}),
    (break_lr, ValueError, "need lr >= 0", PACKED_KERNEL),  # (torch's own step takes it, as the plain one does)
    (break_capturable, ValueError, "capturable=True", PACKED_KERNEL),
    (break_capturable, ValueError, "capturable=True", {}),
    (break_param_dtype, ValueError, "create a new SwapOptimizer after moving or converting the model", PACKED_KERNEL),
    (break_param_dtype, ValueError, "create a new SwapOptimizer after moving or converting the model", {}),
    (break_grad_sparse, ValueError, "sparse gradient", PACKED_KERNEL),
    (break_grad_sparse, RuntimeError, "sparse gradient", {}),
])
def test_bad_step_inputs_change_nothing(breaker, error, message, fields):
    model, optimizer = trained(**fields)
    before_states = state_tensors(optimizer, model)
    breaker(model, optimizer)
    before_params = params_of(model)
    with pytest.raises(error, match=message):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before_params))
    after = state_tensors(optimizer, model)
    assert all(torch.equal(before_states[k], after[k]) for k in before_states)


def test_closure_runs_once_before_the_update_as_in_torch():
    """Lightning's automatic optimization always passes a closure."""
    results = []
    for wrap in (True, False):
        model = build_model("mlp", "cpu")
        optimizer = swap_optimizer("adamw", model.parameters(), swap_times=2) if wrap else \
            torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
        calls = []

        def closure():
            calls.append(torch.is_grad_enabled())
            optimizer.zero_grad()
            loss = loss_of("mlp", model, 0, "cpu")
            loss.backward()
            return loss

        loss = optimizer.step(closure)
        assert calls == [True] and loss.requires_grad
        results.append((loss.detach(), params_of(model)))
    assert torch.equal(results[0][0], results[1][0])
    for p, q in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("given", [
    lambda model: model.parameters(),
    lambda model: list(model.parameters()),
    lambda model: [{"params": list(model.parameters()), "lr": 1e-3}],
    lambda model: model.weight,
], ids=["generator", "list", "groups", "tensor"])
def test_params_instead_of_an_optimizer_name_the_fix(given):
    model = torch.nn.Linear(8, 8)
    with pytest.raises(TypeError, match="SwapOptimizer wraps a torch.optim optimizer, and got params") as raised:
        so.SwapOptimizer(given(model))
    message = str(raised.value)
    assert message.startswith("SwapOptimizer wraps") and "SwapOptimizer(torch.optim.AdamW(model.parameters()" in message
    assert "trust_per_param_step" not in message  # that setting vouches for an optimizer, not for params


def test_something_else_instead_of_an_optimizer_names_what_it_got():
    with pytest.raises(TypeError, match="wraps a torch.optim optimizer, and got a str"):
        so.SwapOptimizer("adamw")


OPTIMIZER_KINDS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "vouched-for": lambda ps: Lion(ps),
}


def wrap(kind, inner):
    return so.SwapOptimizer(inner, swap_times=2, trust_per_param_step=kind == "vouched-for")


@pytest.mark.parametrize("kind", sorted(OPTIMIZER_KINDS))
def test_wrapping_one_optimizer_twice_is_refused_while_the_first_lives(kind):
    ps = params()
    inner = OPTIMIZER_KINDS[kind](ps)
    first = wrap(kind, inner)
    with pytest.raises(RuntimeError, match="already wrapped by a SwapOptimizer that is still alive"):
        wrap(kind, inner)
    for p in ps:
        p.grad = torch.randn_like(p)
    first.step()  # the refusal changed nothing
    del first
    gc.collect()
    second = wrap(kind, inner)  # the first is gone: the optimizer may be wrapped again
    second.step()


@pytest.mark.parametrize("kind", sorted(OPTIMIZER_KINDS))
def test_stepping_the_wrapped_optimizer_itself_is_refused(kind):
    ps = params()
    inner = OPTIMIZER_KINDS[kind](ps)
    swapped = wrap(kind, inner)
    for p in ps:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in ps]
    with pytest.raises(RuntimeError, match="step\\(\\) was called on the .* that a SwapOptimizer wraps; .* Call step\\(\\) "
                                           "on the SwapOptimizer"):
        inner.step()
    assert all(torch.equal(a, p) for a, p in zip(before, ps))  # nothing ran
    swapped.step()  # its own update calls the wrapped class's step past the guard
    assert not all(torch.equal(a, p) for a, p in zip(before, ps))
    del swapped
    gc.collect()
    inner.step()  # unwrapped again: the optimizer is the user's


def test_an_optimizer_whose_step_hooks_cannot_be_registered_is_still_wrapped():
    """A wrapper optimizer may keep its hooks in a plain dict (pytorch_optimizer
    3.11's Magma), where torch cannot register one: the guard against its own
    step() is left out, the wrapping goes on."""
    ps = params()
    inner = Lion(ps)
    inner._optimizer_step_pre_hooks = {}  # not weak-referenceable: register_step_pre_hook raises TypeError
    swapped = so.SwapOptimizer(inner, swap_times=2, trust_per_param_step=True)
    for p in ps:
        p.grad = torch.randn_like(p)
    swapped.step()
    assert all(set(entry) == {"exp_avg"} for entry in swapped.state.values())
