"""The codec ops (swap_optimizer.codec): blockwise 8-bit decode/encode against
swap_optimizer.compact's torch reference, bitwise; the rounding rules; bf16
stochastic rounding (deterministic, unbiased, independent of cuts and order);
validation; opcheck; CUDA against the CPU, bitwise."""

import pytest
import torch

from conftest import DEVICES, requires_cuda
from swap_optimizer import codec, compact

# Sizes: one element, a block less one, one block, a block and one, a tail,
# and several of the ops' 4096-element chunks with a tail.
SIZES = [1, 255, 256, 257, 1000, 2 * 4096 + 300]
# (map, rounding) -> the reference's moment name (None: nearest into the unsigned map).
FORMS = {("signed", "nearest"): "exp_avg", ("unsigned", "nonzero"): "exp_avg_sq",
         ("unsigned", "up"): "max_exp_avg_sq", ("unsigned", "nearest"): None}
VALUE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_values(numel, seed, dtype=torch.float32, positive=False):
    """Magnitudes over many decades, a zero block, zeros, NaN, +-inf (the inf
    in its own block so other blocks keep finite scales)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 4)
    if positive:
        v = v.abs()
    if numel >= 1000:
        v[256:512] = 0.0
        v[600] = float("nan")
        v[601] = 0.0
        v[700:768] = 1e-30
    if numel > 4096:
        v[4100] = float("inf")
        v[4400] = -float("inf") if not positive else float("inf")
    return v.to(dtype)


def reference_quantize(values, form):
    moment = FORMS[form]
    if moment is not None:
        return compact.quantize(values, moment)
    # Nearest into the unsigned map: exp_avg_sq's rule without the step up from 0.
    codes, absmax = compact.quantize(values, "exp_avg_sq")
    flat = values.reshape(-1).float()
    scale = absmax.repeat_interleave(compact.BLOCK_SIZE)[:flat.numel()]
    normalized = torch.where(scale > 0, flat / scale, torch.zeros(()))
    table = compact.code_map("exp_avg_sq")
    nearest = torch.bucketize(normalized, (table[:-1] + table[1:]) / 2)
    nearest = torch.where(normalized.isnan(), 0, nearest)
    return nearest.to(torch.uint8).reshape(values.shape), absmax


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def encode(values, forms, device):
    codes = [torch.full(v.shape, 77, dtype=torch.uint8, device=device) for v in values]
    absmax = [torch.full((-(-v.numel() // 256),), -1.0, device=device) for v in values]
    codec.encode_blockwise_8bit([v.to(device) for v in values], codes, absmax, [f[0] for f in forms],
                                [f[1] for f in forms])
    return codes, absmax


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", list(FORMS))
def test_encode_matches_reference_bitwise(device, form):
    # Every size and value dtype in one call.
    values = [random_values(n, seed=10 * i + len(form[1]), dtype=VALUE_DTYPES[i % 3], positive=form[0] == "unsigned")
              for i, n in enumerate(SIZES)]
    values.append(random_values(1000, seed=99, dtype=torch.float32).reshape(10, 100))  # any shape, flat order
    codes, absmax = encode(values, [form] * len(values), device)
    for index, v in enumerate(values):
        ref_codes, ref_absmax = reference_quantize(v, form)
        assert torch.equal(bits(absmax[index].cpu()), bits(ref_absmax)), f"tensor {index}: absmax"
        assert torch.equal(codes[index].cpu(), ref_codes), f"tensor {index}: codes"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", VALUE_DTYPES)
def test_decode_matches_reference_bitwise(device, out_dtype):
    g = torch.Generator().manual_seed(5)
    codes = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in SIZES]
    absmax = [torch.rand(-(-n // 256), generator=g) * 10 ** torch.randint(-8, 8, (-(-n // 256),), generator=g)
              for n in SIZES]
    absmax[-1][0] = 0.0
    absmax[-1][1] = float("inf")
    maps = ["signed", "unsigned"] * 3
    out = [torch.empty(n, dtype=out_dtype, device=device) for n in SIZES]
    codec.decode_blockwise_8bit([c.to(device) for c in codes], [a.to(device) for a in absmax], out, maps)
    for index, (c, a, m) in enumerate(zip(codes, absmax, maps)):
        ref = compact.dequantize(c, a, "exp_avg" if m == "signed" else "exp_avg_sq").to(out_dtype)
        assert torch.equal(bits(out[index].cpu()), bits(ref)), f"tensor {index}"


@pytest.mark.parametrize("device", DEVICES)
def test_encode_decode_round_trip_and_values_dtype(device):
    """Decoding what was encoded gives back the map's values; a bf16 input
    encodes like its float32 widening."""
    v = random_values(3000, seed=3)
    v = v[v.isfinite()]
    codes, absmax = encode([v, v.to(torch.bfloat16), v.to(torch.bfloat16).float()], [("signed", "nearest")] * 3,
                           device)
    assert torch.equal(codes[1], codes[2]) and torch.equal(absmax[1], absmax[2])
    out = [torch.empty(v.shape, device=device)]
    codec.decode_blockwise_8bit(codes[:1], absmax[:1], out, ["signed"])
    assert torch.allclose(out[0].cpu(), v, rtol=0.15, atol=float(absmax[0].max()) * 2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_nonzero_rule_keeps_small_positive_values_off_zero(device):
    """A tiny positive value beside a large one: nearest gives it 0, the
    denominator rule the smallest positive code; 0 and negatives keep 0."""
    v = torch.full((512,), 1e-12)
    v[0] = 1.0
    v[1] = 0.0
    v[2] = -1e-12
    v[300] = 5.0
    codes, absmax = encode([v, v], [("unsigned", "nearest"), ("unsigned", "nonzero")], device)
    nearest, nonzero = codes[0].cpu(), codes[1].cpu()
    assert (nearest[3:256] == 0).all()
    assert (nonzero[3:256] == 1).all() and (nonzero[256:300] == 1).all()
    assert nonzero[1] == 0 and nonzero[2] == 0
    out = [torch.empty(512, device=device)]
    codec.decode_blockwise_8bit(codes[1:], absmax[1:], out, ["unsigned"])
    assert (out[0].cpu()[3:] > 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_round_up_rule_never_decodes_below(device):
    v = random_values(5000, seed=8, positive=True)
    v = v[v.isfinite()]
    codes, absmax = encode([v, v], [("unsigned", "up"), ("unsigned", "nearest")], device)
    out = [torch.empty(v.shape, device=device), torch.empty(v.shape, device=device)]
    codec.decode_blockwise_8bit(codes, absmax, out, ["unsigned", "unsigned"])
    assert (out[0].cpu() >= v).all(), "round-up fell below a value"
    assert (out[1].cpu() < v).any(), "nearest never rounded down: the check above proves nothing"


def encode_bf16(values, keys, device, seed=1234):
    """keys: per tensor (param_index, state_index, global_offset, step)."""
    out = [torch.empty(v.shape, dtype=torch.bfloat16, device=device) for v in values]
    codec.encode_bf16_stochastic([v.to(device) for v in values], out, seed=seed,
                                 param_index=[k[0] for k in keys], state_index=[k[1] for k in keys],
                                 global_offset=[k[2] for k in keys], step=[k[3] for k in keys])
    return [o.cpu() for o in out]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_stochastic_is_deterministic_and_keyed(device):
    v = random_values(10000, seed=4)
    first = encode_bf16([v], [(3, 1, 0, 7)], device)[0]
    assert torch.equal(bits(first), bits(encode_bf16([v], [(3, 1, 0, 7)], device)[0]))
    for keys, seed in [((3, 1, 0, 7), 1235), ((4, 1, 0, 7), 1234), ((3, 2, 0, 7), 1234), ((3, 1, 0, 8), 1234),
                       ((3, 1, 1, 7), 1234)]:
        other = encode_bf16([v], [keys], device, seed=seed)[0]
        assert not torch.equal(bits(first), bits(other)), f"keys {keys}, seed {seed} gave the same rounding"
    # Each element is one of its two bf16 neighbours; NaN, inf and exact bf16 values round as to nearest.
    finite = v.isfinite()
    down = v.to(torch.bfloat16).float()
    assert ((first.float() - v).abs()[finite] <= (v.abs() * 2.0 ** -7)[finite]).all()
    assert torch.equal(bits(first[v.isinf()]), bits(v[v.isinf()].to(torch.bfloat16)))
    assert first[v.isnan()].isnan().all()
    exact = down[finite]
    assert torch.equal(bits(encode_bf16([exact], [(0, 0, 0, 1)], device)[0]), bits(exact.to(torch.bfloat16)))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_stochastic_is_unbiased(device):
    """x a quarter... of an ulp above a bf16 value rounds up with probability
    0.3: over n = 200,000 elements the fraction rounded up is within 5
    standard deviations (5 * sqrt(0.3 * 0.7 / n) = 0.0051) of 0.3, and the mean
    of random values' rounding errors within 5 standard errors of 0."""
    n = 200_000
    ulp = 2.0 ** -7
    x = torch.full((n,), 1.0 + 0.3 * ulp)
    rounded = encode_bf16([x], [(0, 0, 0, 1)], device)[0].float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + ulp}
    up = (rounded > 1.0).double().mean().item()
    assert abs(up - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5
    v = torch.rand(n, generator=torch.Generator().manual_seed(6)) + 1.0  # ulp 2^-7 throughout
    error = (encode_bf16([v], [(1, 0, 0, 2)], device)[0].double() - v.double()) / ulp
    assert abs(error.mean().item()) < 5 * error.std().item() / n ** 0.5
    nearest_error = (v.to(torch.bfloat16).double() - v.double()) / ulp
    assert error.abs().mean() > nearest_error.abs().mean()  # it is not rounding to nearest


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_stochastic_bits_are_the_generators_beyond_two_to_the_32(device):
    """The op's rounding is the reference generator's (test_compact_states:
    lowbias32 over the element index's two 32-bit halves and the step), also
    for elements past 2^32 (a state of a model with more elements than that),
    whose high half makes other bits than the same low half's."""
    from test_compact_states import ref_stochastic_bf16
    v = random_values(5000, seed=12)
    for offset in (0, 2 ** 32 - 2500, 3 * 2 ** 32 + 17):
        encoded = encode_bf16([v], [(7, 2, offset, 9)], device)[0]
        reference = ref_stochastic_bf16(v, 1234, 7, 2, 9, first_index=offset)
        finite = v.isfinite()
        assert torch.equal(bits(encoded[finite]), bits(reference[finite])), f"offset {offset}"
    low_only = encode_bf16([v], [(7, 2, 17, 9)], device)[0]
    high_too = encode_bf16([v], [(7, 2, 3 * 2 ** 32 + 17, 9)], device)[0]
    assert not torch.equal(bits(low_only), bits(high_too))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_stochastic_whole_equals_pieces_in_any_order(device):
    v = random_values(3 * 4096 + 77, seed=9)
    w = random_values(600, seed=10)
    whole, other = encode_bf16([v, w], [(2, 3, 0, 11), (5, 0, 0, 11)], device)
    cuts = [0, 1, 4000, 4097, 9000, v.numel()]
    pieces = [v[a:b] for a, b in zip(cuts, cuts[1:])]
    keys = [(2, 3, a, 11) for a in cuts[:-1]]
    # The pieces reversed and interleaved with the other tensor.
    encoded = encode_bf16([w] + pieces[::-1], [(5, 0, 0, 11)] + keys[::-1], device)
    assert torch.equal(bits(encoded[0]), bits(other))
    assert torch.equal(bits(torch.cat(encoded[1:][::-1])), bits(whole))


def _bad_calls(device):
    """(call, message fragment) pairs, each with one problem in tensor 1."""
    f = dict(device=device)
    v = [torch.randn(300, **f), torch.randn(300, **f)]
    c = [torch.zeros(300, dtype=torch.uint8, **f) for _ in range(2)]
    a = [torch.zeros(2, **f) for _ in range(2)]
    o = [torch.zeros(300, **f) for _ in range(2)]
    b = [torch.zeros(300, dtype=torch.bfloat16, **f) for _ in range(2)]
    enc = torch.ops.swap_optimizer.encode_blockwise_8bit
    dec = torch.ops.swap_optimizer.decode_blockwise_8bit
    bf16 = torch.ops.swap_optimizer.encode_bf16_stochastic
    keys = dict(seed=1, param_index=[0, 1], state_index=[0, 0], global_offset=[0, 0], step=[1, 1])
    return [
        (lambda: enc(v, c, a, [0, 1], [0]), "2 tensors but 1 rounding"),
        (lambda: enc(v, c[:1] + [c[1].float()], a, [0, 1], [0, 0]), "tensor 1: codes is Float"),
        (lambda: enc(v, c, a[:1] + [torch.zeros(3, **f)], [0, 1], [0, 0]), "ceil(300 / 256) = 2"),
        (lambda: enc(v, c[:1] + [c[1][:299]], a, [0, 1], [0, 0]), "tensor 1: values has 300 elements"),
        (lambda: enc(v[:1] + [torch.randn(600, **f)[::2]], c, a, [0, 1], [0, 0]), "tensor 1: values is not contiguous"),
        (lambda: enc(v, c, a, [0, 0], [0, 2]), "needs the unsigned map"),
        (lambda: enc(v, c, a, [0, 2], [0, 0]), "tensor 1: code_map 2"),
        (lambda: enc(v, c, a, [0, 1], [0, 3]), "tensor 1: rounding 3"),
        (lambda: enc(v, [c[0], c[0]], a, [0, 1], [0, 0]), "overlaps"),
        (lambda: dec(c, a, o[:1] + [torch.zeros(300, dtype=torch.float64, **f)], [0, 1]), "tensor 1: out is Double"),
        (lambda: dec(c, a[:1] + [torch.zeros(1, **f)], o, [0, 1]), "tensor 1: absmax has 1 elements"),
        (lambda: bf16(v, b, **{**keys, "state_index": [0, 4]}), "state_index 4 is outside 0..3"),
        (lambda: bf16(v, b, **{**keys, "state_index": [0, -1]}), "state_index -1 is outside 0..3"),
        (lambda: bf16(v, b, **{**keys, "global_offset": [0, -5]}), "global_offset -5"),
        (lambda: bf16(v, b[:1] + [o[1]], **keys), "tensor 1: out is Float"),
        (lambda: bf16(v, b, **{**keys, "step": [1]}), "2 tensors but 1 step"),
    ], (v, c, a, o, b)


@pytest.mark.parametrize("device", DEVICES)
def test_validation_names_the_tensor_and_writes_nothing(device):
    calls, tensors = _bad_calls(device)
    before = [[t.clone() for t in group] for group in tensors]
    for call, fragment in calls:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            call()
    for group, saved in zip(tensors, before):
        for t, s in zip(group, saved):
            assert torch.equal(bits(t), bits(s)), "a refused call wrote"


@requires_cuda
def test_tensors_on_two_devices_are_refused():
    with pytest.raises(ValueError, match="tensor 0: absmax is on cpu"):
        torch.ops.swap_optimizer.decode_blockwise_8bit(
            [torch.zeros(10, dtype=torch.uint8, device="cuda")], [torch.zeros(1)],
            [torch.zeros(10, device="cuda")], [0])


def test_wrapper_names_unknown_forms():
    with pytest.raises(ValueError, match="tensor 0: rounding 'down'"):
        codec.encode_blockwise_8bit([torch.zeros(3)], [torch.zeros(3, dtype=torch.uint8)], [torch.zeros(1)],
                                    ["unsigned"], ["down"])
    with pytest.raises(ValueError, match="lists of different lengths"):
        codec.decode_blockwise_8bit([torch.zeros(3, dtype=torch.uint8)], [], [torch.zeros(3)], ["signed"])
    codec.encode_bf16_stochastic([], [], seed=0, param_index=[], state_index=[], global_offset=[], step=[])


def _opcheck_cases(device):
    f = dict(device=device)
    g = torch.Generator().manual_seed(2)
    values = [torch.randn(n, generator=g).to(device, dtype) for n, dtype in zip([300, 700, 5000], VALUE_DTYPES)]
    codes = [torch.zeros(v.shape, dtype=torch.uint8, **f) for v in values]
    absmax = [torch.zeros(-(-v.numel() // 256), **f) for v in values]
    return {
        "encode_8bit": (torch.ops.swap_optimizer.encode_blockwise_8bit.default,
                        (values, codes, absmax, [0, 1, 1], [0, 1, 2]), {}),
        "decode_8bit": (torch.ops.swap_optimizer.decode_blockwise_8bit.default,
                        ([torch.randint(0, 256, c.shape, dtype=torch.uint8, generator=g).to(device) for c in codes],
                         [torch.rand(a.shape, generator=g).to(device) for a in absmax],
                         [torch.empty_like(v) for v in values], [0, 1, 0]), {}),
        "bf16": (torch.ops.swap_optimizer.encode_bf16_stochastic.default,
                 ([v.float() for v in values], [torch.empty(v.shape, dtype=torch.bfloat16, **f) for v in values],
                  7, [0, 1, 2], [0, 3, 1], [0, 10, 0], [1, 2, 3]), {}),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["encode_8bit", "decode_8bit", "bf16"])
def test_opcheck(device, case):
    op, args, kwargs = _opcheck_cases(device)[case]
    torch.library.opcheck(op, args, kwargs)


@requires_cuda
@pytest.mark.parametrize("form", list(FORMS))
def test_cuda_bits_equal_cpu_bits(form):
    values = [random_values(n, seed=40 + i, dtype=VALUE_DTYPES[i % 3], positive=form[0] == "unsigned")
              for i, n in enumerate(SIZES + [100_003])]
    forms = [form] * len(values)
    cpu_codes, cpu_absmax = encode(values, forms, "cpu")
    cuda_codes, cuda_absmax = encode(values, forms, "cuda")
    for index in range(len(values)):
        assert torch.equal(cuda_codes[index].cpu(), cpu_codes[index]), f"tensor {index}: codes"
        assert torch.equal(bits(cuda_absmax[index].cpu()), bits(cpu_absmax[index])), f"tensor {index}: absmax"
    for dtype in VALUE_DTYPES:
        outs = {}
        for device in ("cpu", "cuda"):
            out = [torch.empty(v.shape, dtype=dtype, device=device) for v in values]
            codec.decode_blockwise_8bit([c.to(device) for c in cpu_codes], [a.to(device) for a in cpu_absmax], out,
                                        [form[0]] * len(values))
            outs[device] = [o.cpu() for o in out]
        for a, b in zip(outs["cpu"], outs["cuda"]):
            assert torch.equal(bits(a), bits(b)), f"decode into {dtype}"
    floats = [v.float() for v in values]
    keys = [(i, i % 4, 1000 * i, 3) for i in range(len(values))]
    for a, b in zip(encode_bf16(floats, keys, "cpu"), encode_bf16(floats, keys, "cuda")):
        assert torch.equal(bits(a), bits(b)), "bf16 stochastic rounding"


# capability -> the compiler flags its build of tests/cpp/code_search_exhaustive.cpp needs
SEARCH_BUILDS = {"DEFAULT": [], "AVX2": ["-mavx2", "-mfma"],
                 "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]}


def _cpu_lacks(flags: list[str]) -> bool:
    """Whether /proc/cpuinfo (where there is one) lacks any of these
    -m flags' features: such a build may stop on SIGILL anywhere, before
    the program's own check."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        return False  # the program checks for itself
    return not {flag[2:] for flag in flags} <= set(line.split(":", 1)[1].split())


@pytest.mark.slow  # 2^32 floats x 3 tables: about 2 minutes for DEFAULT, 30 s for each ISA's lanes
@pytest.mark.parametrize("capability", list(SEARCH_BUILDS))
def test_host_code_search_for_every_float(tmp_path, capability):
    """The CPU loops find codes with bucket tables (state_codec.h,
    count_below; its AVX2 and AVX-512 lanes in cpu/code_lanes.h), the CUDA
    kernels with a binary search: a C++ program compares the table's search
    with the binary search (DEFAULT) and each ISA's lanes with the table's
    search, for every float bit pattern."""
    import shutil
    import subprocess
    from pathlib import Path
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ on this machine")
    if _cpu_lacks(SEARCH_BUILDS[capability]):
        pytest.skip(f"this CPU has no {capability}")
    root = Path(__file__).resolve().parents[2]
    binary = tmp_path / "code_search_exhaustive"
    subprocess.run([compiler, "-std=c++17", "-O2", f"-I{root / 'csrc'}", *SEARCH_BUILDS[capability],
                    f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
                    str(root / "csrc/kernels/state_codec.cpp"), str(root / "tests/cpp/code_search_exhaustive.cpp"),
                    "-o", str(binary)], check=True)
    out = subprocess.run([str(binary)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    if "lacks the instructions" in out.stdout:
        pytest.skip(f"this CPU has no {capability}")
    agree = "all 2^32 floats agree" if capability == "DEFAULT" else "lanes agree for all 2^32 floats"
    assert out.stdout.count(agree) == 3, out.stdout
