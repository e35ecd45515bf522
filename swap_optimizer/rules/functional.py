"""torch's functional updates (torch.optim.sgd.sgd, adam.adam, ...), called
with a batch's lists ready, instead of the class's step() on a stand-in.

Each torch.optim class's step() is the same two moves per param group: its
_init_group walks the params in Python (creating states at a first step,
collecting grads and states into lists), then one call of the functional
update with those lists and the group's values. After a param's first step
the walk only collects: the lists are the batch's rows and their staged
views, which _update_batch has already. Calling the functional update with
them skips a stand-in optimizer, step()'s wrappers and the walk, about 30 us
of Python a batch: on a GPU, where a batch's update takes microseconds, that
is what bounds the step.

The call is the one step() makes, argument for argument, so the results stay
torch's bit for bit (the parity tests of every implementation run this path
after the first step). It is only taken where that is proven:
- the source of the class's step() (each layer of it: torch's grad-mode
  wrapper and the step, so a step wrapped by anyone else differs) and
  _init_group, and the names and kinds of the function's parameters, are
  those this call was written against (a digest of them, the same on torch
  2.13 and 2.14; a torch whose code differs runs step(), exact and slower);
- the optimizer's step and _init_group are the class's own, the very
  objects read, checked at every step (a subclass that overrides either, a
  step patched or wrapped before or after, run step()), and the function is
  the one that step names;
- the optimizer's settings (its defaults) are all ones the call passes or
  step() reads only to create states: a setting a subclass adds runs step();
- every row has its states (a first step creates them: step() runs it).
  _init_group's one check of a group value (Adam's tensor lr with foreach)
  is made by the function too.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

# A list a functional update takes: (the state each row holds in it; when the
# list is filled, from the group's values (None: always); otherwise step()
# hands an empty list).
ListSpec = tuple[str, Optional[Callable[[dict], bool]]]
# A value it takes from the group: a key, or (keyword, key, index) for a pair
# step() unpacks (betas into beta1 and beta2).
OptionSpec = Any

class NotReady(Exception):
    """This batch cannot take the functional call: step() runs it instead
    (nothing has been written)."""


# The wrappers torch itself puts around a class's step and _init_group, which
# change nothing they compute: torch.optim's profiling wrapper (its first
# instance wraps the class's step: Optimizer.profile_hook_step, marked
# `hooked`) and torch._dynamo's `disable` (its first torch.compile wraps every
# torch.optim class's _init_group). Each is known by its code, since
# functools.wraps copies their marks onto any wrapper of them.
_PROFILING_WRAPPER_CODE = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__
_DYNAMO_EVAL_FRAME = os.path.join("torch", "_dynamo", "eval_frame.py")


def _without_torch_wrappers(function: Optional[Callable]) -> Optional[Callable]:
    while hasattr(function, "__wrapped__"):
        code = getattr(function, "__code__", None)
        dynamo_disable = getattr(function, "_torchdynamo_disable", False) and code is not None and \
            code.co_filename.endswith(_DYNAMO_EVAL_FRAME)
        if code is not _PROFILING_WRAPPER_CODE and not dynamo_disable:
            break
        function = function.__wrapped__
    return function


def class_step(cls: type) -> Callable:
    """The step a class's instances run, without torch's own wrappers."""
    return _without_torch_wrappers(cls.step)


def _class_init_group(cls: type) -> Optional[Callable]:
    return _without_torch_wrappers(getattr(cls, "_init_group", None))


def _wrapped_layers(function: Callable) -> list[Callable]:
    """`function` and every function it wraps (functools.wraps' __wrapped__), outermost first."""
    layers = [function]
    while hasattr(layers[-1], "__wrapped__") and len(layers) < 16:
        layers.append(layers[-1].__wrapped__)
    return layers


def code_digest(owner: type, function: Callable) -> Optional[str]:
    """A digest of what the call depends on: the source of `owner`'s step()
    (each layer a wrapper adds, torch's own grad-mode wrapper included, so a
    step wrapped by anyone else differs) and _init_group, and the names and
    kinds of `function`'s parameters (None: no source to read)."""
    try:
        parameters = ",".join(f"{p.name}:{p.kind.name}" for p in inspect.signature(function).parameters.values())
        text = "".join(inspect.getsource(layer) for layer in _wrapped_layers(class_step(owner))) + \
            inspect.getsource(_class_init_group(owner)) + parameters
    except (OSError, TypeError, ValueError, KeyError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FunctionalUpdate:
    step: Callable                   # the owner's step, as its instances run it (the very object)
    init_group: Callable             # the owner's _init_group (the very object)
    function: Callable               # torch's functional update
    lists: tuple[ListSpec, ...]      # the state lists, in the call's order
    options: dict[str, tuple[str, Optional[int]]]  # keyword -> (group key, index in a pair or None)
    extras: frozenset                # has_complex, has_sparse_grad, grad_scale and found_inf: which it passes
    init_only: frozenset             # settings step() reads only to create a param's states

    def accepts(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer`'s step() makes this call with these settings."""
        cls = type(optimizer)
        read = {key for key, _ in self.options.values()}
        # (differentiable: step()'s grad mode; SwapOptimizer refuses differentiable=True)
        return (class_step(cls) is self.step and _class_init_group(cls) is self.init_group
                and set(optimizer.defaults) <= read | self.init_only | {"differentiable"}
                and read <= set(optimizer.defaults))

    def keywords(self, group: dict) -> dict:
        """The group's values as the call takes them (once per step and group)."""
        return {keyword: group[key] if index is None else group[key][index]
                for keyword, (key, index) in self.options.items()}

    def lists_of(self, group: dict, entries: list) -> list[list]:
        """The call's state lists over `entries` (per row, its states by name).
        Raises NotReady where a row lacks a state the call reads."""
        try:
            return [[entry[name] for entry in entries] if when is None or when(group) else []
                    for name, when in self.lists]
        except KeyError:
            raise NotReady from None

    def lists_over(self, group: dict, views: list, scalars: list) -> list[list]:
        """lists_of over rows whose staged views and kept scalars come apart
        (per row, a dict of each): a state among row 0's scalars is taken from
        the scalars, as a merged entry would give it. Raises NotReady where a
        row lacks a state the call reads."""
        try:
            return [[] if when is not None and not when(group) else
                    [row[name] for row in (scalars if name in scalars[0] else views)]
                    for name, when in self.lists]
        except KeyError:
            raise NotReady from None

    def __call__(self, keywords: dict, params: list, grads: list, lists: list[list], amp: dict) -> None:
        extras = {}
        if "has_complex" in self.extras:
            extras["has_complex"] = any(map(torch.is_complex, params))
        if "has_sparse_grad" in self.extras:
            extras["has_sparse_grad"] = False  # SwapOptimizer refuses sparse grads
        if "grad_scale" in self.extras:
            extras["grad_scale"], extras["found_inf"] = amp.get("grad_scale"), amp.get("found_inf")
        self.function(params, grads, *lists, **keywords, **extras)


def _functional(owner: type, name: str, digest: str, lists: tuple[ListSpec, ...], options: tuple[OptionSpec, ...],
                extras: tuple[str, ...], init_only: tuple[str, ...] = ()) -> Optional[FunctionalUpdate]:
    """The FunctionalUpdate of `owner` calling its module's `name`, or None
    where this torch's code is not the code it was written against (`digest`)."""
    step = class_step(owner)
    function = inspect.unwrap(step).__globals__.get(name)
    if function is None or code_digest(owner, function) != digest:
        return None
    keywords = {}
    for option in options:
        keyword, key, index = (option, option, None) if isinstance(option, str) else option
        keywords[keyword] = (key, index)
    return FunctionalUpdate(step, _class_init_group(owner), function, lists, keywords, frozenset(extras),
                            frozenset(init_only))


_BETAS = (("beta1", "betas", 0), ("beta2", "betas", 1))
_AMP = ("grad_scale", "found_inf")


@functools.cache
def functional_updates() -> dict[type, Optional[FunctionalUpdate]]:
    """Per class: its step()'s call, as torch 2.13 and 2.14 write it (the
    digests: code_digest of that code), None where this torch's differs.
    Made at the first use: reading the sources takes tens of milliseconds."""
    return {
        torch.optim.SGD: _functional(
            torch.optim.SGD, "sgd", "f471702c8b63d469",
            (("momentum_buffer", lambda group: group["momentum"] != 0),),
            ("weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize", "foreach", "fused"),
            ("has_sparse_grad", *_AMP)),
        torch.optim.Adam: _functional(
            torch.optim.Adam, "adam", "95b4a47942cb8f59",
            (("exp_avg", None), ("exp_avg_sq", None), ("max_exp_avg_sq", lambda group: group["amsgrad"]),
             ("step", None)),
            ("amsgrad", "lr", "weight_decay", "eps", "maximize", "foreach", "capturable", "differentiable", "fused",
             "decoupled_weight_decay", *_BETAS), ("has_complex", *_AMP)),
        torch.optim.NAdam: _functional(
            torch.optim.NAdam, "nadam", "d01cbcd7002492c8",
            (("exp_avg", None), ("exp_avg_sq", None), ("mu_product", None), ("step", None)),
            ("lr", "weight_decay", "momentum_decay", "eps", "maximize", "decoupled_weight_decay", "foreach",
             "capturable", "differentiable", *_BETAS), ("has_complex",)),
        torch.optim.RAdam: _functional(
            torch.optim.RAdam, "radam", "49be998007555c09", (("exp_avg", None), ("exp_avg_sq", None), ("step", None)),
            ("lr", "weight_decay", "eps", "maximize", "foreach", "capturable", "differentiable",
             "decoupled_weight_decay", *_BETAS), ("has_complex",)),
        torch.optim.Adamax: _functional(
            torch.optim.Adamax, "adamax", "96d3082b7e3d1c7c", (("exp_avg", None), ("exp_inf", None), ("step", None)),
            ("eps", "lr", "weight_decay", "foreach", "maximize", "differentiable", "capturable", *_BETAS),
            ("has_complex",)),
        torch.optim.Adagrad: _functional(
            torch.optim.Adagrad, "adagrad", "5d93ce7fd86038dc", (("sum", None), ("step", None)),
            ("lr", "weight_decay", "lr_decay", "eps", "foreach", "maximize", "differentiable", "fused"),
            ("has_sparse_grad", "has_complex", *_AMP), init_only=("initial_accumulator_value",)),
        torch.optim.RMSprop: _functional(
            torch.optim.RMSprop, "rmsprop", "510c276ecd22c176",
            (("square_avg", None), ("grad_avg", lambda group: group["centered"]),
             ("momentum_buffer", lambda group: group["momentum"] > 0), ("step", None)),
            ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "foreach", "maximize", "differentiable",
             "capturable"), ("has_complex",)),
        torch.optim.Adadelta: _functional(
            torch.optim.Adadelta, "adadelta", "460312a9e0178294",
            (("square_avg", None), ("acc_delta", None), ("step", None)),
            ("lr", "rho", "eps", "weight_decay", "foreach", "maximize", "differentiable", "capturable"),
            ("has_complex",)),
        torch.optim.ASGD: _functional(
            torch.optim.ASGD, "asgd", "5fefdbfd6f775e4e", (("ax", None), ("mu", None), ("eta", None), ("step", None)),
            ("lambd", "lr", "t0", "alpha", "weight_decay", "foreach", "maximize", "differentiable", "capturable"),
            ("has_complex",)),
        torch.optim.Rprop: _functional(
            torch.optim.Rprop, "rprop", "b55e945686bbe6db", (("prev", None), ("step_size", None), ("step", None)),
            (("step_size_min", "step_sizes", 0), ("step_size_max", "step_sizes", 1), ("etaminus", "etas", 0),
             ("etaplus", "etas", 1), "foreach", "maximize", "differentiable", "capturable"),
            ("has_complex",), init_only=("lr",)),
    }


def functional_update_for(optimizer: torch.optim.Optimizer) -> Optional[FunctionalUpdate]:
    """The functional call `optimizer`'s step() makes, where it is known to
    be exactly that (see the module's doc); None: its step() runs."""
    for update in functional_updates().values():
        if update is not None and update.accepts(optimizer):
            return update
    return None
