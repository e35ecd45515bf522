"""scripts/gpu_check.sh is the one run a lent GPU gets, so what it must do is
checked here, where no GPU is.

Statically: it imports the installed build (python -P, never the source
folder, which has no extension), requires the CUDA kernels, runs its stages in
the order of what they prove (build and devices, the main job, the parity set,
the benchmarks, the sanitizers last) with limits that add up to 6.5 minutes at
most, the build included, names parity tests that exist (collected here) and
covers each optimizer family and mode with them, runs the delay tests on their
own, racechecks only the 8-bit kernel, gives the benchmark arguments it
accepts, and leaves at most 8 files in $OUT (what the device tool brings back).

Its embedded Python runs here: the import check, the auto-budget check and the
sanitizer runs on the CPU backend, the memory-target and cost-model checks,
the recorder that writes gpu_check.json, and the summary.

And the whole script runs here with stand-ins for python3, nvidia-smi and
compute-sanitizer (a bash script that fakes the build, pytest, the bench and
the embedded programs, and passes the script's own bookkeeping to the real
Python): every stage is recorded in gpu_check.json as it ends, a refused
sanitizer is "not run", a failing stage does not stop the later ones, a failed
build leaves them "not run: build failed", and the exit status says which."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import swap_optimizer
from swap_optimizer.bench.__main__ import check_arguments, parser
import conftest

ROOT = pathlib.Path(conftest.ROOT)
SCRIPT_PATH = ROOT / "scripts" / "gpu_check.sh"
SCRIPT = SCRIPT_PATH.read_text()
# The order the stages prove things in: the build and the devices, the main
# job, the parity set, the benchmarks, the sanitizers last.
STAGE_GROUPS = [["build", "import", "devices"], ["main-job"], ["parity", "parity-delays", "auto-budget"],
                ["bench-bf16", "bench-overlap", "overlap-memory", "cost-model", "host-overhead"],
                ["memcheck", "racecheck"]]
STAGE_ORDER = [name for group in STAGE_GROUPS for name in group]
SANITIZERS = ["memcheck", "racecheck"]


def embedded_python(variable: str) -> str:
    """The Python the script writes to the file named by $variable."""
    return SCRIPT.split(f'cat >"${variable}" <<\'PYEOF\'\n')[1].split("\nPYEOF\n")[0]


def run_python(source: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", source, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def bash_array(name: str) -> list[str]:
    """The words of `NAME=( ... )` in the script (comments dropped)."""
    one_line = re.search(rf"^{name}=\(([^\n]*)\)(?:\s+#.*)?$", SCRIPT, flags=re.M)
    body = one_line or re.search(rf"^{name}=\(\n(.*?)^\)$", SCRIPT, flags=re.M | re.S)
    return shlex.split(body.group(1), comments=True)


def stage_lines() -> list[tuple[str, int, str]]:
    """(name, limit, command) of each `stage` call, in the script's order."""
    joined = SCRIPT.replace("\\\n", " ")
    found = re.findall(r"^stage((?: --refusable| --needs \S+)*) (\S+) (\d+) (\S+) (.*)$", joined, flags=re.M)
    return [(name, int(limit), command) for _, name, limit, _, command in found]


def expand(words: list[str]) -> list[str]:
    arrays = {name: bash_array(name) for name in re.findall(r"^(\w+)=\(", SCRIPT, flags=re.M)}
    out = []
    for word in words:
        array = re.fullmatch(r"\$\{(\w+)\[@\]\}", word)
        out += arrays[array.group(1)] if array else [word]
    return out


# ------------------------------------------------------------------ static


def test_every_python_run_imports_the_installed_build():
    runs = [line for line in SCRIPT.replace("\\\n", " ").splitlines()
            if '"$PY" ' in line and "pip install" not in line and not line.lstrip().startswith("#")]
    assert len(runs) >= 10
    for line in runs:
        first = line.split('"$PY" ', 1)[1].split()[0]
        assert first == "-P" or first == '"${PYTEST[@]}"' and bash_array("PYTEST")[0] == "-P", \
            f"runs without -P: {line.strip()}"
    # pytest-xdist's workers start without -P: PYTHONSAFEPATH is what keeps the source folder off their path.
    assert SCRIPT.index("export PYTHONSAFEPATH=1") < SCRIPT.index("stage import ")


def test_it_requires_the_cuda_kernels_and_reports_what_it_ran_on(tmp_path):
    assert "export SWAP_OPTIMIZER_REQUIRE_CUDA_BUILD=1" in SCRIPT and "TORCH_CUDA_ARCH_LIST:-9.0" in SCRIPT
    devices = next(command for name, _, command in stage_lines() if name == "devices")
    assert "tests/runtime/test_devices.py" in devices and "test_cuda_kernels_compiled_when_torch_is_a_cuda_build" in devices
    source = embedded_python("import_check")
    assert 'assert so.built_with_cuda()' in source and 'assert torch.cuda.is_available()' in source
    result = run_python(source, "cpu", cwd=tmp_path)
    if not swap_optimizer.built_with_cuda():  # a CPU-only build here: the check refuses it, as it must there
        assert result.returncode != 0 and "no CUDA kernels in this build" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.split("GPU_CHECK_FIGURES ", 1)[1])
    assert figures["torch"] and "cuda" in figures and figures["build_info"]["cuda_kernels"] is True


def test_its_stages_run_in_order_and_their_limits_fit_in_six_and_a_half_minutes():
    stages = stage_lines()
    assert [name for name, _, _ in stages] == STAGE_ORDER
    limits = {name: limit for name, limit, _ in stages}
    # Under 390 s with 10 s for what runs outside stages (nvidia-smi, the bookkeeping, the summary): a
    # rerun still fits the 15 minutes with a machine start of 1-2 minutes.
    assert sum(limits.values()) <= 380, limits
    assert f"LIMITS_SUM={sum(limits.values())}\n" in SCRIPT
    # The header lists the same stages and limits, in the same order.
    header = re.findall(r"^#\s+(?:\d\.\s+)?([a-z0-9-]+)\s+(\d+) s  ", SCRIPT.split("set -uo pipefail")[0], flags=re.M)
    assert [(name, int(limit)) for name, limit in header] == list(limits.items())
    assert f"add up to {sum(limits.values())} s" in SCRIPT
    # docs/benchmarks.md's table of what to run when a GPU is lent says the same.
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    table = re.findall(r"^\| ([a-z0-9-]+) \| (\d+) s \|", docs, flags=re.M)
    assert [(name, int(limit)) for name, limit in table] == list(limits.items())
    assert f"The limits add up to {sum(limits.values())} s." in docs
    # The sanitizers are the only stages whose refusal is not a failure; overlap-memory reads bench-overlap's report.
    assert re.findall(r"^stage --refusable (\S+)", SCRIPT, flags=re.M) == SANITIZERS
    assert re.search(r'^stage --needs "\$WORK/bench-overlap.json" overlap-memory ', SCRIPT, flags=re.M)


def test_it_leaves_at_most_8_files_in_out():
    out_files = bash_array("OUT_FILES")
    assert len(out_files) <= 8 and len(set(out_files)) == len(out_files)
    written = set(re.findall(r"\$OUT/([\w.-]+)", SCRIPT))
    logs = {log for _, _, log, _ in re.findall(r"^stage((?: --refusable| --needs \S+)*) (\S+) \d+ (\S+) (.*)$",
                                                SCRIPT, flags=re.M)}
    assert written and logs and written | logs <= set(out_files), (written | logs) - set(out_files)


@pytest.mark.slow  # (a collection of the whole suite: 12 s of the README's tier)
def test_the_parity_set_covers_each_family_and_mode_and_its_ids_exist(tmp_path):
    parity, delays = bash_array("PARITY_TESTS"), bash_array("DELAY_TESTS")
    joined = "\n".join(parity)
    for wanted in ["test_fused_adam_op.py", "[SGD-", "[RMSprop-", "[NAdam-", "[Adafactor-", "[Muon-",
                   "test_trusted_optimizers.py", "bf16 moments", "8-bit moments", "Kahan", "masters",
                   "test_overlap.py", "test_overlap_rules.py", "test_split_params.py", "test_device_budget.py",
                   "test_cuda_max_memory_allocated", "grad_scaler_in_step", "[True-cuda]",  # unscale_in_step
                   "tests/runtime/test_deferred_lifetime.py"]:
        assert wanted in joined, f"no parity case for {wanted}"
    assert all("random_delays" not in test for test in parity)
    assert sum("test_random_delays_change_nothing" in test for test in delays) == 6
    stages = {name: command for name, _, command in stage_lines()}
    assert " -n " in stages["parity"] and "OMP_NUM_THREADS" in stages["parity"] and "${PARITY_TESTS[@]}" in stages["parity"]
    assert " -n " not in stages["parity-delays"] and "${DELAY_TESTS[@]}" in stages["parity-delays"]
    # Every id is collected here (skipped without a GPU, but a renamed test would run nowhere), with the
    # parity stage's -k: from the dropped-optimizer file only its CUDA variants, and every other id whole.
    select = re.search(r'^PARITY_SELECT="([^"]+)"', SCRIPT, flags=re.M).group(1)
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "-k", select, *parity, *delays], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    names = {line for line in collected.stdout.splitlines() if "::" in line}
    for test in parity + delays:  # a test, all of a parametrized function's variants, or a file
        assert test in names or any(n.startswith(test + "[") for n in names) or test.endswith(".py"), \
            f"{test} is not collected"
    lifetime = [n for n in names if n.startswith("tests/runtime/test_deferred_lifetime.py::")]
    assert lifetime and all("cuda" in n for n in lifetime)


def test_its_racecheck_runs_only_the_8bit_kernel():
    # The one kernel with shared memory (CUB block reductions) gets a racecheck, on one small step.
    assert SCRIPT.count("--tool racecheck") == 1 and '"$racecheck_run"' in SCRIPT
    racecheck_source = embedded_python("racecheck_run")
    assert "state_dtype=torch.uint8" in racecheck_source and "opt.step()" in racecheck_source


def bench_invocations() -> dict[str, list[str]]:
    """Stage name -> the arguments the script passes to python -m swap_optimizer.bench."""
    return {name: expand(shlex.split(command.split("-m swap_optimizer.bench", 1)[1]))
            for name, _, command in stage_lines() if "-m swap_optimizer.bench" in command}


def test_its_benchmark_arguments_pass_the_benchmarks_own_checks():
    invocations = bench_invocations()
    assert list(invocations) == ["main-job", "bench-bf16", "bench-overlap", "host-overhead"]
    for name, words in invocations.items():
        p = parser()
        args = p.parse_args(words)
        check_arguments(p, args)  # p.error exits: a SystemExit fails the test
        assert args.json
        if name == "main-job":  # as a user runs it: the device and the model are the bench's own defaults
            assert args.device is None and args.preset is None and not args.quick
        else:
            assert args.device.type == "cuda"


def test_its_bench_argument_check_catches_what_failed_there():
    """check_arguments is what the script's first GPU run tripped on (5
    repeats without --quick)."""
    p = parser()
    with pytest.raises(SystemExit):
        check_arguments(p, p.parse_args(["--device", "cpu", "--preset", "1.3b", "--repeats", "5"]))


# ------------------------------------------------------- embedded programs


@pytest.mark.slow  # (a run of the script's stage each: 11 s of the README's tier)
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


@pytest.mark.slow  # (6 s of the README's tier)
def test_its_auto_budget_check_runs_on_the_cpu_backend(tmp_path):
    """On the CPU a simulated device with room for everything: the budget is
    derived after the warm-up, everything moves resident, and the results are
    bitwise the swapped run's; the GPU adds the real measurement's asserts."""
    source = embedded_python("auto_budget_check")
    assert "_C.free_device_bytes(device)" in source and "torch.cuda.max_memory_allocated(device)" in source
    result = run_python(source, "cpu", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.split("GPU_CHECK_FIGURES ", 1)[1].splitlines()[0])
    assert figures["budget_bytes"] > 0 and figures["resident_share"] == 1.0
    assert "bitwise the swapped run" in result.stdout


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
    figures = json.loads(within.stdout.split("GPU_CHECK_FIGURES ", 1)[1].splitlines()[0])
    assert figures["overlap_memory"]["swap s8 a3 overlap"]["bound_GiB"] == 21.062
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


# ------------------------------------------------------------ the recorder


def bench_report(overlap=False) -> dict:
    """A bench report of the shape swap_optimizer.bench writes (two modes)."""
    row = dict(mode="resident", kind="resident", overlap=False, peak_train_bytes=3 * 2**30, step_ms=4.0,
               floor_ms=None, step_over_floor=None, loop_step_ms=10.0 if overlap else None)
    swap = dict(row, mode="swap s8 a3", kind="swap", peak_train_bytes=2 * 2**30, step_ms=30.0, floor_ms=25.0,
                step_over_floor=1.2, bytes_per_param_each_way=8.0, loop_step_ms=10.5 if overlap else None)
    return dict(environment=dict(torch="2.11.0+cu130", cuda="13.0", device="cuda:0", device_name="NVIDIA H200",
                                 bandwidth_bytes_per_s=dict(host_to_device=5.1e10, device_to_host=5.0e10,
                                                            both_directions=9.0e10)),
                model=dict(preset="tiny", dtype="fp32", params=5_300_000, block_param_bytes=1 << 20),
                settings={}, modes=[row, swap])


class Recorder:
    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.source = tmp_path / "record_stage.py"
        self.source.write_text(embedded_python("record_stage"))
        self.json = tmp_path / "gpu_check.json"

    def __call__(self, *args, output: str = None, report: dict = None) -> subprocess.CompletedProcess:
        extra = []
        if output is not None:
            (self.tmp_path / "stage.log").write_text(output)
            extra += ["--output", str(self.tmp_path / "stage.log")]
        if report is not None:
            (self.tmp_path / "report.json").write_text(json.dumps(report))
            extra += ["--report", str(self.tmp_path / "report.json")]
        return subprocess.run([sys.executable, "-P", str(self.source), str(self.json), *args, *extra],
                              capture_output=True, text=True, timeout=60)

    def stage(self, name, exit, *flags, output="", report=None):
        return self("stage", name, "--limit", "30", "--log", "tests.log", "--exit", str(exit),
                    "--started", "100.0", "--ended", "112.5", *flags, output=output, report=report)

    def stages(self) -> dict:
        return {s["name"]: s for s in json.loads(self.json.read_text())["stages"]}


def test_the_recorder_writes_each_stage_as_it_starts_and_ends(tmp_path):
    record = Recorder(tmp_path)
    assert record("begin", "--gpu", "NVIDIA H200, 580.159.03, 143771 MiB", "--limits-sum", "348").returncode == 0
    assert record("stage", "build", "--limit", "90", "--log", "build.log", "--running").returncode == 0
    assert record.stages()["build"]["result"] == "running"
    assert record.stage("build", 0).returncode == 0
    assert record("stage", "import", "--limit", "10", "--log", "build.log", "--running").returncode == 0
    data = json.loads(record.json.read_text())
    # the finished stage replaced its "running" entry, in place; the next one is running
    assert [(s["name"], s["result"]) for s in data["stages"]] == [("build", "passed"), ("import", "running")]
    assert data["stages"][0]["seconds"] == 12.5 and data["gpu"].startswith("NVIDIA H200")
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.json", "record_stage.py", "stage.log"]  # no partial file left
    assert record("finish", "--status", "0").returncode == 0
    assert json.loads(record.json.read_text())["exit_status"] == 0


def test_the_recorder_reads_pytest_counts_failures_and_a_timeout(tmp_path):
    record = Recorder(tmp_path)
    record("begin", "--limits-sum", "348")
    verbose = ["tests/test_a.py::test_x[cuda] PASSED", "[gw1] [ 50%] PASSED tests/test_a.py::test_y[cuda]",
               "[gw0] [ 75%] FAILED tests/test_a.py::test_z[cuda]", "tests/test_a.py::test_w SKIPPED (no GPU)"]
    summary = ["== slowest durations ==", "3.21s call     tests/test_a.py::test_x[cuda]",
               "FAILED tests/test_a.py::test_z[cuda] - AssertionError: params differ",
               "========= 1 failed, 2 passed, 1 skipped in 9.87s ========="]
    failed = record.stage("parity", 1, output="\n".join(verbose + summary))
    assert failed.returncode == 1 and "failed (exit 1)" in failed.stdout
    entry = record.stages()["parity"]
    assert entry["tests"] == dict(failed=1, passed=2, skipped=1)
    assert entry["failed_tests"] == ["FAILED tests/test_a.py::test_z[cuda]"]
    assert entry["slowest"] == ["3.21s tests/test_a.py::test_x[cuda]"] and entry["output_tail"][-1] == summary[-1]
    # Killed at its limit: no summary line, so the outcomes printed so far, marked partial.
    timed_out = record.stage("parity-delays", 124, output="\n".join(verbose))
    assert timed_out.returncode == 1
    entry = record.stages()["parity-delays"]
    assert entry["result"] == "timed out after 30 s"
    assert entry["tests"] == dict(passed=2, failed=1, skipped=1, partial=True)
    passed = record.stage("devices", 0, output="tests/runtime/test_devices.py::test_a PASSED\n==== 11 passed in 4.0s ====")
    assert passed.returncode == 0 and record.stages()["devices"]["tests"] == dict(passed=11)


def test_the_recorder_tells_a_refused_sanitizer_from_a_failing_one(tmp_path):
    record = Recorder(tmp_path)
    record("begin", "--limits-sum", "348")
    refused = ("========= COMPUTE-SANITIZER\n========= Error: Device not supported\n"
               "RuntimeError: CUDA error: unknown error (999)\n")
    result = record.stage("memcheck", 1, "--refusable", output=refused)
    assert result.returncode == 0, result.stdout
    assert record.stages()["memcheck"]["result"] == \
        "not run: compute-sanitizer refused this host's device (Error: Device not supported)"
    missing = record.stage("racecheck", 127, "--refusable", output="timeout: failed to run command: No such file")
    assert missing.returncode == 0 and record.stages()["racecheck"]["result"] == "not run: compute-sanitizer not found"
    findings = record.stage("memcheck", 3, "--refusable", output="========= ERROR SUMMARY: 2 errors\n")
    assert findings.returncode == 1
    assert record.stages()["memcheck"]["result"] == "failed (exit 3)"
    assert record.stages()["memcheck"]["sanitizer_errors"] == 2
    clean = record.stage("racecheck", 0, "--refusable", output="========= ERROR SUMMARY: 0 errors\n")
    assert clean.returncode == 0 and record.stages()["racecheck"]["sanitizer_errors"] == 0
    # Elsewhere the same words are a failure like any other.
    assert record.stage("devices", 1, output=refused).returncode == 1


def test_the_recorder_keeps_the_bench_reports_and_their_key_figures(tmp_path):
    record = Recorder(tmp_path)
    record("begin", "--limits-sum", "348")
    assert record.stage("main-job", 0, report=bench_report()).returncode == 0
    entry = record.stages()["main-job"]
    assert entry["report"] == bench_report()
    assert entry["environment"]["device_name"] == "NVIDIA H200"
    assert entry["environment"]["bandwidth_GBps"] == dict(host_to_device=51.0, device_to_host=50.0, both_directions=90.0)
    assert [(m["mode"], m["peak_train_GiB"], m["step_ms"]) for m in entry["modes"]] == \
        [("resident", 3.0, 4.0), ("swap s8 a3", 2.0, 30.0)]
    rows = [dict(swap_times=4, num_arenas=2, resident_share=0.0, ratio=r, predicted_ms=1, measured_ms=1)
            for r in (0.8, 1.1, 1.4)]
    figures = 'GPU_CHECK_FIGURES {"budget_bytes": 123, "resident_share": 1.0}\n'
    record.stage("cost-model", 1, output=figures, report=dict(rows=rows, resident_ms=1.0))
    entry = record.stages()["cost-model"]
    assert entry["predicted_over_measured"] == dict(min=0.8, max=1.4, within_25_percent=2, rows=3)
    assert entry["budget_bytes"] == 123 and entry["resident_share"] == 1.0


# -------------------------------------------------- the whole script, stand-ins

FAKE_PYTHON = r"""#!/usr/bin/env bash
# python3 of a GPU machine, faked: the script's own bookkeeping (whatever names
# gpu_check.json) runs on the real Python; the build, pytest, the bench and the
# embedded checks only say they ran.
case " $* " in *gpu_check.json*) exec "$REAL_PYTHON" "$@" ;; esac
echo "fake python $*"
case " $* " in
  *" -m pip install "*) exit "${FAKE_BUILD_EXIT:-0}" ;;
  *" -m pytest "*)
    if [ -n "${FAKE_FAILING_TESTS:-}" ] && [[ " $* " == *"$FAKE_FAILING_TESTS"* ]]; then
      echo "tests/test_x.py::test_y[cuda] FAILED"
      echo "FAILED tests/test_x.py::test_y[cuda] - AssertionError"
      echo "==== 1 failed, 3 passed in 0.50s ===="
      exit 1
    fi
    echo "tests/test_x.py::test_z[cuda] PASSED"
    echo "==== 4 passed, 1 skipped in 0.50s ===="
    exit 0 ;;
  *" -m swap_optimizer.bench "*)
    if [[ " $* " != *" --device "* ]] && [ -n "${SNAPSHOT:-}" ]; then cp "$OUT/gpu_check.json" "$SNAPSHOT"; fi
    while [ $# -gt 0 ]; do
      case $1 in
        --json) cp "$FAKE_REPORT" "$2" ;;
        --plot|--timeline) echo png >"$2" ;;
      esac
      shift
    done
    exit 0 ;;
esac
exit 0
"""

FAKE_SANITIZER = r"""#!/usr/bin/env bash
echo "========= COMPUTE-SANITIZER"
case ${FAKE_SANITIZER:-refuse} in
  refuse) echo "========= Error: Device not supported"; echo "RuntimeError: CUDA error: unknown error"; exit 1 ;;
  findings) echo "========= Invalid __global__ write of size 4 bytes"; echo "========= ERROR SUMMARY: 2 errors"; exit 3 ;;
esac
echo "========= ERROR SUMMARY: 0 errors"
"""


def dry_run(tmp_path, **env) -> tuple[subprocess.CompletedProcess, dict, pathlib.Path]:
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    for name, text in (("python3", FAKE_PYTHON), ("compute-sanitizer", FAKE_SANITIZER),
                       ("nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA H200, 580.159.03, 143771 MiB'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    report = tmp_path / "report.json"
    report.write_text(json.dumps(bench_report(overlap=True)))
    environment = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(bin_dir / "python3"),
                       REAL_PYTHON=sys.executable, OUT=str(out), FAKE_REPORT=str(report), **env)
    result = subprocess.run(["bash", str(SCRIPT_PATH)], capture_output=True, text=True, env=environment, timeout=300)
    data = json.loads((out / "gpu_check.json").read_text())
    return result, data, out


def test_a_dry_run_records_every_stage_in_order_as_it_ends(tmp_path):
    snapshot = tmp_path / "at_main_job.json"
    result, data, out = dry_run(tmp_path, SNAPSHOT=str(snapshot))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [s["name"] for s in data["stages"]] == STAGE_ORDER
    results = {s["name"]: s["result"] for s in data["stages"]}
    for name in STAGE_ORDER:
        expected = "not run: compute-sanitizer refused" if name in SANITIZERS else "passed"
        assert results[name].startswith(expected), (name, results[name])
    stages = {s["name"]: s for s in data["stages"]}
    assert stages["parity"]["tests"] == dict(passed=4, skipped=1) and stages["parity"]["log"] == "tests.log"
    assert stages["main-job"]["report"]["environment"]["device_name"] == "NVIDIA H200"
    assert data["gpu"] == "NVIDIA H200, 580.159.03, 143771 MiB" and data["exit_status"] == 0
    # While the main job ran, the stages before it were already in the file.
    during = json.loads(snapshot.read_text())
    assert [(s["name"], s["result"]) for s in during["stages"]] == \
        [("build", "passed"), ("import", "passed"), ("devices", "passed"), ("main-job", "running")]
    # What comes back: at most 8 files, all named in OUT_FILES.
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and set(files) <= set(bash_array("OUT_FILES")), files
    summary = (out / "summary.txt").read_text()
    for name in STAGE_ORDER:
        assert re.search(rf"^{name} ", summary, flags=re.M), name
    assert "swap s8 a3" in summary and "exit status 0" in summary


def test_a_failing_stage_does_not_stop_the_later_ones(tmp_path):
    result, data, out = dry_run(tmp_path, FAKE_FAILING_TESTS="test_deferred_lifetime.py", FAKE_SANITIZER="findings")
    assert result.returncode == 1
    results = {s["name"]: s["result"] for s in data["stages"]}
    assert results["parity"] == "failed (exit 1)" and results["memcheck"] == "failed (exit 3)"
    assert [name for name, r in results.items() if r != "passed"] == ["parity", "memcheck", "racecheck"]
    stages = {s["name"]: s for s in data["stages"]}
    assert stages["parity"]["failed_tests"] == ["FAILED tests/test_x.py::test_y[cuda]"]
    assert stages["memcheck"]["sanitizer_errors"] == 2 and data["exit_status"] == 1
    assert "FAILED tests/test_x.py::test_y[cuda]" in (out / "summary.txt").read_text()


def test_a_failed_build_leaves_the_later_stages_not_run(tmp_path):
    result, data, out = dry_run(tmp_path, FAKE_BUILD_EXIT="1")
    assert result.returncode == 1
    assert [s["name"] for s in data["stages"]] == STAGE_ORDER
    assert data["stages"][0]["result"] == "failed (exit 1)"
    assert all(s["result"] == "not run: build failed" for s in data["stages"][1:]), data["stages"]
    assert "fake python" in (out / "build.log").read_text()
