"""Overlapping a deferred step with the next forward: where each read of a
param waits for that param's update (docs/design.md, "Overlap with the
forward").

A deferred step's updates bump no version counter, so a read that does not
wait would be silent. The waits follow what the model does, not how it is
built:

- The probe. The first overlapped step after construction or a rebuild runs
  whole, inside step(). Until the next step(), a TorchFunctionMode records
  which params are read or written (by storage: reads through .data,
  .detach(), a view or an alias made earlier count, under no_grad too) and,
  through global module hooks, which modules of `model` are called, in order.
- The wait schedule. Each param waits at the last module call before its first read
  inside a module call. Two static rules add to that: a call of a block
  (children of ModuleLists and plain nn.Sequentials) waits for its whole
  subtree, and a call of any module waits for its direct params. Batches are
  ordered by where they are first needed; params whose grads appeared
  although no read of them was seen finish inside step(). The last call of
  the probe's sequence waits for the rest.
- Every overlapped pass. The calls are compared with the probe's sequence;
  at the first difference (layer drop, routing, an eval path) the whole step
  is waited for there. Nothing read before was stale, as the prefix matched.
- Outside the model's calls (depth 0 on the thread that called step()), the
  same TorchFunctionMode guards every op while the step is pending: an op
  that touches a param, or a grad the step reads, waits for its position;
  backward() waits for the whole step (it may write grads the step reads).
  EMA updates, norm logging, copy.deepcopy(model) and torch.save(model) wait
  by themselves.
- Compiled models: a torch.compile wrapper's call, or a model with a module
  compiled in place, waits for the whole step at its first call; a model
  compiled in place at its root runs no eager hook at all, so its steps
  complete inside step(). A CUDA graph capture of the forward switches
  overlap off for later steps (replays run no hooks).

Nothing is attached to the model: the hooks are global and the model stays
picklable; a deepcopy or a pickled copy has other params and modules, so it
never waits for this optimizer's step or keeps it alive.

The package: guard.py (the read watch, a TorchFunctionMode on the stepping
thread, and the byte spans it looks params up by), probe.py (the model's
blocks and structure, and the wait schedule the probe makes), hooks.py (the
global module hooks, armed while a pass needs them, and the wrapped signal
handlers), waits.py (ForwardOverlap: the pass state, the probe's record and
every wait). The private torch APIs they use are wrapped once, in
swap_optimizer/torch_internals.py.
"""

from .hooks import finish_before_exit, hooks_suspended
from .probe import check_model, find_blocks
from .waits import KNOCKABLE_RULES, UNGUARDABLE, ForwardOverlap, OverlapTestHooks

__all__ = ["ForwardOverlap", "OverlapTestHooks", "KNOCKABLE_RULES", "UNGUARDABLE", "check_model", "find_blocks",
           "finish_before_exit", "hooks_suspended"]
