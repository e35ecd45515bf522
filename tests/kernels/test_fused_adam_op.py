"""swap_optimizer::fused_adam_packed against torch.optim.Adam/AdamW.

Tolerances (asserted below, reported in docs/design.md):
- fp32 vs torch.optim single-tensor Adam/AdamW, 20 steps: rtol 1e-5, atol 1e-7.
- bf16/fp16 vs torch.optim fused Adam/AdamW (same fp32 math, one rounding per
  stored value): atol 1e-5, rtol 1e-4 for at least 99.9% of elements, and every
  element within one unit in the last place of the dtype.
- master weights (bf16 params, fp32 master and states) vs fp32 torch.optim:
  rtol 1e-5, atol 1e-7 on the master; the bf16 param equals the rounded master.
- Batching, arena placement, CPU instruction set, CUDA vs CPU and splitting a
  param into pieces: bitwise identical.
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

import swap_optimizer as so
from swap_optimizer import codec
from conftest import DEVICES, TESTS, requires_cuda
from packed_reference import AdamFlags, PackedBatches, random_grads, random_params

STEPS = 20
SIZES = [1, 2, 3, 7, 31, 33, 127, 1000, 4097, 16385, 65537]
ALL_FLAGS = [
    AdamFlags(decoupled=d, amsgrad=a, maximize=m, weight_decay=wd)
    for d, a, m, wd in itertools.product([True, False], [False, True], [False, True], [0.0, 0.1])
]
FP32_TOL = dict(rtol=1e-5, atol=1e-7)
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def flag_id(f):
    return f"{'adamw' if f.decoupled else 'adam'}-ams{int(f.amsgrad)}-max{int(f.maximize)}-wd{f.weight_decay}"


def run_pair(sizes, dtype, device, flags, seed, reference_kwargs, batch_sizes=None, steps=STEPS):
    params = random_params(sizes, dtype, device, seed)
    ref = [p.clone().requires_grad_() for p in params]
    opt = flags.torch_optimizer(ref, **reference_kwargs)
    ours = PackedBatches(params, batch_sizes or [len(params)], amsgrad=flags.amsgrad)
    for step in range(steps):
        grads = random_grads(params, seed, step)
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        ours.step(grads, flags)
    return params, ref, opt, ours


def assert_states_close(params, ref, opt, ours, flags, **tol):
    for i, (p, r) in enumerate(zip(params, ref)):
        assert_close(p, r.detach(), **tol, msg=lambda m: f"param {i} (numel {p.numel()}): {m}")
        state = opt.state[r]
        assert_close(ours.state(i, 0), state["exp_avg"], **tol)
        assert_close(ours.state(i, 1), state["exp_avg_sq"], **tol)
        if flags.amsgrad:
            assert_close(ours.state(i, 2), state["max_exp_avg_sq"], **tol)
    expected_steps = torch.tensor([float(opt.state[r]["step"]) for r in ref])
    assert torch.equal(ours.steps(), expected_steps)


def assert_within_one_ulp(actual, expected, dtype):
    """bf16/fp16 parity with torch's fused kernels, as stated in the module doc."""
    a, e = actual.float(), expected.float()
    tight = (a - e).abs() <= 1e-5 + 1e-4 * e.abs()
    assert tight.float().mean().item() >= 0.999, f"{(~tight).sum().item()} of {a.numel()} elements off"
    assert_close(a, e, rtol=ULP[dtype], atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flags", ALL_FLAGS, ids=flag_id)
def test_fp32_matches_torch_optim(device, flags):
    params, ref, opt, ours = run_pair(SIZES, torch.float32, device, flags, seed=11,
                                      reference_kwargs=dict(foreach=False))
    assert_states_close(params, ref, opt, ours, flags, **FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flags", [AdamFlags(), AdamFlags(decoupled=False, amsgrad=True)], ids=flag_id)
def test_fp32_million_elements(device, flags):
    params, ref, opt, ours = run_pair([1_000_003, 5], torch.float32, device, flags, seed=12,
                                      reference_kwargs=dict(foreach=False))
    assert_states_close(params, ref, opt, ours, flags, **FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_l2_decay_rounds_like_torch_where_it_cancels(device):
    """Adam's grad + weight_decay * param is rounded once, as torch's
    grad.add(param, alpha=wd) does (an FMA on CPU and CUDA). With grads close to
    -wd * param the sum cancels, so two roundings left 1% of params outside
    rtol 1e-5 / atol 1e-7; now exp_avg is torch's bit for bit."""
    flags = AdamFlags(decoupled=False, weight_decay=0.1, lr=1e-3)
    params = random_params([1_000_000], torch.float32, device, seed=31)
    noise = random_params([1_000_000], torch.float32, device, seed=32)[0]
    grad = -0.1 * params[0] * (1 + 1e-4 * noise)
    ref = [params[0].clone().requires_grad_()]
    opt = flags.torch_optimizer(ref, foreach=False)
    ours = PackedBatches(params, [1], amsgrad=False)
    ref[0].grad = grad.clone()
    opt.step()
    ours.step([grad], flags)
    assert torch.equal(ours.state(0, 0), opt.state[ref[0]]["exp_avg"])
    assert_close(params[0], ref[0].detach(), **FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("flags", [f for f in ALL_FLAGS if f.weight_decay], ids=flag_id)
def test_low_precision_matches_torch_fused(device, dtype, flags):
    params, ref, opt, ours = run_pair(SIZES, dtype, device, flags, seed=13, reference_kwargs=dict(fused=True))
    if device == "cpu":
        for i, (p, r) in enumerate(zip(params, ref)):
            assert_within_one_ulp(p, r.detach(), dtype)
            assert_within_one_ulp(ours.state(i, 0), opt.state[r]["exp_avg"], dtype)
            assert_within_one_ulp(ours.state(i, 1), opt.state[r]["exp_avg_sq"], dtype)
        return
    # torch's CUDA fused AdamW rounds some intermediates otherwise (~2e-4 of
    # elements two ulps apart): the reference is the op's own fp32 math, the CPU
    # kernel; torch stays a tolerance check.
    cpu_params, _, _, cpu_ours = run_pair(SIZES, dtype, "cpu", flags, seed=13, reference_kwargs=dict(fused=True))
    for i, (p, c, r) in enumerate(zip(params, cpu_params, ref)):
        assert_close(p.cpu(), c, rtol=max(1e-6, ULP[dtype]), atol=1e-7)
        assert_close(ours.state(i, 0).cpu(), cpu_ours.state(i, 0), rtol=max(1e-6, ULP[dtype]), atol=1e-7)
        assert_close(p, r.detach(), rtol=2 * ULP[dtype], atol=1e-5)
        assert_close(ours.state(i, 1), opt.state[r]["exp_avg_sq"], rtol=2 * ULP[dtype], atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("flags", [AdamFlags(), AdamFlags(decoupled=False, amsgrad=True, maximize=True)], ids=flag_id)
def test_master_weights_match_fp32_reference(device, dtype, flags):
    params = random_params(SIZES, dtype, device, seed=14)
    ref = [p.float().requires_grad_() for p in params]
    opt = flags.torch_optimizer(ref, foreach=False)
    ours = PackedBatches(params, [len(params)], amsgrad=flags.amsgrad, state_dtype=torch.float32,
                         master_weights=True)
    for step in range(STEPS):
        grads = random_grads(params, 14, step)
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        ours.step(grads, flags, state_dtype=torch.float32)
    for i, (p, r) in enumerate(zip(params, ref)):
        master = ours.state(i, 3)
        assert_close(master, r.detach(), **FP32_TOL)
        assert torch.equal(p, master.to(dtype)), "the param must be the rounded master copy"
        assert_close(ours.state(i, 0), opt.state[r]["exp_avg"], **FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_states_for_bf16_params(device):
    """fp32 states without a master copy: each step reads the bf16 param, updates
    in fp32 and rounds the param back, which the reference emulates."""
    flags = AdamFlags(amsgrad=True)
    params = random_params(SIZES, torch.bfloat16, device, seed=15)
    ref = [p.float().requires_grad_() for p in params]
    opt = flags.torch_optimizer(ref, foreach=False)
    ours = PackedBatches(params, [len(params)], amsgrad=True, state_dtype=torch.float32)
    for step in range(STEPS):
        grads = random_grads(params, 15, step)
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        with torch.no_grad():
            for r in ref:
                r.copy_(r.bfloat16().float())
        ours.step(grads, flags, state_dtype=torch.float32)
    for i, (p, r) in enumerate(zip(params, ref)):
        assert_within_one_ulp(p, r.detach().bfloat16(), torch.bfloat16)
        assert ours.state(i, 0).dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bitwise_identical_across_batchings_and_placements(device, dtype):
    flags = AdamFlags(amsgrad=True, maximize=True)
    sizes = SIZES + [5, 600, 3]
    layouts = [
        dict(batch_sizes=[len(sizes)], alignment=256, start=0),
        dict(batch_sizes=[1] * len(sizes), alignment=256, start=0),
        dict(batch_sizes=[3, 5, len(sizes) - 8], alignment=4, start=4),   # not 16-byte aligned
        dict(batch_sizes=[7, len(sizes) - 7], alignment=16, start=12),
    ]
    results = []
    for layout in layouts:
        params = random_params(sizes, dtype, device, seed=16)
        master = dtype != torch.float32
        ours = PackedBatches(params, layout["batch_sizes"], amsgrad=True, alignment=layout["alignment"],
                             start=layout["start"], state_dtype=torch.float32 if master else None,
                             master_weights=master)
        for step in range(8):
            ours.step(random_grads(params, 16, step), flags, state_dtype=torch.float32 if master else None)
        states = [ours.state(i, c) for i in range(len(sizes)) for c in ((0, 1, 2, 3) if master else (0, 1, 2))]
        results.append([p.cpu() for p in params] + [s.cpu() for s in states])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def digest_of_cpu_loops():
    """Prints the CPU capability torch picked and a digest of params and states
    after a few steps of the plain loops (fp32 and bf16 params, amsgrad) and
    of the compact ones: each kind of moment (8-bit codes, stochastic bf16,
    bf16 and fp32 rounded to nearest) beside each start (the param, a master
    copy, a Kahan buffer), with grads that hold inf, NaN, signed zeros and
    magnitudes far apart; and the codec ops' loops. A NaN counts as a NaN whatever its payload (at::vec
    and scalar code make different ones, as torch's own kernels do). Run by
    the test below, once per capability."""
    import hashlib
    tensors = random_params([1, 7, 33, 1000, 4097], torch.float32, "cpu", 3) + \
        random_params([9, 1001], torch.bfloat16, "cpu", 4)
    packed = PackedBatches(tensors, [7], amsgrad=True)
    for step in range(5):
        packed.step(random_grads(tensors, 3, step), AdamFlags(amsgrad=True))
    tensors += [packed.state(i, c) for i in range(7) for c in (0, 1, 2)]
    for dtype, optimizer_class, fields in [
            (torch.float32, torch.optim.AdamW, dict(state_dtype=torch.uint8, amsgrad=True)),
            (torch.float32, torch.optim.AdamW, dict(state_dtype=torch.bfloat16, rounding_seed=3)),
            (torch.bfloat16, torch.optim.AdamW, dict(state_dtype=torch.uint8, kahan_summation=True)),
            (torch.bfloat16, torch.optim.Adam, dict(state_dtype=torch.bfloat16, master_weights=True, amsgrad=True,
                                                    rounding_seed=5, weight_decay=0.1)),
            (torch.float16, torch.optim.AdamW, dict(state_dtype=torch.uint8, master_weights=True, maximize=True)),
            (torch.bfloat16, torch.optim.Adam, dict(state_dtype=torch.float32, kahan_summation=True, amsgrad=True)),
            (torch.bfloat16, torch.optim.AdamW, dict(kahan_summation=True, amsgrad=True))]:
        torch_fields = {k: fields.pop(k) for k in ("amsgrad", "maximize", "weight_decay") if k in fields}
        params = [p.requires_grad_() for p in random_params([5000, 4097, 300], dtype, "cpu", 5)]
        optimizer = so.SwapOptimizer(optimizer_class(params, lr=1e-2, **torch_fields), swap_times=2, min_numel=0,
                                     **fields)
        for step in range(3):
            for p, grad in zip(params, random_grads(params, 5, step)):
                p.grad = grad
            special = params[0].grad
            special[:7] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-30, 3e30])
            special[512:768] *= 1e-12
            optimizer.step()
        tensors += [p.detach() for p in params] + [v for p in params for v in optimizer.state[p].values()]
    # The codec ops' loops (the compact states of torch's own updates; their
    # update itself is torch's, whose bits differ between its ISA kernels):
    # every 8-bit form, encoded and decoded back, and stochastic bf16.
    values = random_params([5000, 4097, 300], torch.float32, "cpu", 6)
    values[0][:7] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-30, 3e30])
    values[0][512:768] *= 1e-12
    for code_map, rounding in [("signed", "nearest"), ("unsigned", "nonzero"), ("unsigned", "up"),
                               ("unsigned", "nearest")]:
        inputs = values if code_map == "signed" else [v.abs() for v in values]
        codes = [torch.empty(v.shape, dtype=torch.uint8) for v in inputs]
        absmax = [torch.empty(-(-v.numel() // 256)) for v in inputs]
        codec.encode_blockwise_8bit(inputs, codes, absmax, [code_map] * 3, [rounding] * 3)
        decoded = [torch.empty_like(v) for v in inputs]
        codec.decode_blockwise_8bit(codes, absmax, decoded, [code_map] * 3)
        tensors += codes + absmax + decoded
    rounded = [torch.empty(v.shape, dtype=torch.bfloat16) for v in values]
    codec.encode_bf16_stochastic(values, rounded, seed=9, param_index=[0, 1, 2], state_index=[0, 1, 2],
                                 global_offset=[0, 5, 100], step=[1, 2, 3])
    tensors += rounded
    digest = hashlib.sha256(b"".join(torch.where(t.isnan(), float("nan"), t.float()).numpy().tobytes()
                                     if t.is_floating_point() else t.numpy().tobytes() for t in tensors)).hexdigest()
    print(torch.backends.cpu.get_cpu_capability(), digest)


@pytest.mark.slow  # (three interpreters, each building the loops' digest: 18 s of the README's tier)
def test_cpu_instruction_sets_agree_bitwise():
    """The AVX-512, AVX2 and baseline builds of the CPU loops, plain and
    compact, give the same bits (AVX-512 where the CPU has it)."""
    folders = [TESTS, os.path.dirname(os.path.abspath(__file__))]
    code = (f"import sys; sys.path[:0] = {folders!r}; import test_fused_adam_op; "
            f"test_fused_adam_op.{digest_of_cpu_loops.__name__}()")
    digests = {}
    # (avx512 on a CPU without it too: torch reports AVX512 there, and the
    # loops must still run what the CPU has, not stop on SIGILL)
    for capability in ["default", "avx2", "avx512"]:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
        # -P: the installed package, not a checkout's source folder in the current directory.
        out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        used, digest = out.stdout.split()
        digests[used] = digest
    assert len(digests) >= 2 and "DEFAULT" in digests, f"fewer than two instruction sets ran: {digests}"
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scale_matches_torch_fused(device):
    flags = AdamFlags(amsgrad=True)
    scale = 1000.0
    params = random_params(SIZES, torch.float32, device, seed=17)
    ref = [p.clone().requires_grad_() for p in params]
    opt = flags.torch_optimizer(ref, fused=True)
    ours = PackedBatches(params, [4, len(params) - 4], amsgrad=True)
    grad_scale = torch.tensor([scale], device=device)
    opt.grad_scale = grad_scale
    for step in range(STEPS):
        grads = [g * scale for g in random_grads(params, 17, step)]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        ours.step(grads, flags, grad_scale=grad_scale)
    assert_states_close(params, ref, opt, ours, flags, **FP32_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_changes_nothing(device):
    flags = AdamFlags(amsgrad=True)
    params = random_params(SIZES, torch.float32, device, seed=18)
    ours = PackedBatches(params, [len(params)], amsgrad=True)
    ours.step(random_grads(params, 18, 0), flags)
    before = [p.clone() for p in params] + [a.clone() for _, _, a, _ in ours.batches]
    steps_before = ours.steps().clone()
    found_inf = torch.ones(1, device=device)
    ours.step(random_grads(params, 18, 1), flags, grad_scale=torch.full((1,), 8.0, device=device),
              found_inf=found_inf)
    after = params + [a for _, _, a, _ in ours.batches]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert torch.equal(ours.steps(), steps_before)
    ours.step(random_grads(params, 18, 2), flags, found_inf=torch.zeros(1, device=device))
    assert torch.equal(ours.steps(), steps_before + 1)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_and_zero_numel_params(device):
    arena = torch.zeros(0, dtype=torch.uint8, device=device)
    so.fused_adam_packed([], [], arena, torch.zeros(0, len(so.LAYOUT_COLUMNS), dtype=torch.int64),
                         torch.zeros(0, device=device), lr=1e-3)
    flags = AdamFlags()
    params = random_params([0, 5, 0, 33], torch.float32, device, seed=19)
    params[0] = params[0].reshape(0, 4)
    ref = [p.clone().requires_grad_() for p in params]
    opt = flags.torch_optimizer(ref, foreach=False)
    ours = PackedBatches(params, [4], amsgrad=False)
    for step in range(3):
        grads = random_grads(params, 19, step)
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        ours.step(grads, flags)
    assert_states_close(params, ref, opt, ours, flags, **FP32_TOL)


def piece_call(param, start, count, step_index, advance, *, master, amsgrad=True):
    """The op's arguments for elements [start, start + count) of one param: an
    arena of the piece's states and a layout row pointing into the param."""
    state_dtype = torch.float32 if master else None
    layout, nbytes = so.plan_packed_layout([param[start:start + count]], amsgrad=amsgrad, state_dtype=state_dtype,
                                           master_weights=master)
    layout[0, so.LAYOUT_COLUMNS.index("param_offset")] = start
    layout[0, so.LAYOUT_COLUMNS.index("step_index")] = step_index
    layout[0, so.LAYOUT_COLUMNS.index("advance_step")] = int(advance)
    arena = torch.zeros(nbytes, dtype=torch.uint8, device=param.device)
    if master:
        offset = int(layout[0, 3])
        arena[offset:offset + 4 * count].view(torch.float32).copy_(param[start:start + count].float())
    return layout, arena


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pieces_of_a_param_match_the_whole_param_bitwise(device, dtype):
    """A param updated piece by piece (separate calls, pieces at multiples of 256
    elements, the last one partial) sharing one step count that only the last
    piece advances, equals the whole-param update bit for bit, states included."""
    flags = AdamFlags(amsgrad=True)
    master = dtype != torch.float32
    numel, cuts = 70_001, [0, 256 * 50, 256 * 51, 256 * 200, 70_001]
    whole, pieced = (random_params([numel], dtype, device, seed=30)[0] for _ in range(2))
    whole_layout, whole_arena = piece_call(whole, 0, numel, 0, True, master=master)
    pieces = [piece_call(pieced, a, b - a, 1, b == numel, master=master) for a, b in zip(cuts, cuts[1:])]
    whole_steps = torch.zeros(1, device=device)
    pieced_steps = torch.tensor([7.0, 0.0], device=device)  # the param's count is entry 1
    kwargs = dict(lr=flags.lr, betas=flags.betas, eps=flags.eps, weight_decay=flags.weight_decay, amsgrad=True,
                  state_dtype=torch.float32 if master else None)
    for step in range(6):
        grad = random_grads([whole], 30, step)[0]
        so.fused_adam_packed([whole], [grad], whole_arena, whole_layout, whole_steps, **kwargs)
        for k, (layout, arena) in enumerate(pieces):
            so.fused_adam_packed([pieced], [grad], arena, layout, pieced_steps, **kwargs)
            # Pieces before the last read the count without advancing it.
            assert pieced_steps[1].item() == (step + 1 if k == len(pieces) - 1 else step)
    assert torch.equal(pieced, whole)
    assert pieced_steps.tolist() == [7.0, 6.0] and whole_steps.item() == 6.0
    state_dtype = torch.float32 if master else dtype
    for column in (0, 1, 2, 3) if master else (0, 1, 2):
        dtype_here = torch.float32 if column == 3 else state_dtype
        full = PackedBatches._view(whole_arena, int(whole_layout[0, column]), numel, dtype_here)
        for (layout, arena), a, b in zip(pieces, cuts, cuts[1:]):
            part = PackedBatches._view(arena, int(layout[0, column]), b - a, dtype_here)
            assert torch.equal(part, full[a:b])


# param dtype, state dtype (fp32 states come with fp32 masters for 16-bit params)
CUDA_CPU_CASES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "fp16": (torch.float16, None),
                  "bf16 masters": (torch.bfloat16, torch.float32), "fp16 masters": (torch.float16, torch.float32)}


@requires_cuda
@pytest.mark.parametrize("case", list(CUDA_CPU_CASES))
def test_cuda_matches_cpu(case):
    """The same inputs give the same bits on both devices: params, every state
    (the fp32 master of a 16-bit param included) and the step counts, with the
    CUDA kernel's vector accesses (16-byte aligned states) and its scalar ones.
    Adam's L2 term is the one FMA that CUDA contracts and the CPU rounds
    explicitly."""
    dtype, state_dtype = CUDA_CPU_CASES[case]
    flags = AdamFlags(amsgrad=True, decoupled=False)
    master = state_dtype is not None
    inputs = random_params(SIZES, dtype, "cpu", seed=20)
    for alignment, start in ((256, 0), (4, 4)):
        results = {}
        for device in ["cpu", "cuda"]:
            params = [p.to(device, copy=True) for p in inputs]
            ours = PackedBatches(params, [3, len(params) - 3], amsgrad=True, alignment=alignment, start=start,
                                 state_dtype=state_dtype, master_weights=master)
            for step in range(STEPS):
                grads = [g.to(device) for g in random_grads(inputs, 20, step)]
                ours.step(grads, flags, state_dtype=state_dtype)
            states = [ours.state(i, c) for i in range(len(SIZES)) for c in ((0, 1, 2, 3) if master else (0, 1, 2))]
            results[device] = [t.cpu() for t in params + states] + [ours.steps()]
        assert len(results["cpu"]) == len(results["cuda"]) == 1 + len(SIZES) * (5 if master else 4)
        for index, (a, b) in enumerate(zip(results["cpu"], results["cuda"])):
            assert torch.equal(a, b), f"alignment {alignment}: result {index} differs between CPU and CUDA"


def _opcheck_args(device):
    params = random_params([5, 1000, 3], torch.float32, device, seed=21)
    grads = random_grads(params, 21, 0)
    layout, nbytes = so.plan_packed_layout(params, amsgrad=True)
    # The middle row is a piece of its param: elements [256, 1000), step count 3, not advanced.
    columns = so.LAYOUT_COLUMNS
    layout[1, columns.index("numel")] = 744
    layout[1, columns.index("param_offset")] = 256
    layout[1, columns.index("advance_step")] = 0
    layout[:, columns.index("step_index")] = torch.tensor([3, 1, 0])
    arena = torch.rand(nbytes // 4, device=device).view(torch.uint8)
    steps = torch.tensor([0.0, 3.0, 1.0, 5.0], device=device)
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=True,
                  maximize=False, decoupled_weight_decay=True, state_dtype=None,
                  grad_scale=torch.ones(1, device=device), found_inf=torch.zeros(1, device=device))
    return (params, grads, arena, layout, steps), kwargs


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    args, kwargs = _opcheck_args(device)
    torch.library.opcheck(torch.ops.swap_optimizer.fused_adam_packed.default, args, kwargs)


def _compact_opcheck_args(device, kind):
    """One call with compact rows: 8-bit moments (a full param and a piece from
    element 256), bf16 moments rounded stochastically, or a bf16 param with a
    Kahan buffer; states filled with valid random values."""
    columns = so.LAYOUT_COLUMNS
    dtype = torch.bfloat16 if kind == "kahan" else torch.float32
    params = random_params([5000, 700], dtype, device, seed=22)
    grads = random_grads(params, 22, 0)
    state_size = {"8bit": 1, "bf16": 2, "kahan": 4}[kind]
    rows, cursor, fills = [], 0, []

    def take(nbytes, fill):
        nonlocal cursor
        cursor = -(-cursor // 256) * 256
        fills.append((cursor, nbytes, fill))
        cursor += nbytes
        return cursor - nbytes

    for index, p in enumerate(params):
        offset = 256 if index == 0 else 0
        count = p.numel() - offset
        row = [so.ops.ABSENT] * len(columns)
        row[columns.index("numel")], row[columns.index("param_offset")] = count, offset
        row[columns.index("step_index")], row[columns.index("advance_step")] = index, 1
        row[columns.index("random_key")], row[columns.index("global_offset")] = index, 1000 + offset
        for key in ("exp_avg", "exp_avg_sq"):
            row[columns.index(key)] = take(count * state_size, "codes" if kind == "8bit" else key)
            if kind == "8bit":
                row[columns.index(f"{key}_absmax")] = take(-(-count // 256) * 4, "absmax")
        if kind == "kahan":
            row[columns.index("compensation")] = take(count * 2, "compensation")
        rows.append(row)
    arena = torch.zeros(cursor, dtype=torch.uint8)
    g = torch.Generator().manual_seed(23)
    for start, nbytes, fill in fills:
        region = arena[start:start + nbytes]
        if fill == "codes":
            region.copy_(torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8))
        elif fill == "absmax":
            region.view(torch.float32).copy_(torch.rand(nbytes // 4, generator=g) * 1e-2)
        else:
            target = torch.bfloat16 if fill == "compensation" or state_size == 2 else torch.float32
            scale = {"exp_avg": 1e-2, "exp_avg_sq": 1e-4, "compensation": 1e-6}[fill]
            values = torch.rand(nbytes // target.itemsize, generator=g) * scale
            region.view(target).copy_(values.to(target))
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False,
                  decoupled_weight_decay=True, state_dtype={"8bit": torch.uint8, "bf16": torch.bfloat16,
                                                            "kahan": torch.float32}[kind],
                  grad_scale=None, found_inf=None, rounding_seed=77 if kind == "bf16" else None)
    layout = torch.tensor(rows, dtype=torch.int64)
    return (params, grads, arena.to(device), layout, torch.tensor([2.0, 5.0], device=device)), kwargs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["8bit", "bf16", "kahan"])
def test_opcheck_compact_rows(device, kind):
    args, kwargs = _compact_opcheck_args(device, kind)
    torch.library.opcheck(torch.ops.swap_optimizer.fused_adam_packed.default, args, kwargs)
    arena_before = args[2].clone()
    so.fused_adam_packed(*args[:5], lr=kwargs["lr"], betas=(0.9, 0.999), weight_decay=0.01,
                         state_dtype=kwargs["state_dtype"], rounding_seed=kwargs["rounding_seed"])
    assert not torch.equal(arena_before, args[2]), "the call updated the states"
