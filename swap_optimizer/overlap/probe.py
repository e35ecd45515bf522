"""What the probe's record is laid on: the model's blocks (the calls a wait
may sit at), its structure (which modules and params the schedule was made
for) and the wait schedule itself."""

from __future__ import annotations

from torch import nn

from .. import torch_internals

def _is_plain_sequential(module: nn.Module, expand: bool = True) -> bool:
    """nn.Sequential or a subclass that keeps its forward: it calls its
    children in order, and a forward may iterate it without calling it.
    expand=False: tests only, the rule "sequential" knocked out."""
    return expand and isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _is_container(module: nn.Module, expand: bool = True) -> bool:
    """A module whose children are the blocks: ModuleList, ModuleDict, a plain
    nn.Sequential, or a holder whose forward is Module's own (never called)."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) or _is_plain_sequential(module, expand) or \
        type(module).forward is nn.Module.forward


def _called_blocks(module: nn.Module, expand: bool = True) -> list[nn.Module]:
    """module, or, when it is a container, the blocks below it."""
    if not _is_container(module, expand):
        return [module]
    return [block for child in module.children() for block in _called_blocks(child, expand)]


def find_blocks(model: nn.Module, expand_sequential: bool = True) -> list[nn.Module]:
    """The children of the model's outermost ModuleLists and plain
    nn.Sequentials, in order (containers among them give their blocks); else
    the model's top-level children. A block's call waits for its whole
    subtree's params (MultiheadAttention reads out_proj.weight itself).
    expand_sequential=False: tests only, the rule "sequential" knocked out."""
    expand = expand_sequential
    root = model
    while isinstance(root, nn.parallel.DistributedDataParallel):  # a wrapper of one module
        root = root.module
    blocks: list[nn.Module] = []
    if isinstance(root, nn.ModuleList) or _is_plain_sequential(root, expand):
        blocks = _called_blocks(root, expand)

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList) or _is_plain_sequential(child, expand):
                blocks.extend(block for item in child.children() for block in _called_blocks(item, expand))
            else:
                visit(child)

    if not blocks:
        visit(root)
    if not blocks:
        blocks = [block for child in root.children() for block in _called_blocks(child, expand)]
    seen, unique = set(), []
    for block in blocks:  # a block listed twice is one block
        if id(block) not in seen:
            seen.add(id(block))
            unique.append(block)
    return unique


_compiled_in_place = torch_internals.compiled_in_place
_wrapped_module = torch_internals.compiled_wrapper_inner


def check_model(model: nn.Module) -> None:
    """Refuses wrappers that read every param before any of its calls."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"SwapOptimizer(overlap_forward=True): model must be the torch.nn.Module whose forward "
                        f"uses the params, got {type(model).__name__}")
    for module in model.modules():
        if isinstance(module, nn.DataParallel):
            raise ValueError("SwapOptimizer(overlap_forward=True): nn.DataParallel copies every param to its devices "
                             "before any block runs, which would read them before their update; use "
                             "DistributedDataParallel, or overlap_forward=False")
        if type(module).__name__ == "FullyShardedDataParallel":
            raise ValueError("SwapOptimizer(overlap_forward=True) does not support FSDP (FullyShardedDataParallel "
                             "gathers params on its own stream ahead of the blocks that use them); use "
                             "overlap_forward=False with FSDP")


def _structure(model: nn.Module) -> bytes:
    """The model's modules and the params each holds directly, by identity
    (a module replaced, a weight tied or untied), and which are compiled in place."""
    return torch_internals.module_structure(model)


class _WaitSchedule:
    """Where an overlapped pass waits, from the probe: the expected sequence of
    module calls, and per call the pipeline position that must be ready."""

    def __init__(self, structure: bytes, sequence: list[nn.Module], wait_at: list[int],
                 step_position: int, compiled: bool):
        self.structure = structure  # the model as the probe saw it (its modules are held by the sequence)
        self.sequence = sequence
        self.wait_at = wait_at
        self.step_position = step_position
        self.compiled = compiled
