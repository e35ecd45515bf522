"""scripts/gpu_check.sh is the one run a lent GPU gets, so what it must do is
checked here, where no GPU is: it imports the installed build (python -P,
never the source folder, which has no extension), requires the CUDA kernels,
selects every GPU test (the pinning-failure one included), fits in 6 minutes
with its own time limits, racechecks only the 8-bit kernel (the delay tests
cover the streams' ordering), gives the benchmark arguments it accepts, and
its embedded Python runs: the sanitizer runs on the CPU backend (device names
swapped), where their asserts that the 8-bit kernel ran must hold too, and
the memory-target check on reports within and over its bound."""

import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from swap_optimizer.bench.__main__ import check_arguments, parser

SCRIPT = (pathlib.Path(__file__).parent.parent / "scripts" / "gpu_check.sh").read_text()


def embedded_python(variable: str) -> str:
    """The Python the script writes to the file named by $variable."""
    return SCRIPT.split(f'cat >"${variable}" <<\'PYEOF\'\n')[1].split("\nPYEOF\n")[0]


def run_python(source: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", source, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_every_python_run_imports_the_installed_build():
    runs = [line for line in SCRIPT.splitlines() if re.search(r'"\$PY" ', line) and "pip install" not in line]
    assert runs
    for line in runs:
        assert re.search(r'"\$PY" (-P|- "\$OUT")', line), f"runs without -P: {line.strip()}"


def test_it_requires_the_cuda_kernels_and_selects_every_gpu_test():
    assert "export SWAP_OPTIMIZER_REQUIRE_CUDA_BUILD=1" in SCRIPT
    words = re.split(r"\s+or\s+", re.search(r'-k "([^"]+)"', SCRIPT).group(1))
    # Every test that needs a GPU (marked requires_cuda, or a cuda-only skip), and the build check.
    gpu_only = []
    for source in pathlib.Path(__file__).parent.glob("test_*.py"):
        gpu_only += re.findall(r"@requires_cuda\n(?:@.*\n)*def (\w+)", source.read_text())
    assert len(gpu_only) >= 5
    for name in gpu_only + ["test_cuda_kernels_compiled_when_torch_is_a_cuda_build",
                            "test_random_delays_change_nothing[copies-2-cuda]",
                            "test_random_delays_change_nothing[updates-2-cuda]"]:
        assert any(word in name for word in words), f"{name} is not selected by -k {words}"


def test_its_stages_fit_in_six_minutes_and_racecheck_runs_only_the_8bit_kernel():
    stages = re.findall(r'^stage ("[^"]+"|\S+) (\d+) ', SCRIPT, flags=re.M)
    limits = [int(limit) for _, limit in stages]
    # Under 360 s with 10 s for what runs outside stages (nvidia-smi, two imports, the summary).
    assert len(limits) >= 8 and sum(limits) <= 350, stages
    assert "overlap-memory" in [name for name, _ in stages] and "cost-model" in [name for name, _ in stages]
    # The one kernel with shared memory (CUB block reductions) gets a racecheck, on one small step.
    assert SCRIPT.count("--tool racecheck") == 1 and '"$racecheck_run"' in SCRIPT
    racecheck_source = embedded_python("racecheck_run")
    assert "state_dtype=torch.uint8" in racecheck_source and "opt.step()" in racecheck_source


def bench_invocations():
    """The argument lists the script passes to python -m swap_optimizer.bench."""
    arrays = {name: shlex.split(body) for name, body in re.findall(r"^(\w+)=\(([^)]*)\)$", SCRIPT, flags=re.M)}
    joined = SCRIPT.replace("\\\n", " ")
    invocations = []
    for line in joined.splitlines():
        if line.startswith("stage ") and "-m swap_optimizer.bench" in line:
            words = []
            for word in shlex.split(line.split("-m swap_optimizer.bench", 1)[1]):
                array = re.fullmatch(r"\$\{(\w+)\[@\]\}", word)
                words += arrays[array.group(1)] if array else [word]
            invocations.append(words)
    return invocations


def test_its_benchmark_arguments_pass_the_benchmarks_own_checks():
    invocations = bench_invocations()
    assert len(invocations) == 2
    for words in invocations:
        p = parser()
        args = p.parse_args(words)
        check_arguments(p, args)  # p.error exits: a SystemExit fails the test
        assert args.device.type == "cuda" and args.json


def test_its_bench_argument_check_catches_what_failed_there():
    """check_arguments is what the script's first GPU run tripped on (5
    repeats without --quick)."""
    p = parser()
    with pytest.raises(SystemExit):
        check_arguments(p, p.parse_args(["--device", "cpu", "--preset", "1.3b", "--repeats", "5"]))


@pytest.mark.parametrize("variable", ["sanitizer_run", "racecheck_run"])
def test_its_sanitizer_runs_run_on_the_cpu_backend(variable, tmp_path):
    """The same Python on the host backend: its shapes reach the paths it
    asserts (split params, 8-bit codes, partial blocks), so on the GPU only the
    sanitizers can fail it."""
    source = embedded_python(variable)
    assert 'device="cuda"' in source and "torch.cuda.synchronize()" in source
    source = source.replace(".cuda()", "").replace('device="cuda"', 'device="cpu"')
    source = source.replace("torch.cuda.synchronize()", "None")
    result = run_python(source, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "run done" in result.stdout


def test_its_memory_check_passes_within_the_bound_and_fails_over_it(tmp_path):
    source = embedded_python("memory_check")
    gib = 2 ** 30
    block, arena_set, plain = gib // 16, gib, 20 * gib

    def report(overlap_peak):
        rows = [{"mode": "resident", "overlap": False, "loop_peak_bytes": 24 * gib},
                {"mode": "swap s8 a3", "overlap": False, "loop_peak_bytes": plain, "peak_staging_bytes": arena_set},
                {"mode": "swap s8 a3 overlap", "overlap": True, "loop_peak_bytes": overlap_peak,
                 "peak_staging_bytes": arena_set}]
        path = tmp_path / f"report_{overlap_peak}.json"
        path.write_text(json.dumps({"model": {"block_param_bytes": block}, "modes": rows}))
        return str(path)

    within = run_python(source, report(plain + arena_set + block), cwd=tmp_path)
    assert within.returncode == 0, within.stderr
    assert "within the bound" in within.stdout and "loop peak 21.062 GiB" in within.stdout
    over = run_python(source, report(plain + arena_set + block + 1), cwd=tmp_path)
    assert over.returncode != 0 and "over the bound: ['swap s8 a3 overlap']" in over.stderr


def test_its_cost_model_check_runs_on_the_cpu_backend(tmp_path):
    """The predicted-against-measured table on the host backend (64K-element
    params): it runs every plan and reports; the 25% assert is the GPU's."""
    source = embedded_python("cost_check")
    assert 'if device == "cuda":' in source and "0.75 <= r[\"ratio\"] <= 1.25" in source
    result = run_python(source, "cpu", "65536", str(tmp_path / "cost.json"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "cost.json").read_text())["rows"]
    assert len(rows) == 8 and {r["swap_times"] for r in rows} == {4, 16}
    for none, half in zip(rows[::2], rows[1::2]):  # per (swap_times, num_arenas): share 0, then half the state
        assert (none["swap_times"], none["num_arenas"]) == (half["swap_times"], half["num_arenas"])
        assert half["resident_share"] > none["resident_share"] and half["h2d_bytes"] < none["h2d_bytes"]
    assert "| swap_times | num_arenas | resident share |" in result.stdout
