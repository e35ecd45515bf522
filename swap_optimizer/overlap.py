"""Overlapping a deferred step with the next forward: which params each of the
model's blocks needs, and the hooks that wait for them.

A deferred step's updates do not bump a param's version counter, so a read
that does not wait would be silent. These rules are the whole safety story
(docs/design.md, "Overlap with the forward"):

- Blocks are the children of the model's ModuleLists (the outermost ones), or
  the model's top-level children when it has none. A block's forward pre-hook
  waits for every batch that holds a param of its whole subtree, so a param a
  block uses directly (MultiheadAttention's out_proj.weight, the
  TransformerEncoderLayer fast path that skips child hooks) is covered.
- A pre-hook on the model itself waits for the params outside every block
  (embeddings, a head whose weight a fused loss reads) before anything runs.
- A compiled model (torch.compile, or any module of it compiled) gets one
  whole-step wait at its entry: hooks inside a compiled region may be
  skipped, so none are relied on there.
- Everything else that reads or writes params or grads outside the forward
  waits through SwapOptimizer: wait(), state, state_dict(), load_state_dict(),
  add_param_group(), the model's state_dict() and load_state_dict(), the next
  step() (after its closure), zero_grad(set_to_none=False).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn


def _is_compiled(module: nn.Module) -> bool:
    """torch.compile(module) (an OptimizedModule) or module.compile()."""
    optimized = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(optimized, "OptimizedModule", None)
    return (optimized is not None and isinstance(module, optimized)) or \
        getattr(module, "_compiled_call_impl", None) is not None


def has_compiled_part(model: nn.Module) -> bool:
    """The model or any module in it is compiled (per-block compile too)."""
    return any(_is_compiled(m) for m in model.modules())


def _is_container(module: nn.Module) -> bool:
    """A module that is never called itself (its forward is Module's own), so
    hooks on it never run: ModuleList, ModuleDict, a plain holder."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) or type(module).forward is nn.Module.forward


def _called_blocks(module: nn.Module) -> list[nn.Module]:
    """module, or, when it is a container, the called modules below it."""
    if not _is_container(module):
        return [module]
    return [block for child in module.children() for block in _called_blocks(child)]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the model's outermost ModuleLists, in order (a child
    that is itself a container, such as the inner list of
    ModuleList([ModuleList([attn, ff]), ...]), gives its called modules);
    else the model's top-level children."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(block for item in child.children() for block in _called_blocks(item))
            else:
                visit(child)

    visit(model)
    if not blocks:
        root = model
        while isinstance(root, nn.parallel.DistributedDataParallel):  # a wrapper of one module
            root = root.module
        blocks = [block for child in root.children() for block in _called_blocks(child)]
    seen, unique = set(), []
    for block in blocks:  # a block listed in two ModuleLists waits once
        if id(block) not in seen:
            seen.add(id(block))
            unique.append(block)
    return unique


def check_model(model: nn.Module) -> None:
    """Refuses wrappers that read every param before any block's hook runs."""
    for module in model.modules():
        if isinstance(module, nn.DataParallel):
            raise ValueError("SwapOptimizer(overlap_forward=True): nn.DataParallel copies every param to its devices "
                             "before any block runs, which would read them before their update; use "
                             "DistributedDataParallel, or overlap_forward=False")
        if type(module).__name__ == "FullyShardedDataParallel":
            raise ValueError("SwapOptimizer(overlap_forward=True) does not support FSDP (FullyShardedDataParallel "
                             "gathers params on its own stream ahead of the blocks that use them); use "
                             "overlap_forward=False with FSDP")


class ForwardOverlap:
    """The hooks that make `model`'s forward wait for a SwapOptimizer's
    deferred step, block by block, and the positions they wait for."""

    def __init__(self, optimizer, model: nn.Module, params: list[torch.Tensor]):
        if not isinstance(model, nn.Module):
            raise TypeError(f"SwapOptimizer(overlap_forward=True): model must be the torch.nn.Module whose forward "
                            f"uses the params, got {type(model).__name__}")
        check_model(model)
        self.compiled = has_compiled_part(model)
        self.blocks = [] if self.compiled else find_blocks(model)
        self._ranks_by_id = {}
        for rank, block in enumerate(self.blocks):
            for p in block.parameters():
                self._ranks_by_id.setdefault(id(p), rank)  # a param shared by blocks: the first needs it
        self._in_model = {id(p) for p in model.parameters()}
        self._check_in_model(params)
        self._block_params = [{id(p) for p in block.parameters()} for block in self.blocks]
        self.positions: list[int] = []  # per block: the last pipeline position it needs (-1: none)
        self.entry_position = -1        # the model's own: params outside every block
        itself = weakref.ref(optimizer)  # hooks must not keep the optimizer (and its store) alive
        # Hooks may run inside a compiled region (a model compiled after this):
        # torch.compiler.disable makes each a graph break that runs eagerly.

        @torch.compiler.disable
        def wait_at_entry(module, args):
            owner = itself()
            if owner is not None:
                owner._wait_for_forward(None)

        def make_block_hook(index: int):
            @torch.compiler.disable
            def wait_for_block(module, args):
                owner = itself()
                if owner is not None:
                    owner._wait_for_forward(index)
            return wait_for_block

        @torch.compiler.disable
        def wait_before_state_dict(module, prefix, keep_vars):
            owner = itself()
            if owner is not None:
                owner.wait()

        # Prepended: pre-hooks already there (pruning, weight_norm, a user's)
        # may read the params.
        self._handles = [model.register_forward_pre_hook(wait_at_entry, prepend=True)]
        self._handles += [block.register_forward_pre_hook(make_block_hook(i), prepend=True)
                          for i, block in enumerate(self.blocks)]
        @torch.compiler.disable
        def wait_before_load(module, *args):
            owner = itself()
            if owner is not None:
                owner.wait()

        # On every module: model.layers[0].state_dict() reads params too, and
        # loading writes them.
        for module in model.modules():
            self._handles.append(module.register_state_dict_pre_hook(wait_before_state_dict))
            self._handles.append(module.register_load_state_dict_pre_hook(wait_before_load))
        self._finalizer = weakref.finalize(optimizer, ForwardOverlap._remove, self._handles)

    @staticmethod
    def _remove(handles) -> None:
        for handle in handles:
            handle.remove()

    def remove(self) -> None:
        self._finalizer()

    def _check_in_model(self, params: list[torch.Tensor]) -> None:
        missing = [i for i, p in enumerate(params) if id(p) not in self._in_model]
        if missing:
            raise ValueError(f"SwapOptimizer(overlap_forward=True): param(s) {missing} are not in the model's "
                             "parameters (as they were when the optimizer was made), so no forward hook would wait "
                             "for their update; pass the module whose forward uses every param as model=, or keep "
                             "those params in another optimizer")

    def rank_of_params(self, params: list[torch.Tensor]) -> list[int]:
        """Each param's block index (-1: outside every block, needed first)."""
        return [self._ranks_by_id.get(id(p), -1) for p in params]

    def lay_out(self, runtime, params: list[torch.Tensor]) -> None:
        """Orders the runtime's batches by block and notes what each hook waits for."""
        self._check_in_model(params)
        runtime.set_batch_order(self.rank_of_params(params))
        position_of = {batch: position for position, batch in enumerate(runtime.pipeline_order())}
        last = [-1] * len(params)
        for batch, plan in enumerate(runtime.batch_plan()):
            for i in plan["params"]:
                last[i] = max(last[i], position_of[batch])
        ids = [id(p) for p in params]
        self.positions = [max((last[i] for i, pid in enumerate(ids) if pid in members), default=-1)
                          for members in self._block_params]
        in_blocks = set().union(*self._block_params) if self._block_params else set()
        self.entry_position = max((last[i] for i, pid in enumerate(ids) if pid not in in_blocks), default=-1)

    def position_for(self, block: Optional[int]) -> int:
        return self.entry_position if block is None else self.positions[block]
