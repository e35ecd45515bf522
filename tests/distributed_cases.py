"""Multi-process cases for tests/distributed/test_distributed.py: they run on 2 ranks
spawned here, on 127.0.0.1 with a free port, and assert inside the ranks.

    python distributed_cases.py CASE[,CASE...] WORK_DIR [gloo|nccl]

Several cases run one after the other in the same two ranks and process group
(spawning the ranks costs more than most cases), each in its own folder of
WORK_DIR; the first that fails stops the run.

Tolerances: SwapOptimizer against the plain optimizer in the same setting,
rtol 1e-5 / atol 1e-6 (fp32); checkpoint round trips are bitwise.
"""

from __future__ import annotations

import gc
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

from swap_optimizer import SwapOptimizer, dequantize_state_dict
from swap_optimizer.compact import dequantize

from optimizer_cases import Lion

WORLD = 2
TOL = dict(rtol=1e-5, atol=1e-6)


def build(device, dtype=torch.float32):
    torch.manual_seed(0)
    # 33 rows: shards of 17 and 16 rows, so rank 1's shard is a view of a padded buffer.
    return nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 33), nn.GELU(), nn.Linear(33, 8)).to(device, dtype)


def build_wide(device):
    """A model whose 512 x 129 layer holds most of the state: its local shards
    (65 and 64 rows) are split across batches at swap_times 8."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 512), nn.GELU(), nn.Linear(512, 129), nn.GELU(), nn.Linear(129, 8)).to(device)


def shard(model, mp_policy=None):
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def train(model, optimizer, steps, first_step, device, rank):
    for step in range(first_step, first_step + steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
        x = torch.randn(16, 24, generator=generator).to(device)
        optimizer.zero_grad()
        model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
        optimizer.step()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def assert_models_close(model, reference, **tolerance):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(local(p.detach()), local(q.detach()), **tolerance, msg=lambda m: f"{name}: {m}")


def case_fsdp2(rank, device, work_dir):
    model, reference = shard(build(device)), shard(build(device))
    ours = SwapOptimizer(adamw(model.parameters()), swap_times=3, min_numel=64)
    plain = adamw(reference.parameters())
    train(model, ours, 6, 0, device, rank)
    train(reference, plain, 6, 0, device, rank)
    assert_models_close(model, reference, **TOL)
    for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters())):
        assert isinstance(p, DTensor)
        for key in ("exp_avg", "exp_avg_sq"):
            state = ours.state[p][key]
            assert isinstance(state, DTensor) and state.placements == p.placements and state.shape == p.shape
            assert state._local_tensor is ours._rule.views[i][key]  # the store itself, not a copy on the mesh's device
            assert_close(state.to_local().to(device), plain.state[q][key].to_local(), **TOL)
        assert ours.state[p]["step"].item() == 6
    # Each rank holds the states of its own shards only: half of the whole.
    local_numel = sum(local(p).numel() for p in model.parameters())
    swapped = sum(local(p).numel() for p in model.parameters() if local(p).numel() >= 64)
    stats = ours.memory_stats()
    assert swapped * 8 <= stats["host_state_bytes"] < swapped * 8 + 256 * 16
    assert stats["resident_state_bytes"] < (local_numel - swapped) * 8 + 256 * 16
    assert local_numel < sum(p.numel() for p in model.parameters()) * 0.6


def save_checkpoint(model, optimizer, work_dir, name="checkpoint"):
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(work_dir, name))


def assert_resumes_bitwise(model, optimizer, make_model, swap_times, device, rank, work_dir, make=adamw,
                           name="checkpoint", **fields):
    """A fresh model and SwapOptimizer (of `make`'s optimizer, another
    swap_times) loaded from the DCP checkpoint `name` train 3 more steps
    exactly as the saved pair does (steps 4-6); returns the fresh pair."""
    resumed = shard(make_model(device))
    resumed_optimizer = SwapOptimizer(make(resumed.parameters()), swap_times=swap_times, min_numel=64, **fields)
    model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=os.path.join(work_dir, name))
    set_state_dict(resumed, resumed_optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    train(model, optimizer, 3, 4, device, rank)
    train(resumed, resumed_optimizer, 3, 4, device, rank)
    assert_models_close(resumed, model, rtol=0, atol=0)
    return resumed, resumed_optimizer


def case_fsdp2_checkpoint(rank, device, work_dir):
    model = shard(build(device))
    ours = SwapOptimizer(adamw(model.parameters()), swap_times=2, min_numel=64)
    train(model, ours, 4, 0, device, rank)
    save_checkpoint(model, ours, work_dir)

    # A full (gathered) state dict on rank 0 has the global shapes.
    full = get_optimizer_state_dict(model, ours, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        names = [name for name, _ in model.named_parameters()]
        for name, p in zip(names, model.parameters()):
            entry = full["state"][name]
            assert not isinstance(entry["exp_avg"], DTensor) and entry["exp_avg"].shape == p.shape
            assert entry["step"].item() == 4
    assert_resumes_bitwise(model, ours, build, 3, device, rank, work_dir)


def case_fsdp2_mixed_precision(rank, device, work_dir):
    """bf16 params, fp32 gradient reduction, fp32 master weights and states."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(build(device, torch.bfloat16), policy)
    reference = shard(build(device, torch.bfloat16).float(), policy)  # fp32 shards, the same bf16 compute
    ours = SwapOptimizer(adamw(model.parameters()), swap_times=2, min_numel=64, master_weights=True,
                         state_dtype=torch.float32)
    plain = adamw(reference.parameters())
    train(model, ours, 5, 0, device, rank)
    train(reference, plain, 5, 0, device, rank)
    for p, q in zip(model.parameters(), reference.parameters()):
        master = ours.state[p]["master_param"]
        assert isinstance(master, DTensor) and master.dtype == torch.float32
        assert torch.equal(local(p.detach()), master.to_local().to(device).to(torch.bfloat16))
        # FSDP2 hands bf16 params bf16 grads (reduced in fp32, then rounded): the
        # master follows the fp32 run up to that rounding.
        assert_close(master.to_local().to(device), local(q.detach()), rtol=1e-2, atol=2e-3)


def case_fsdp2_split(rank, device, work_dir):
    """Local shards split in pieces across batches: parity with the plain
    optimizer, then a DCP checkpoint loaded into another split resumes bitwise."""
    model, reference = shard(build_wide(device)), shard(build_wide(device))
    ours = SwapOptimizer(adamw(model.parameters()), swap_times=8, min_numel=64)
    plain = adamw(reference.parameters())
    assert ours.memory_stats()["split_params"] >= 1
    pieces = [piece for batch in ours._batch_layout() for piece in batch["pieces"]]
    assert any(offset > 0 for _, offset, _ in pieces)
    train(model, ours, 4, 0, device, rank)
    train(reference, plain, 4, 0, device, rank)
    assert_models_close(model, reference, **TOL)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert ours.state[p]["step"].item() == 4
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(ours.state[p][key].to_local().to(device), plain.state[q][key].to_local(), **TOL)
    save_checkpoint(model, ours, work_dir)
    assert_resumes_bitwise(model, ours, build_wide, 3, device, rank, work_dir)


def case_fsdp2_bf16_moments(rank, device, work_dir):
    """bf16 moments rounded stochastically under FSDP2: each shard draws by the
    global element index, so the sharded states are bit for bit those of one
    unsharded optimizer stepped with the same (averaged) grads; a DCP checkpoint
    resumes bitwise in an optimizer made with another seed (the saved one wins)."""
    fields = dict(state_dtype=torch.bfloat16, rounding_seed=5)
    model = shard(build_wide(device))
    ours = SwapOptimizer(adamw(model.parameters()), swap_times=4, min_numel=64, **fields)
    replica = build_wide(device)
    whole = SwapOptimizer(adamw(replica.parameters()), swap_times=1, min_numel=64, **fields)
    for step in range(4):
        train(model, ours, 1, step, device, rank)
        grads = []
        for r in range(WORLD):  # every rank's batch, averaged as FSDP2 reduces them
            generator = torch.Generator().manual_seed(1000 * step + r)
            replica.zero_grad()
            replica(torch.randn(16, 24, generator=generator).to(device)).float().square().mean().backward()
            grads.append([p.grad.clone() for p in replica.parameters()])
        for p, *per_rank in zip(replica.parameters(), *grads):
            p.grad = sum(per_rank) / WORLD
        whole.step()
    for p, q in zip(model.parameters(), replica.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            full = ours.state[p][key].full_tensor()
            assert full.dtype == torch.bfloat16
            assert torch.equal(full.to(device), whole.state[q][key]), key
    save_checkpoint(model, ours, work_dir)
    assert_resumes_bitwise(model, ours, build_wide, 3, device, rank, work_dir, state_dtype=torch.bfloat16,
                           rounding_seed=99)


def case_fsdp2_8bit(rank, device, work_dir):
    """8-bit moments under FSDP2, local shards split across batches: training
    follows fp32 AdamW, each rank's scales have their own place in a DCP
    checkpoint, which resumes bitwise at the same world size."""
    model, reference = shard(build_wide(device)), shard(build_wide(device))
    ours = SwapOptimizer(adamw(model.parameters()), swap_times=8, min_numel=64, state_dtype=torch.uint8)
    plain = adamw(reference.parameters())
    train(model, ours, 4, 0, device, rank)
    train(reference, plain, 4, 0, device, rank)
    assert_models_close(model, reference, rtol=0.05, atol=5e-3)
    big = next(p for p in model.parameters() if local(p).numel() >= 4096)
    assert isinstance(ours.state[big]["exp_avg_codes"], DTensor)
    scales = ours.state_dict()["state"][[id(p) for p in model.parameters()].index(id(big))]["exp_avg_absmax"]
    assert isinstance(scales, DTensor) and scales.shape[0] == WORLD
    assert torch.equal(scales.to_local()[0, :ours.state[big]["exp_avg_absmax"].numel()],
                       ours.state[big]["exp_avg_absmax"])
    # A full state dict (scales a row per rank) decodes to what each rank's shard decodes to.
    full = get_optimizer_state_dict(model, ours, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    codes, absmax = ours.state[big]["exp_avg_codes"], ours.state[big]["exp_avg_absmax"]
    decoded = DTensor.from_local(dequantize(codes.to_local(), absmax, "exp_avg").to(device), big.device_mesh,
                                 big.placements, shape=big.shape, stride=big.stride()).full_tensor()
    if rank == 0:
        name = [n for n, p in model.named_parameters() if p is big][0]
        plain = dequantize_state_dict(full)["state"][name]
        assert "exp_avg_codes" not in plain and torch.equal(plain["exp_avg"].to(device), decoded)
    # Scales saved at another world size (3 rows here) are refused, naming the way round.
    index = [id(p) for p in model.parameters()].index(id(big))
    other = ours.state_dict()
    other["state"][index] = dict(other["state"][index], exp_avg_absmax=torch.zeros(3, scales.shape[1]))
    before = ours.state[big]["exp_avg_codes"].to_local().clone()
    try:
        ours.load_state_dict(other)
        raise AssertionError("scales of another world size were accepted")
    except ValueError as error:
        assert "saved at another world size or sharding" in str(error) and "state_dtype=torch.float32" in str(error)
    assert torch.equal(ours.state[big]["exp_avg_codes"].to_local(), before)
    # Quantized or not is decided on the whole param: 33 x 128 (4224 elements) has shards of 2176 and
    # 2048, each under 4096, and both ranks keep 8-bit states for it.
    small = shard(nn.Sequential(nn.Linear(128, 33)).to(device))
    small_optimizer = SwapOptimizer(adamw(small.parameters()), min_numel=64, state_dtype=torch.uint8)
    assert "exp_avg_codes" in small_optimizer._rule.views[0] and local(small[0].weight).numel() < 4096
    save_checkpoint(model, ours, work_dir)
    assert_resumes_bitwise(model, ours, build_wide, 3, device, rank, work_dir, state_dtype=torch.uint8)


def case_fsdp2_other_optimizers(rank, device, work_dir):
    """SGD (foreach, momentum) and NAdam (scalars: step, mu_product) on FSDP2
    shards cut across batches: bitwise the plain optimizer on the same DTensors;
    `state` holds DTensors over the store; a DCP checkpoint loaded into another
    swap_times resumes bitwise. Muon and Adafactor (whole-param updates) are
    refused with DTensor params (vouched-for optimizers: case_fsdp2_vouched_for)."""
    for name, make in (("SGD", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1, foreach=True)),
                       ("NAdam", lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.01))):
        model, reference = shard(build_wide(device)), shard(build_wide(device))
        ours = SwapOptimizer(make(model.parameters()), swap_times=8, min_numel=64)
        plain = make(reference.parameters())
        assert ours.memory_stats()["split_params"] >= 1, name
        train(model, ours, 4, 0, device, rank)
        train(reference, plain, 4, 0, device, rank)
        assert_models_close(model, reference, rtol=0, atol=0)
        for p, q in zip(model.parameters(), reference.parameters()):
            for key, value in plain.state[q].items():
                mine = ours.state[p][key]
                if isinstance(value, DTensor):
                    assert isinstance(mine, DTensor) and mine.placements == p.placements, (name, key)
                    assert torch.equal(mine.to_local().to(device), value.to_local()), (name, key)
                else:
                    assert torch.equal(mine, value), (name, key)
        save_checkpoint(model, ours, work_dir, name)
        assert_resumes_bitwise(model, ours, build_wide, 3, device, rank, work_dir, make, name)
    sharded = shard(build(device))
    matrices = [p for p in sharded.parameters() if p.dim() == 2]
    for optimizer in (torch.optim.Muon(matrices, lr=0.02), torch.optim.Adafactor(sharded.parameters(), lr=0.01)):
        with pytest.raises(ValueError, match="updates each rank's local shard, but"):
            SwapOptimizer(optimizer)


class CountingLion(Lion):
    """The case table's Lion (optimizer_cases.py) that also counts each param's
    updates in a number state: SwapOptimizer has no declaration for it, so it
    is wrapped on trust_per_param_step."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["updates"] = self.state[p].get("updates", 0) + 1


class RowScaledLion(CountingLion):
    """Lion that also keeps a per-row state: shaped neither like a param nor like its shard."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].setdefault("rows", torch.zeros(p.shape[0] + 1, device=p.device))
        return super().step(closure)


def case_fsdp2_vouched_for(rank, device, work_dir):
    """A vouched-for elementwise optimizer (trust_per_param_step and
    trust_elementwise_step) on FSDP2 shards cut across batches: each param's
    states are learned from its local shard's first update, its contract
    probed on local shards; params and states bitwise the plain optimizer on
    the same DTensors, `state` holding DTensors with the params' placements; a
    DCP checkpoint loaded into another swap_times resumes bitwise. Without
    trust_elementwise_step it is refused, naming it; a state shaped neither
    like the param nor like its shard is refused at the first step, nothing
    changed."""
    model, reference = shard(build_wide(device)), shard(build_wide(device))
    ours = SwapOptimizer(CountingLion(model.parameters()), swap_times=8, min_numel=64, trust_per_param_step=True,
                         trust_elementwise_step=True)
    plain = CountingLion(reference.parameters())
    train(model, ours, 4, 0, device, rank)
    train(reference, plain, 4, 0, device, rank)
    assert ours.memory_stats()["split_params"] >= 1 and ours.memory_stats()["swapped_state_keys"] == ["exp_avg"]
    assert_models_close(model, reference, rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        mine, theirs = ours.state[p], plain.state[q]
        assert mine.keys() == theirs.keys() and mine["updates"] == theirs["updates"] == 4
        assert isinstance(mine["exp_avg"], DTensor) and mine["exp_avg"].placements == p.placements
        assert torch.equal(mine["exp_avg"].to_local().to(device), theirs["exp_avg"].to_local())
    save_checkpoint(model, ours, work_dir)
    resumed, resumed_optimizer = assert_resumes_bitwise(model, ours, build_wide, 3, device, rank, work_dir,
                                                        CountingLion, trust_per_param_step=True,
                                                        trust_elementwise_step=True)
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(resumed_optimizer.state[p]["exp_avg"].to_local(), ours.state[q]["exp_avg"].to_local())
    sharded = shard(build(device))
    with pytest.raises(ValueError, match="with DTensor params \\(FSDP2\\): SwapOptimizer updates each rank's local "
                                         "shard, which is the whole update only if"):
        SwapOptimizer(CountingLion(sharded.parameters()), trust_per_param_step=True)
    rows = SwapOptimizer(RowScaledLion(sharded.parameters()), min_numel=64, trust_per_param_step=True,
                         trust_elementwise_step=True)
    before = [local(p.detach()).clone() for p in sharded.parameters()]
    sharded(torch.ones(2, 24, device=device)).square().mean().backward()
    with pytest.raises(ValueError, match="neither its param's .* nor its local shard's"):
        rows.step()
    assert all(torch.equal(local(p.detach()), b) for p, b in zip(sharded.parameters(), before)) and not rows.state


def case_fsdp2_budget(rank, device, work_dir):
    """device_budget_bytes under FSDP2 is per rank: each rank plans for its
    local shards (half the state), keeps resident what fits beside its
    staging, stays within the budget, and trains bitwise like an unbudgeted
    SwapOptimizer on the same shards."""
    probe = SwapOptimizer(adamw(shard(build_wide(device)).parameters()), swap_times=8, num_arenas=2, min_numel=64)
    unbudgeted = probe.plan_report()["chosen"]["device_bytes"]
    local_state = probe.memory_stats()["host_state_bytes"]
    global_state = sum(8 * p.numel() for p in build_wide("cpu").parameters() if p.numel() >= 64)
    assert local_state < 0.6 * global_state  # the store holds this rank's shards only
    budget = unbudgeted + local_state // 2
    model, reference = shard(build_wide(device)), shard(build_wide(device))
    ours = SwapOptimizer(adamw(model.parameters()), swap_times=8, num_arenas=2, min_numel=64,
                         device_budget_bytes=budget)
    twin = SwapOptimizer(adamw(reference.parameters()), swap_times=8, num_arenas=2, min_numel=64)
    train(model, ours, 4, 0, device, rank)
    train(reference, twin, 4, 0, device, rank)
    assert_models_close(model, reference, rtol=0, atol=0)
    stats = ours.memory_stats()
    assert probe.memory_stats()["resident_share"] < stats["resident_share"] < 1 and stats["plan"]["resident_params"]
    assert stats["resident_state_bytes"] + stats["peak_staging_bytes"] <= stats["plan"]["device_bytes"]["total"] <= budget
    for p, q in zip(model.parameters(), reference.parameters()):
        for key, value in twin.state[q].items():
            assert torch.equal(local(ours.state[p][key]).cpu(), local(value).cpu()), key


def case_ddp(rank, device, work_dir):
    model = DistributedDataParallel(build(device))
    reference = DistributedDataParallel(build(device))
    ours = SwapOptimizer(adamw(model.parameters()), swap_times=2, num_arenas=3, min_numel=64)
    plain = adamw(reference.parameters())
    train(model, ours, 6, 0, device, rank)
    train(reference, plain, 6, 0, device, rank)
    assert_models_close(model, reference, **TOL)
    # Replicas stay identical across ranks.
    for p in model.parameters():
        gathered = [torch.empty_like(p) for _ in range(WORLD)]
        dist.all_gather(gathered, p.detach())
        assert torch.equal(gathered[0], gathered[1])


def case_ddp_auto_budget(rank, device, work_dir):
    """device_budget_bytes="auto" under DDP: the ranks see different free
    memory (simulated), agree on the least budget and move to its plan at the
    same step; training is bitwise an unbudgeted run, and the replicas stay
    identical."""
    probe = SwapOptimizer(adamw(build_wide(device).parameters()), swap_times=8, num_arenas=2, min_numel=64)
    unbudgeted = probe.plan_report()["chosen"]["device_bytes"]
    budgets = [unbudgeted + probe.memory_stats()["host_state_bytes"] // 2, unbudgeted + 10_000_000]
    model, reference = DistributedDataParallel(build_wide(device)), DistributedDataParallel(build_wide(device))
    ours = SwapOptimizer(adamw(model.parameters()), swap_times=8, num_arenas=2, min_numel=64,
                         device_budget_bytes="auto", auto_warmup_steps=2, auto_headroom_bytes=0)
    held = probe.memory_stats()["resident_state_bytes"]
    ours._auto.simulated = dict(free_bytes=budgets[rank], peak_bytes=held, allocated_bytes=0)
    twin = SwapOptimizer(adamw(reference.parameters()), swap_times=8, num_arenas=2, min_numel=64)
    train(model, ours, 5, 0, device, rank)
    train(reference, twin, 5, 0, device, rank)
    assert_models_close(model, reference, rtol=0, atol=0)
    measured = ours.memory_stats()["auto_budget"]["measured"]
    assert measured["budget_bytes"] == min(budgets) and measured["at_step"] == 3
    assert ours.memory_stats()["plan"]["resident_params"]
    for p in model.parameters():
        gathered = [torch.empty_like(p) for _ in range(WORLD)]
        dist.all_gather(gathered, p.detach())
        assert torch.equal(gathered[0], gathered[1])


def case_ddp_overlap(rank, device, work_dir):
    """overlap_forward=True under DDP: the wrapped model's calls wait for their
    params; training is bitwise that without it on every rank, and the
    replicas stay identical. FSDP2's DTensor params are refused."""
    runs = []
    for overlap in (False, True):
        model = DistributedDataParallel(build(device))
        fields = dict(model=model, overlap_forward=True) if overlap else {}
        ours = SwapOptimizer(adamw(model.parameters()), swap_times=3, num_arenas=3, min_numel=64, **fields)
        if overlap and device.type == "cpu":
            ours._set_test_hooks(copy_delay_us=300, seed=rank)  # the updates lag behind the forward
        train(model, ours, 6, 0, device, rank)
        if overlap:
            assert ours._overlap.schedule is not None and ours._overlap.pending  # the steps after the probe overlap
        ours.wait()
        runs.append(([p.detach().clone() for p in model.parameters()],
                     [v.clone() for p in model.parameters() for v in ours.state[p].values()]))
    (params_off, state_off), (params_on, state_on) = runs
    assert all(torch.equal(a, b) for a, b in zip(params_off, params_on))
    assert len(state_off) == len(state_on) and all(torch.equal(a, b) for a, b in zip(state_off, state_on))
    for p in params_on:
        gathered = [torch.empty_like(p) for _ in range(WORLD)]
        dist.all_gather(gathered, p)
        assert torch.equal(gathered[0], gathered[1])
    sharded = shard(build(device))
    with pytest.raises(ValueError, match="does not support DTensor params"):
        SwapOptimizer(adamw(sharded.parameters()), model=sharded, overlap_forward=True)


class LayerDrop(nn.Module):
    """Odd calls skip one of the layers (the same one on every rank)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))
        self.head = nn.Linear(24, 8)
        self.calls = 0

    def forward(self, x):
        dropped = 1 + self.calls % 3 if self.calls % 2 else None
        self.calls += 1
        for i, layer in enumerate(self.layers):
            if i != dropped:
                x = torch.tanh(layer(x))
        return self.head(x)


def case_ddp_overlap_layer_drop(rank, device, work_dir):
    """overlap_forward=True under DDP with find_unused_parameters and
    gradient_as_bucket_view=True (grads are views of the reducer's buckets,
    which the next backward rewrites): the called layers change between steps,
    the whole step is waited for where the calls differ from the probe's, and
    training is bitwise that without overlap, replicas identical. Negative
    control: without that wait the results differ."""
    runs = []
    for overlap, control in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        model = DistributedDataParallel(LayerDrop().to(device), find_unused_parameters=True,
                                        gradient_as_bucket_view=True)
        fields = dict(model=model, overlap_forward=True) if overlap else {}
        ours = SwapOptimizer(adamw(model.parameters()), swap_times=4, num_arenas=3, min_numel=0, **fields)
        if overlap:
            ours._overlap.set_test_hooks(unguarded={"divergence"} if control else ())
            if device.type == "cpu":
                ours._set_test_hooks(copy_delay_us=4000 if control else 300, seed=rank)
        train(model, ours, 7, 0, device, rank)
        ours.wait()
        runs.append([p.detach().clone() for p in model.parameters()] +
                    [v.clone() for p in model.parameters() for v in ours.state[p].values()])
    plain, overlapped, uncovered = runs
    assert len(plain) == len(overlapped) and all(torch.equal(a, b) for a, b in zip(plain, overlapped))
    assert any(not torch.equal(a, b) for a, b in zip(plain, uncovered)), "the negative control did not differ"
    for p in overlapped[:len(list(model.parameters()))]:
        gathered = [torch.empty_like(p) for _ in range(WORLD)]
        dist.all_gather(gathered, p)
        assert torch.equal(gathered[0], gathered[1])


CASES = {"ddp_overlap": case_ddp_overlap, "ddp_overlap_layer_drop": case_ddp_overlap_layer_drop, "fsdp2": case_fsdp2, "fsdp2_checkpoint": case_fsdp2_checkpoint,
         "fsdp2_mixed_precision": case_fsdp2_mixed_precision, "fsdp2_split": case_fsdp2_split,
         "fsdp2_bf16_moments": case_fsdp2_bf16_moments, "fsdp2_8bit": case_fsdp2_8bit, "fsdp2_other_optimizers": case_fsdp2_other_optimizers,
         "fsdp2_vouched_for": case_fsdp2_vouched_for,
         "fsdp2_budget": case_fsdp2_budget, "ddp": case_ddp, "ddp_auto_budget": case_ddp_auto_budget}


def run_rank(rank, cases, work_dir, backend, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    try:
        for case in cases:
            case_dir = os.path.join(work_dir, case)
            os.makedirs(case_dir, exist_ok=True)
            CASES[case](rank, device, case_dir)
            gc.collect()  # the case's optimizers go (an overlapping one takes its watch off) before the next
            dist.barrier()
            if rank == 0:
                print(f"{case} on {backend}: passed on {WORLD} ranks", flush=True)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    cases, work_dir = sys.argv[1].split(","), sys.argv[2]
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        sys.exit(f"no such case: {', '.join(unknown)} (the cases: {', '.join(CASES)})")
    backend = sys.argv[3] if len(sys.argv) > 3 else "gloo"
    mp.spawn(run_rank, args=(cases, work_dir, backend, free_port()), nprocs=WORLD)
