"""scripts/gpu_check.sh is the one run a lent GPU gets, so what it must do is
checked here, where no GPU is: it imports the installed build (python -P,
never the source folder, which has no extension), requires the CUDA kernels,
selects every GPU test (the pinning-failure one included), fits in 6 minutes
with its own time limits, and racechecks only the 8-bit kernel (the copy-delay
test covers the streams' ordering)."""

import pathlib
import re

SCRIPT = (pathlib.Path(__file__).parent.parent / "scripts" / "gpu_check.sh").read_text()


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
                            "test_random_copy_delays_change_nothing[cuda-2]"]:
        assert any(word in name for word in words), f"{name} is not selected by -k {words}"


def test_its_stages_fit_in_six_minutes_and_racecheck_runs_only_the_8bit_kernel():
    limits = [int(limit) for limit in re.findall(r'^stage (?:"[^"]+"|\S+) (\d+) ', SCRIPT, flags=re.M)]
    assert len(limits) >= 6 and sum(limits) <= 350, limits
    # The one kernel with shared memory (CUB block reductions) gets a racecheck, on one small step.
    assert SCRIPT.count("--tool racecheck") == 1 and '"$racecheck_run"' in SCRIPT
    racecheck_source = SCRIPT.split('racecheck_run=$(mktemp --suffix=.py)')[1].split("PYEOF")[1]
    assert "state_dtype=torch.uint8" in racecheck_source and "opt.step()" in racecheck_source
