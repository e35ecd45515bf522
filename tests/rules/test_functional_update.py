"""After a param's first step, each batch calls torch's functional update
(torch.optim.sgd.sgd, adam.adam, ...) with its lists ready, as the class's
step() would call it (swap_optimizer/rules/functional.py); where that call
cannot be proven the one step() makes, step() runs. The parity of every
implementation (test_rules.py, test_optimizer_capabilities.py) covers its
numbers; these tests cover which path runs, and the fallbacks."""

import functools

import pytest
import torch
from torch import nn

import swap_optimizer as so
from swap_optimizer.rules import functional, torch_update
from swap_optimizer.rules.functional import FunctionalUpdate, code_digest, functional_update_for, functional_updates
from pairs import assert_same_state, give_grads, same_bits
from test_rules import first_variant, make_params

NAMES = sorted(cls.__name__ for cls in functional_updates())
CHECKED_TORCH = ("2.13", "2.14")  # the versions the calls were written against (the module's doc)


def test_every_call_is_known_on_the_checked_torch_versions():
    version = ".".join(torch.__version__.split(".")[:2])
    if version not in CHECKED_TORCH:
        pytest.skip(f"torch {torch.__version__}: the calls were written against {CHECKED_TORCH}'s code; here the "
                    "classes whose code differs run step() (exact, slower)")
    assert [cls.__name__ for cls, update in functional_updates().items() if update is None] == []
    assert functional_update_for(torch.optim.AdamW([nn.Parameter(torch.randn(2))])) is functional_updates()[
        torch.optim.Adam]


@pytest.fixture
def calls(monkeypatch):
    """Counts of the two paths: torch's functional call, the class's step() on
    a stand-in; and of the calls whose lists are the runtime's (lists_over)."""
    counts = {"functional": 0, "step": 0}
    functional_call, torch_step = FunctionalUpdate.__call__, torch_update.run_torch_update

    def counted_functional(self, *args, **kwargs):
        counts["functional"] += 1
        return functional_call(self, *args, **kwargs)

    def counted_step(*args, **kwargs):
        counts["step"] += 1
        return torch_step(*args, **kwargs)

    lists_over = FunctionalUpdate.lists_over
    counts["lists_over"] = 0

    def counted_lists_over(self, *args, **kwargs):
        counts["lists_over"] += 1
        return lists_over(self, *args, **kwargs)

    monkeypatch.setattr(FunctionalUpdate, "lists_over", counted_lists_over)
    monkeypatch.setattr(FunctionalUpdate, "__call__", counted_functional)
    monkeypatch.setattr(torch_update, "run_torch_update", counted_step)
    return counts


def _pair(name, swap_times, **kwargs):
    cls = getattr(torch.optim, name)
    kwargs = dict(first_variant(name), **kwargs)
    a, b = make_params(name), make_params(name)
    return a, b, cls(a, **kwargs), so.SwapOptimizer(cls(b, **kwargs), swap_times=swap_times, min_numel=0)


@pytest.mark.parametrize("name", NAMES)
def test_after_the_first_step_every_batch_calls_the_functional_update(name, calls):
    a, b, plain, swapped = _pair(name, swap_times=4)
    # A first step creates the states: the class's step() runs it (Adagrad's
    # constructor creates them, so its first step calls the function too).
    first_by_step = name != "Adagrad"
    for step in range(4):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
        if step == 0:
            assert (calls["functional"], calls["step"]) == ((0, 4) if first_by_step else (4, 0))
    assert calls["step"] == (4 if first_by_step else 0) and calls["functional"] >= (3 if first_by_step else 4) * 4
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


@pytest.mark.parametrize("swap_times", [6, 4])
@pytest.mark.parametrize("name", ["SGD", "Adam", "NAdam"])
def test_each_group_calls_with_its_own_settings(name, swap_times, calls):
    """Two groups with other settings: a batch of one group's whole params
    hands the runtime's lists to the call with that group's values (swap_times
    6: every batch; 4: a batch of both groups walks its rows)."""
    cls = getattr(torch.optim, name)
    kwargs = first_variant(name)

    def make():
        generator = torch.Generator().manual_seed(1)
        return [nn.Parameter(torch.randn(64, 32, generator=generator)) for _ in range(6)]
    a, b = make(), make()

    def groups(params):
        return [{"params": params[:3]}, {"params": params[3:], "lr": kwargs.get("lr", 1e-3) * 3, "weight_decay": 0.3}]
    plain = cls(groups(a), **kwargs)
    swapped = so.SwapOptimizer(cls(groups(b), **kwargs), swap_times=swap_times, min_numel=0)
    for step in range(4):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
    # (after the first step; swap_times 6: a param a batch, all of them;
    # 4: one batch of the four holds both groups and walks its rows)
    assert calls["lists_over"] == (6 * 3 if swap_times == 6 else 3 * 3)
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


@pytest.mark.parametrize("name", ["Adam", "SGD"])
def test_lists_over_gives_the_merged_entries_lists(name):
    """lists_over (views and kept scalars apart) gives lists_of's lists over
    the merged entries, the same objects in the same order."""
    update = functional_updates()[getattr(torch.optim, name)]
    group = {"amsgrad": False, "momentum": 0.9}
    names = [list_name for list_name, _ in update.lists]
    views = [{n: torch.randn(3) for n in names if n != "step"} for _ in range(4)]
    scalars = [{"step": torch.tensor(float(i))} if "step" in names else {} for i in range(4)]
    merged = update.lists_of(group, [{**v, **s} for v, s in zip(views, scalars)])
    apart = update.lists_over(group, views, scalars)
    assert [[id(x) for x in lst] for lst in apart] == [[id(x) for x in lst] for lst in merged]
    with pytest.raises(functional.NotReady):
        update.lists_over(group, views[:1] + [{}] + views[2:], scalars)


@pytest.mark.parametrize("name", ["SGD", "NAdam"])
def test_a_batch_with_a_param_at_its_first_step_runs_step(name, calls):
    """A param whose grad first comes at a later step: its batch runs step()
    (creating its states), the others the functional call."""
    a, b, plain, swapped = _pair(name, swap_times=4)
    late = 2  # its own batch's neighbour: SHAPES[2] is a small param
    for step in range(5):
        give_grads(step, a, b)
        if step < 3:
            a[late].grad = b[late].grad = None
        plain.step()
        swapped.step()
    assert calls["step"] > 4 and calls["functional"] > 0
    assert all(same_bits(p, q) for p, q in zip(a, b))
    assert_same_state(plain, swapped)


class _OwnStepSGD(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):  # a subclass's step may do anything: it runs itself
        return super().step(closure)


class _WrappedStepAdam(torch.optim.Adam):
    """A step wrapped with functools.wraps (inspect.unwrap sees through it)
    that changes the grads first."""

    @functools.wraps(torch.optim.Adam.step)
    def step(self, closure=None):
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.clamp_(-0.1, 0.1)
        return super().step(closure)


class _OwnInitGroupAdam(torch.optim.Adam):
    """Adam's step, its own _init_group (which step() calls)."""

    def _init_group(self, group, params, grads, *lists):
        has_complex = super()._init_group(group, params, grads, *lists)
        grads[:] = [g.clamp(-0.1, 0.1) for g in grads]
        return has_complex


class _ExtraSettingSGD(torch.optim.SGD):
    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.defaults["trust_ratio"] = 0.5  # a setting the functional call was not written for


def test_a_subclass_or_an_unknown_setting_runs_step():
    params = [nn.Parameter(torch.randn(3))]
    assert functional_update_for(torch.optim.SGD(params, lr=0.1)) is functional_updates()[torch.optim.SGD]
    for optimizer in (_OwnStepSGD(params, lr=0.1), _WrappedStepAdam(params), _OwnInitGroupAdam(params),
                      _ExtraSettingSGD(params, lr=0.1)):
        assert functional_update_for(optimizer) is None, type(optimizer).__name__


@pytest.mark.parametrize("cls", [_WrappedStepAdam, _OwnInitGroupAdam])
def test_a_subclass_that_changes_the_step_keeps_its_results(cls, calls):
    """Adam subclasses that keep Adam's step match the Adam declaration; one
    whose step is wrapped, or whose _init_group differs, runs its own step
    at every batch, bitwise the plain subclass."""
    a, b = make_params("Adam"), make_params("Adam")
    plain, swapped = cls(a, lr=1e-2), so.SwapOptimizer(cls(b, lr=1e-2), swap_times=4, min_numel=0)
    for step in range(3):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
    assert calls["functional"] == 0
    assert all(same_bits(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("when", ["before the calls are read", "after", "after the SwapOptimizer is made"])
def test_a_step_patched_on_the_class_runs_step(monkeypatch, when, calls):
    """The class's step replaced, even by a functools.wraps wrapper (a
    profiler's, a library's patch), before or after the calls were read or
    the SwapOptimizer made: the call no longer is what that step does, so
    every batch from then on runs step(), and the patch runs."""
    patched = []
    original = torch.optim.SGD.step

    @functools.wraps(original)
    def step(self, closure=None):
        patched.append(True)
        return original(self, closure)

    def patch():
        monkeypatch.setattr(torch.optim.SGD, "step", step)

    monkeypatch.setattr(functional, "functional_updates", functools.cache(functional.functional_updates.__wrapped__))
    if when == "before the calls are read":
        patch()
    functional.functional_updates()
    a, b = make_params("SGD"), make_params("SGD")
    swapped = so.SwapOptimizer(torch.optim.SGD(b, lr=0.1, momentum=0.9), swap_times=2, min_numel=0)
    if when == "after":
        patch()
    for n in range(3):
        if n == 1 and when == "after the SwapOptimizer is made":
            patch()
        give_grads(n, a, b)
        calls["functional"] = calls["step"] = 0
        swapped.step()
    assert calls["functional"] == 0 and patched


def made_up_update(params, grads, buffers, *, lr, beta):
    for p, g in zip(params, grads):
        p.add_(g, alpha=-lr)


class _MadeUp(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1, beta=0.5):
        super().__init__(params, dict(lr=lr, beta=beta))

    def _init_group(self, group):
        return [p for p in group["params"] if p.grad is not None]

    def step(self, closure=None):
        for group in self.param_groups:
            made_up_update(group["params"], [p.grad for p in group["params"]], [], lr=group["lr"], beta=group["beta"])


class _MadeUpAgain(torch.optim.Optimizer):
    """_MadeUp with another step: the same call, other code around it."""

    def __init__(self, params, lr=0.1, beta=0.5):
        super().__init__(params, dict(lr=lr, beta=beta))

    def step(self, closure=None):
        for group in self.param_groups:
            made_up_update(group["params"], [p.grad for p in group["params"]], [], lr=2 * group["lr"],
                           beta=group["beta"])

    _init_group = _MadeUp._init_group


def test_a_call_is_made_only_for_the_code_it_was_written_against():
    """The digest covers the class's step() and _init_group source and the
    function's parameters: the same declaration for other code is not made."""
    written = code_digest(_MadeUp, made_up_update)
    matching = functional._functional(_MadeUp, "made_up_update", written, (("buffer", None),), ("lr", "beta"), ())
    assert matching is not None and matching.accepts(_MadeUp([nn.Parameter(torch.randn(2))]))
    assert functional._functional(_MadeUpAgain, "made_up_update", written, (("buffer", None),), ("lr", "beta"),
                                  ()) is None
    assert code_digest(_MadeUpAgain, made_up_update) != written
    assert functional._functional(_MadeUp, "sgd", written, (("buffer", None),), ("lr", "beta"), ()) is None


def test_a_tensor_lr_with_foreach_raises_torchs_own_error(calls):
    """Adam's _init_group refuses a tensor lr with foreach and not
    capturable; so does the functional call, in the same words."""
    a, b, plain, swapped = _pair("Adam", swap_times=2, foreach=True)
    for step in range(2):
        give_grads(step, a, b)
        swapped.step()
    swapped.param_groups[0]["lr"] = torch.tensor(1e-3)
    give_grads(2, a, b)
    with pytest.raises(RuntimeError, match="lr as a Tensor is not supported for capturable=False and foreach=True"):
        swapped.step()



def test_rows_that_keep_no_state_take_the_call_from_the_first_step(calls):
    """SGD without momentum keeps no state: no first step creates one, so
    every batch calls the function, bitwise torch's step."""
    a, b, plain, swapped = _pair("SGD", swap_times=4, momentum=0.0)
    for step in range(3):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
    assert calls["step"] == 0 and calls["functional"] >= 3  # (stateless rows: one batch, nothing staged)
    assert all(same_bits(p, q) for p, q in zip(a, b))


def test_torch_compiles_wrappers_leave_the_call_on(monkeypatch, calls):
    """torch.compile's first use wraps every torch.optim class's _init_group
    in torch._dynamo.disable (eval_frame.py's TorchPatcher), which changes
    nothing it computes: the call stays on, bitwise; a wrapper of anyone
    else's does not."""
    import torch._dynamo

    for cls in (torch.optim.Adam, torch.optim.AdamW):
        monkeypatch.setattr(cls, "_init_group", torch._dynamo.disable(cls._init_group))
    params = [nn.Parameter(torch.randn(3))]
    assert functional_update_for(torch.optim.AdamW(params)) is functional_updates()[torch.optim.Adam]
    a, b, plain, swapped = _pair("AdamW", swap_times=4)
    for step in range(3):
        give_grads(step, a, b)
        plain.step()
        swapped.step()
    assert calls["functional"] > 0
    assert all(same_bits(p, q) for p, q in zip(a, b))

    @functools.wraps(torch.optim.Adam._init_group)
    def clamped(self, group, params, grads, *lists):
        return torch.optim.Adam._init_group.__wrapped__(self, group, params, grads, *lists)

    monkeypatch.setattr(torch.optim.AdamW, "_init_group", clamped)  # (it copies the disable mark too)
    assert functional_update_for(torch.optim.AdamW(params)) is None
