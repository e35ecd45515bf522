"""Optimizers from packages the developers did not pick, wrapped with
trust_per_param_step=True (and trust_elementwise_step=True): each one either
runs bitwise like the plain optimizer or is refused with SwapOptimizer's
error. Never a silent difference. Slow tier: it needs timm and
pytorch_optimizer, which .ci/run installs, pinned, for it. Users get the
newest releases: before each release, run it by hand against those too
(docs/integrations.md has the command and the versions tried)."""

import random

import pytest
import torch
from torch import nn

import swap_optimizer as so
from pairs import give_grads, same_bits

pytestmark = pytest.mark.slow

SHAPES = [(64, 120), (9000,), (32, 50), (5,)]  # the 9000 is cut at swap_times=16
STEPS = 6

TIMM = ["AdaBelief", "Adahessian", "AdamP", "Adan", "Adopt", "LaProp", "Lamb", "Lars", "Lion", "MADGRAD", "Mars",
        "Muon", "NAdamW", "NvNovoGrad", "RMSpropTF", "SGDP", "SGDW", "AdafactorBigVision", "NAdamLegacy",
        "RAdamLegacy", "AdamWLegacy"]
# Optimizers that must come out bitwise (so that refusing everything fails
# this test): elementwise ones whole and cut, per-param ones whole.
ELEMENTWISE = {"timm.AdaBelief", "timm.Adan", "timm.Adopt", "timm.LaProp", "timm.Lion", "timm.MADGRAD",
               "timm.NAdamW", "po.lion", "po.adopt", "po.ademamix", "po.adan", "po.adabelief"}
PER_PARAM = ELEMENTWISE | {"timm.SGDP", "timm.AdamP", "timm.Mars", "timm.NvNovoGrad", "po.lamb", "po.lars"}


# Too slow for CI on the CPU, not refused: skipped by name.
TOO_SLOW = {"po.shampoo": "a 9000 x 9000 preconditioner root for the 1-D param takes minutes on the CPU"}


def pytorch_optimizer_names():
    try:
        import pytorch_optimizer
    except ImportError:
        return []
    return sorted(pytorch_optimizer.get_supported_optimizers())


def make_class(name):
    package, _, short = name.partition(".")
    if package == "timm":
        return getattr(pytest.importorskip("timm.optim"), short)
    return pytest.importorskip("pytorch_optimizer").load_optimizer(short)


def make_params():
    generator = torch.Generator().manual_seed(1)
    return [nn.Parameter(torch.randn(*s, generator=generator)) for s in SHAPES]


def seed_global_generators(seed=0):
    """The same global random state for the plain run and the wrapped one: an
    optimizer may draw from it (pytorch_optimizer's Alice draws torch.randperm
    each step), and then only equal draws compare equal."""
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def run(cls, swapped_settings=None):
    """The params after STEPS steps, and the states as the optimizer's state
    dict holds them (tensors and numbers, by param index), from the same
    global random state each time."""
    seed_global_generators()
    params = make_params()
    optimizer = cls(params, lr=1e-3)
    if swapped_settings is not None:
        optimizer = so.SwapOptimizer(optimizer, min_numel=0, trust_per_param_step=True, **swapped_settings)
    for step in range(STEPS):
        give_grads(step, params)
        optimizer.step()
    return params, optimizer.state_dict().get("state")  # None: a format of its own (a wrapper's, as Magma's)


def same_states(a, b):
    """Equal states, bitwise; an empty entry (a plain optimizer's defaultdict
    makes one for a param it only looked at) counts as none."""
    a, b = ({index: entry for index, entry in s.items() if entry} for s in (a, b))
    if a.keys() != b.keys():
        return False
    for index, entry in a.items():
        if entry.keys() != b[index].keys():
            return False
        for key, value in entry.items():
            other = b[index][key]
            if torch.is_tensor(value) != torch.is_tensor(other):
                return False
            if torch.is_tensor(value) and not same_bits(value.cpu(), other.cpu()):
                return False
            if not torch.is_tensor(value) and not (value == other or value != value and other != other):
                return False
    return True


@pytest.mark.parametrize("name", [f"timm.{n}" for n in TIMM] + [f"po.{n}" for n in pytorch_optimizer_names()])
def test_bitwise_or_refused(name):
    if name in TOO_SLOW:
        pytest.skip(TOO_SLOW[name])
    cls = make_class(name)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Adam):
        pytest.skip("Adam/AdamW: SwapOptimizer's own fused path (tests/kernels/test_fused_adam_op.py)")
    try:
        reference, reference_state = run(cls)
    except Exception as error:  # noqa: BLE001  (needs a closure, a model, extra arguments: not a case here)
        pytest.skip(f"the plain optimizer does not run on bare params here: {type(error).__name__}")
    for settings in (dict(swap_times=4), dict(swap_times=16, trust_elementwise_step=True)):
        try:
            params, state = run(cls, settings)
        except (RuntimeError, TypeError, ValueError) as error:
            assert str(error).startswith("SwapOptimizer"), f"{name} {settings}: {error}"
            assert name not in (ELEMENTWISE if "trust_elementwise_step" in settings else PER_PARAM), \
                f"{name} {settings}: {error}"
            continue
        assert all(same_bits(p, q) for p, q in zip(params, reference)), f"{name} {settings}: params differ"
        if reference_state is not None:
            assert same_states(state, reference_state), f"{name} {settings}: states differ"
