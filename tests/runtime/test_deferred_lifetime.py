"""A deferred step (overlap_forward=True) lives as long as it runs, whatever
becomes of the Python objects around it: an optimizer dropped after its last
step() (`del opt`, or a train() that returns only the model) still lands that
step in the model, bitwise the run without overlap; a step that fails after
its optimizer is gone says so; and the values it reads are those at step()
(a tensor lr that a scheduler fills in place right after, GradScaler's
tensors)."""

import gc
import time
import weakref

import pytest
import torch

import swap_optimizer as so
from conftest import DEVICES, TESTS
from test_overlap import build, loss_of, tokens_for
from test_overlap_rules import OPTIMIZERS
from optimizer_cases import Lion

FAMILIES = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),  # the packed fused kernel
    **OPTIMIZERS,                                                            # torch's own update on staged views
    "Lion": lambda ps: Lion(ps),                                             # vouched for (deferred once learned)
}
STEPS = 4  # the first is the probe, the rest run beside the next forward


def train(device, name, overlap, steps=STEPS, keep=None):
    """Trains and returns only the model: the optimizer goes when this returns
    (`keep` holds a weak reference to it), its last step possibly still running."""
    model = build(device)
    extra = dict(model=model, overlap_forward=True) if overlap else {}
    trust = dict(trust_per_param_step=True) if name == "Lion" else {}
    optimizer = so.SwapOptimizer(FAMILIES[name](model.parameters()), swap_times=6, num_arenas=3, min_numel=0,
                                 **trust, **extra)
    if overlap:  # every update lags far behind: the last step is surely running when the optimizer goes
        optimizer._set_test_hooks(copy_delay_us=2000, compute_delay_us=2000, seed=7)
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(model, tokens_for(step, device)).backward()
        optimizer.step()
    if keep is not None:
        keep.append(weakref.ref(optimizer))
    return model


def params_of(model):
    return [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_dropped_optimizer_still_lands_its_last_step(name, device):
    device = torch.device(device)
    expected = params_of(train(device, name, overlap=False))
    dropped = []
    model = train(device, name, overlap=True, keep=dropped)
    assert dropped[0]() is None, "the optimizer outlived train(): nothing was dropped"
    got = params_of(model)  # no hook is left to wait here
    for index, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{name}: param {index} differs ({(a != b).sum().item()} elements)"


@pytest.mark.parametrize("name", ["Lion", "NAdam"])
def test_hooks_added_and_removed_while_a_deferred_step_runs_do_not_fail_it(name):
    """A vouched-for step checks that it changed no attribute of the optimizer
    outside its states and groups; hooks registered or removed meanwhile on
    another thread (SwapOptimizer takes its own guard off the wrapped
    optimizer when it is dropped, the step still running) are not the step's
    doing: the step lands, bitwise the run without overlap."""
    device = torch.device("cpu")
    expected = params_of(train(device, name, overlap=False, steps=STEPS + 1))
    model = build(device)
    trust = dict(trust_per_param_step=True) if name == "Lion" else {}
    inner = FAMILIES[name](model.parameters())
    optimizer = so.SwapOptimizer(inner, swap_times=6, num_arenas=3, min_numel=0, model=model, overlap_forward=True,
                                 **trust)
    optimizer._set_test_hooks(copy_delay_us=2000, compute_delay_us=2000, seed=7)
    for step in range(STEPS + 1):
        optimizer.zero_grad()
        loss_of(model, tokens_for(step, device)).backward()
        optimizer.step()
        deadline = time.monotonic() + 0.03  # while the deferred step's batches run on the update thread
        while time.monotonic() < deadline:
            inner.register_step_pre_hook(lambda *args: None).remove()
            inner.register_load_state_dict_post_hook(lambda *args: None).remove()
        optimizer.wait()
    assert optimizer._overlap._last_step_deferred
    for index, (a, b) in enumerate(zip(expected, params_of(model))):
        assert torch.equal(a, b), f"{name}: param {index} differs"


@pytest.mark.parametrize("device", DEVICES)
def test_deleting_the_optimizer_and_the_model_keeps_the_update(device):
    device = torch.device(device)
    expected = params_of(train(device, "NAdam", overlap=False))
    model = build(device)
    params = list(model.parameters())
    optimizer = so.SwapOptimizer(FAMILIES["NAdam"](params), swap_times=6, num_arenas=3, min_numel=0, model=model,
                                 overlap_forward=True)
    optimizer._set_test_hooks(copy_delay_us=2000, compute_delay_us=2000, seed=7)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, tokens_for(step, device)).backward()
        optimizer.step()
    del model, optimizer  # only the params are left
    gc.collect()
    for index, (a, p) in enumerate(zip(expected, params)):
        assert torch.equal(a, p.detach().cpu()), f"param {index} differs"


@pytest.mark.parametrize("name", ["AdamW", "NAdam"])
def test_a_dropped_optimizer_whose_last_step_fails_warns(name):
    device = torch.device("cpu")
    model = build(device)
    optimizer = so.SwapOptimizer(FAMILIES[name](model.parameters()), swap_times=6, num_arenas=3, min_numel=0,
                                 model=model, overlap_forward=True)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, tokens_for(step, device)).backward()
        if step == STEPS - 1:  # the last, deferred step fails at its third batch, after step() returned
            optimizer._set_test_hooks(compute_delay_us=2000, seed=7, fault="update", fault_batch=2)
        optimizer.step()
    assert optimizer._overlap.pending
    with pytest.warns(RuntimeWarning, match=r"dropped \(or the interpreter exited\) while its last step was still "
                                            r"running, and that step failed"):
        del optimizer
        gc.collect()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", ["foreach", "fused", "for-loop"])
def test_a_tensor_lr_filled_by_the_scheduler_after_step_does_not_reach_the_deferred_step(implementation, device):
    """LRScheduler writes a tensor lr in place (fill_) right after step()
    returns; the deferred step reads the lr of its step()."""
    device = torch.device(device)
    flags = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for-loop": dict(foreach=False)}[implementation]

    def run(overlap):
        model = build(device)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        inner = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, **flags)
        optimizer = so.SwapOptimizer(inner, swap_times=6, num_arenas=3, min_numel=0, **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=2000, compute_delay_us=2000, seed=7)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5 ** epoch)
        losses = []
        for step in range(5):
            optimizer.zero_grad()
            loss = loss_of(model, tokens_for(step, device))
            loss.backward()
            losses.append(loss.detach())
            optimizer.step()
            scheduler.step()
        optimizer.wait()
        return losses, params_of(model)

    (losses_off, params_off), (losses_on, params_on) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(losses_off, losses_on))
    for index, (a, b) in enumerate(zip(params_off, params_on)):
        assert torch.equal(a, b), f"param {index} differs"


def test_a_deferred_step_reads_every_group_value_as_it_was_at_step():
    """Tensor values and containers alike: NAdam's tensor lr and a list value
    changed in place after step() reach no batch of that step."""
    device = torch.device("cpu")

    def run(overlap, tamper):
        model = build(device)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        inner = torch.optim.NAdam(model.parameters(), lr=torch.tensor(3e-3), betas=[0.9, 0.99])
        optimizer = so.SwapOptimizer(inner, swap_times=6, num_arenas=3, min_numel=0, **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=2000, compute_delay_us=2000, seed=7)
        for step in range(STEPS):
            optimizer.zero_grad()
            loss_of(model, tokens_for(step, device)).backward()
            optimizer.step()
            if tamper:  # as a scheduler would, after step() returned; undone before the next step()
                group = optimizer.param_groups[0]
                lr = group["lr"].clone()
                group["lr"].fill_(1.0)
                group["betas"][0] = 0.0
                optimizer.wait() if overlap else None
                group["lr"].copy_(lr)
                group["betas"][0] = 0.9
        optimizer.wait()
        return params_of(model)

    expected = run(False, tamper=False)
    got = run(True, tamper=True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_tensors_are_the_step_s_own_on_the_torch_update_path(device):
    """unscale_in_step hands torch's fused SGD GradScaler's grad_scale and
    found_inf; the deferred step keeps copies, so a scaler that rewrote its
    tensors in place right after step() changes nothing."""
    device = torch.device(device)

    def run(overlap):
        model = build(device)
        extra = dict(model=model, overlap_forward=True) if overlap else {}
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
        optimizer = so.SwapOptimizer(inner, swap_times=6, num_arenas=3, min_numel=0, unscale_in_step=True, **extra)
        if overlap:
            optimizer._set_test_hooks(copy_delay_us=2000, compute_delay_us=2000, seed=7)
        scale = torch.full((), 2.0 ** 10, device=device)
        found_inf = torch.zeros((), device=device)
        for step in range(STEPS):
            optimizer.zero_grad()
            (loss_of(model, tokens_for(step, device)) * scale).backward()
            optimizer.grad_scale, optimizer.found_inf = scale, found_inf
            optimizer.step()
            del optimizer.grad_scale, optimizer.found_inf
            scale.mul_(2.0)           # in place, as a scaler could: the pending step keeps its own copy
            found_inf.fill_(1.0)
            optimizer.wait() if overlap else None
            found_inf.fill_(0.0)
        optimizer.wait()
        return params_of(model)

    expected, got = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


COLLECTED_ON_THE_UPDATE_THREAD = r"""
import atexit, gc, sys, threading, time
import torch

def check_landed():
    with torch._C.DisableTorchFunction():  # reads what memory holds now: no watch waits for the step here
        got = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(expected, got)), "params differ"
    assert not overlap._Watch.overlaps or sys.argv[2].startswith("exit"), "the orphaned pass did not unregister"
    print("ok", flush=True)

exiting = threading.Event()
if sys.argv[2].startswith("exit"):
    atexit.register(check_landed)  # registered before swap_optimizer's own exit hook: runs after it

sys.path.insert(0, sys.argv[1])
import conftest  # noqa: F401  (puts the tests' folders on sys.path)
import swap_optimizer as so
from swap_optimizer.overlap import hooks as overlap
from swap_optimizer.rules import torch_update
from test_overlap import build, loss_of, tokens_for

cpu = torch.device("cpu")

def train(overlapped, steps):
    model = build(cpu)
    extra = dict(model=model, overlap_forward=True) if overlapped else {}
    optimizer = so.SwapOptimizer(torch.optim.NAdam(model.parameters(), lr=3e-3), swap_times=6, num_arenas=3,
                                 min_numel=0, **extra)
    optimizer.cycle = optimizer  # only the garbage collector frees it
    for step in range(steps):
        optimizer.zero_grad()
        loss_of(model, tokens_for(step, cpu)).backward()
        optimizer.step()
    return model, optimizer

model, plain = train(False, 5)
plain.wait()
expected = [p.detach().clone() for p in model.parameters()]
gc.disable()  # collections only where the test runs them
dropped, collected, collected_event = threading.Event(), [], threading.Event()
update = torch_update._BatchRule.__call__

def collect_once_on_the_update_thread(self, *args):
    if threading.current_thread() is not threading.main_thread() and not collected:
        assert dropped.wait(timeout=60), "the main thread did not drop the optimizer"
        collected.append(gc.collect())  # the optimizer and its finalizer go here, on the update thread
        collected_event.set()
        if sys.argv[2].startswith("exit"):  # the rest of the step runs while the interpreter exits
            assert exiting.wait(timeout=60), "the main thread did not exit"
            time.sleep(0.2)
    return update(self, *args)

model, optimizer = train(True, 4)
optimizer.wait()  # the next step is the one whose update collects its optimizer
optimizer._set_test_hooks(compute_delay_us=30000, seed=1)  # its batches end long after the collection
torch_update._BatchRule.__call__ = collect_once_on_the_update_thread
optimizer.zero_grad()
loss_of(model, tokens_for(4, cpu)).backward()
optimizer.step()  # deferred: its first batch waits until the optimizer is dropped, then collects it
assert optimizer._overlap._last_step_deferred
del optimizer
dropped.set()
assert collected_event.wait(timeout=60), "nothing was collected on the update thread"
assert collected[0] > 0, "nothing was collected on the update thread"

if sys.argv[2].startswith("exit"):  # the interpreter exits with the step still running: it lands first, cleanly
    if sys.argv[2] == "exit-interrupted":  # a Ctrl-C while the exit waits for the step skips no wait
        import os, signal

        def interrupt_soon():  # torch's plain Ctrl-C handler (the wrapped one would wait for the step itself)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        atexit.register(interrupt_soon)
    atexit.register(exiting.set)  # the first exit hook to run
    sys.exit(0)
if sys.argv[2] == "next-forward":
    loss_of(model, tokens_for(5, cpu))  # the optimizer is gone, the step still running: its calls wait
else:  # the model is not called again: the orphaned pass lets its runtime go once the step is done
    orphan, = overlap._Watch.overlaps
    deadline = time.monotonic() + 60
    while orphan._pending_runtime is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert orphan._pending_runtime is None and not orphan.pending, "the orphaned pass still holds its runtime"
    torch.nn.Linear(2, 2)(torch.randn(1, 2))  # the stepping thread's next module call lets the pass go
check_landed()
"""


@pytest.mark.parametrize("then", ["next-forward", "no-forward", "exit", "exit-interrupted"])
def test_an_optimizer_collected_on_its_update_thread_still_lands_its_step(then):
    """A garbage collection inside a deferred step's update (host backend: the
    update thread runs torch's update in Python) may collect that optimizer:
    nothing waits for itself there (that would hang), the pass goes on
    orphaned, and the next forward still waits for the step; without one, a
    thread of its own waits for the step and lets the runtime go; and an
    interpreter that exits meanwhile waits for both before it finalizes (a
    thread that takes the GIL after that is ended mid-destructor: "terminate
    called without an active exception")."""
    import subprocess
    import sys

    # -P and the tests' folder as the working directory: the installed package, never the source folder.
    result = subprocess.run([sys.executable, "-P", "-c", COLLECTED_ON_THE_UPDATE_THREAD, TESTS, then],
                            capture_output=True, text=True, timeout=300, cwd=TESTS)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
    if then == "exit-interrupted":  # raised once every wait was done
        assert "KeyboardInterrupt" in result.stderr, result.stderr


EXIT_WITH_A_STEP_PENDING = r"""
import atexit, sys
import torch

def check_landed():
    with torch._C.DisableTorchFunction():  # reads what memory holds now: no watch waits for the step here
        got = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(expected, got)), "params differ"
    print("ok", flush=True)

atexit.register(check_landed)  # registered before swap_optimizer's exit hooks: runs after them
sys.path.insert(0, sys.argv[1])
import conftest  # noqa: F401  (puts the tests' folders on sys.path)
import swap_optimizer as so
from test_overlap import build, loss_of, tokens_for

cpu = torch.device("cpu")

def train(overlapped):
    model = build(cpu)
    extra = dict(model=model, overlap_forward=True) if overlapped else {}
    optimizer = so.SwapOptimizer(torch.optim.NAdam(model.parameters(), lr=3e-3), swap_times=6, num_arenas=3,
                                 min_numel=0, **extra)
    for step in range(4):
        if step == 3 and overlapped:  # the last step's batches end long after the script does
            optimizer._set_test_hooks(compute_delay_us=50000, seed=1)
        optimizer.zero_grad()
        loss_of(model, tokens_for(step, cpu)).backward()
        optimizer.step()
    return model, optimizer

model, plain = train(False)
plain.wait()
expected = [p.detach().clone() for p in model.parameters()]
model, optimizer = train(True)
assert optimizer._overlap._last_step_deferred
"""


def test_an_interpreter_that_exits_with_a_step_pending_lands_it_first():
    """A script whose last line is step() (overlap_forward=True: the step runs
    on): the exit waits for it, so a save in an exit hook sees it, and nothing
    takes the GIL from a finalizing interpreter."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-P", "-c", EXIT_WITH_A_STEP_PENDING, TESTS],
                            capture_output=True, text=True, timeout=300, cwd=TESTS)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
