"""python -m swap_optimizer.bench end to end on the CPU (quick mode): every
mode, the JSON report, the plot, and argument errors. No timing assertions."""

import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import swap_optimizer
from swap_optimizer.bench import host_overhead, runner
from swap_optimizer.bench.__main__ import main
from conftest import ROOT

ROW_KEYS = {"mode", "kind", "swap_times", "num_arenas", "master_weights", "peak_train_bytes", "peak_step_bytes",
            "step_ms", "train_step_ms", "h2d_bytes", "d2h_bytes", "host_bytes", "floor_ms", "step_over_floor"}


def run(tmp_path, *extra):
    report, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["--quick", "--json", str(report), "--plot", str(plot), *extra]) == 0
    return json.loads(report.read_text()), plot


def test_quick_run_reports_every_mode(tmp_path, capsys):
    report, plot = run(tmp_path)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    names = [row["mode"] for row in report["modes"]]
    assert names == ["resident"] + [f"swap s{s} a{a}" for a in (2, 3) for s in (2, 4, 8, 16)]
    env = report["environment"]
    assert env["torch"] and env["device"] == "cpu" and set(env["bandwidth_bytes_per_s"]) == {
        "host_to_device", "device_to_host", "both_directions"}
    assert all(v > 0 for v in env["bandwidth_bytes_per_s"].values())
    assert report["model"]["preset"] == "micro" and report["model"]["params"] > 0
    assert report["settings"]["memory"] == "runtime accounting"
    params_bytes = report["model"]["params"] * 4
    for row in report["modes"]:
        assert ROW_KEYS <= row.keys()
        assert row["step_ms"] > 0 and row["train_step_ms"] >= row["step_ms"]
        if row["kind"] == "resident":
            assert row["h2d_bytes"] == row["d2h_bytes"] == 0 and row["floor_ms"] is None
            assert row["peak_step_bytes"] == 2 * params_bytes + 2 * params_bytes  # params, grads, two states
        else:
            # Every swap mode moves the whole swapped state each way, through arenas smaller than it.
            assert row["h2d_bytes"] == row["d2h_bytes"] == row["host_bytes"] > 0
            assert row["floor_ms"] > 0 and row["step_over_floor"] > 0
            assert row["peak_staging_bytes"] <= min(row["num_arenas"], row["batches"]) * row["host_bytes"]
    by_name = {row["mode"]: row for row in report["modes"]}
    assert by_name["swap s16 a2"]["peak_train_bytes"] < by_name["resident"]["peak_train_bytes"]
    out = capsys.readouterr().out
    assert "CPU times" in out and "| swap s16 a3 |" in out and "copy bandwidth measured here" in out


def test_bf16_runs_with_and_without_master_weights(tmp_path):
    report, _ = run(tmp_path, "--dtype", "bf16", "--swap-times", "4", "--num-arenas", "3")
    rows = {row["mode"]: row for row in report["modes"]}
    assert set(rows) == {"resident", "swap s4 a3", "swap s4 a3+master"}
    # fp32 masters and fp32 states: 12 bytes per param against 4 for bf16 states.
    assert rows["swap s4 a3+master"]["h2d_bytes"] > 2.5 * rows["swap s4 a3"]["h2d_bytes"]


@pytest.mark.parametrize("args, message", [
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--swap-times", "0,4"], "integers >= 1"),
    (["--num-arenas", "1"], "integers >= 2"),
    (["--dtype", "fp16"], "invalid choice: 'fp16'"),
    (["--repeats", "5"], "at least 10"),
    (["--plot", "out.jpg"], "ending in .png"),
    (["--hidden", "100", "--heads", "3"], "not a multiple of --heads"),
    (["--batch-size", "0"], "positive integer"),
    (["--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["--timeline", "t.png"], "add --overlap"),
    (["--overlap", "--timeline", "t.svg"], "ending in .png"),
    (["--preset", "1.3b", "--batch-size", "64"], "needs about .* GiB .* free; pick a smaller --preset"),
    (["--resident-shares", "0,1.5"], r"fractions in \[0, 1\]"),
    (["--resident-shares", "half"], r"fractions in \[0, 1\]"),
    (["--resident-shares", "0.5,0.5"], "each share once"),
    (["--host-overhead", "--paths", "SGD;Adam"], "expected ';'-separated names from AdamW fused"),
    (["--host-overhead", "--shape-sets", "gpt2"], "expected ';'-separated names from 1000 x 64"),
    (["--host-overhead", "--rounds", "0"], "positive integer"),
])
def test_argument_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


# -P: the installed package, not the source folder beside the tests (no _C there).
def test_runs_as_a_module():
    out = subprocess.run([sys.executable, "-P", "-m", "swap_optimizer.bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--preset" in out.stdout, out.stderr


def test_package_imports_without_importing_torch_first():
    out = subprocess.run([sys.executable, "-P", "-c", "import swap_optimizer; print(swap_optimizer.SwapOptimizer)"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        main(["--device", "cuda"])
    assert "needs a GPU" in capsys.readouterr().err


def test_staging_share_of_public_model_shapes_meets_the_target(tmp_path):
    """benchmarks/staging_share.py from the plan (no real step): on the GPT-2,
    Qwen2.5-0.5B and Llama-3.2-1B shapes, staging within 0.01 of the state of
    the ideal num_arenas / swap_times, where keeping params whole needed 0.43-0.62."""
    script = pathlib.Path(ROOT) / "benchmarks" / "staging_share.py"
    report = tmp_path / "share.json"
    out = subprocess.run([sys.executable, "-P", str(script), "--real-step", "none", "--json", str(report)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(report.read_text())
    models = ("gpt2-124m", "qwen2.5-0.5b", "llama-3.2-1b")  # swap_optimizer.presets' names
    assert {(r["model"], r["swap_times"]) for r in rows} == {(m, s) for m in models for s in (8, 16, 32)}
    for row in rows:
        assert row["share"] - row["ideal"] <= 0.01, row
        assert row["whole_param_floor"] > 0.4 and row["split_params"] > 0 and row["max_host_copies"] <= 5


def test_state_modes_report_bytes_per_param_and_ratio(tmp_path, capsys):
    report, _ = run(tmp_path, "--dtype", "bf16", "--swap-times", "4", "--num-arenas", "2",
                    "--state-modes", "default,bf16,kahan+8bit")
    rows = {row["mode"]: row for row in report["modes"]}
    assert set(rows) == {"resident", "swap s4 a2", "swap s4 a2+master", "swap s4 a2 bf16", "swap s4 a2 kahan+8bit"}
    assert rows["swap s4 a2 kahan+8bit"]["state"] == "kahan+8bit"
    # bf16 params: 4 B/param with bf16 moments, 12 with fp32 masters and moments; Kahan + 8-bit about 4.
    assert rows["swap s4 a2"]["bytes_per_param_each_way"] == pytest.approx(4.0, rel=0.01)
    assert rows["swap s4 a2+master"]["bytes_per_param_each_way"] == pytest.approx(12.0, rel=0.01)
    assert rows["swap s4 a2 kahan+8bit"]["bytes_per_param_each_way"] < 4.3
    assert rows["swap s4 a2 kahan+8bit"]["h2d_bytes"] < rows["swap s4 a2+master"]["h2d_bytes"] / 2.5
    out = capsys.readouterr().out
    assert "B/param each way" in out and "step vs default" in out


def test_kahan_state_mode_needs_16bit_params(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--state-modes", "kahan+8bit"])
    assert "Kahan summation applies to 16-bit params" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--quick", "--state-modes", "int4"])
    assert "expected comma-separated state modes" in capsys.readouterr().err


def test_overlap_joins_the_training_step_comparison(tmp_path, capsys):
    """--overlap: each swap mode gets an overlapped twin, every mode a
    back-to-back training step time with its ratio to resident, and
    --timeline plots the overlapped step (copies and updates per batch) and
    the next forward (per block). Figures are reported, not asserted."""
    timeline = tmp_path / "timeline.png"
    report, _ = run(tmp_path, "--swap-times", "4", "--num-arenas", "3", "--overlap", "--timeline", str(timeline))
    rows = {row["mode"]: row for row in report["modes"]}
    assert list(rows) == ["resident", "swap s4 a3", "swap s4 a3 overlap"]
    assert report["settings"]["overlap"] is True
    assert rows["swap s4 a3 overlap"]["overlap"] and not rows["swap s4 a3"]["overlap"]
    assert all(row["loop_step_ms"] > 0 for row in rows.values())
    # Same bytes and staging; no copy floor for a step() that only enqueues.
    assert rows["swap s4 a3 overlap"]["h2d_bytes"] == rows["swap s4 a3"]["h2d_bytes"]
    assert rows["swap s4 a3 overlap"]["floor_ms"] is None
    spans = rows["swap s4 a3 overlap"]["timeline"]["spans"]
    batches = sum(1 for s in spans if s["lane"] == "update")  # positions: the rotating batches and the resident one
    assert batches == rows["swap s4 a3 overlap"]["batches"] + 1
    for lane in ("copy in", "update", "copy out"):
        assert sorted(s["batch"] for s in spans if s["lane"] == lane) == list(range(batches)), lane
    assert sorted(s["batch"] for s in spans if s["lane"] == "forward") == [0, 1]  # micro: 2 blocks
    assert all(0 <= s["start"] <= s["end"] for s in spans)
    # Within a batch: copied in, then updated, then copied out.
    for b in range(batches):
        lanes = {s["lane"]: s for s in spans if s["batch"] == b and s["lane"] != "forward"}
        assert lanes["copy in"]["end"] <= lanes["update"]["start"] + 1e-4
        assert lanes["update"]["end"] <= lanes["copy out"]["start"] + 1e-4
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "loop vs resident" in out and "| swap s4 a3 overlap |" in out


# (muon's bf16 Newton-Schulz makes its run take about 30 s on 2 cores: slow tier)
@pytest.mark.parametrize("optimizer", ["sgd", "adafactor", pytest.param("muon", marks=pytest.mark.slow)])
def test_another_optimizer_runs_the_main_job(tmp_path, capsys, optimizer):
    """--optimizer: the resident mode is the plain optimizer, the swap modes
    stream its own states (SGD's and Muon's momentum: 4 bytes per param each
    way in fp32; Adafactor's factored variances: far fewer). Muon steps the
    blocks' matrices beside a resident AdamW for the rest."""
    report, _ = run(tmp_path, "--optimizer", optimizer, "--swap-times", "2", "--num-arenas", "2")
    assert report["settings"]["optimizer"] == optimizer
    rows = {row["mode"]: row for row in report["modes"]}
    assert set(rows) == {"resident", "swap s2 a2"}
    swap = rows["swap s2 a2"]
    assert swap["h2d_bytes"] > 0 and swap["batches"] >= 1
    if optimizer == "adafactor":
        assert swap["bytes_per_param_each_way"] < 1.0
    else:
        assert swap["bytes_per_param_each_way"] == pytest.approx(4.0, rel=0.01)
    if optimizer == "muon":  # the resident AdamW's moments (8 bytes per param) are counted in both modes
        assert rows["resident"]["peak_step_bytes"] == swap["peak_step_bytes"] - swap["peak_staging_bytes"] + \
            swap["h2d_bytes"]
    name = {"sgd": "SGD", "adafactor": "Adafactor", "muon": "Muon (+ resident AdamW for the rest)"}[optimizer]
    assert f"{name} on micro GPT" in capsys.readouterr().out


def test_adamw_only_bench_options_are_argument_errors(capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--optimizer", "sgd", "--state-modes", "kahan+bf16"])
    assert "work with --optimizer adamw only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--quick", "--optimizer", "adafactor", "--state-modes", "8bit"])
    assert "work with elementwise optimizers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--quick", "--optimizer", "muon", "--overlap"])
    assert "--overlap does not run with --optimizer muon" in capsys.readouterr().err


def test_another_optimizer_overlaps_too(tmp_path, capsys):
    """--overlap with SGD: the overlapped twin of each swap mode, and the
    loop-time comparison that shows what overlap gains."""
    report, _ = run(tmp_path, "--optimizer", "sgd", "--swap-times", "2", "--num-arenas", "2", "--overlap")
    assert [row["mode"] for row in report["modes"]] == ["resident", "swap s2 a2", "swap s2 a2 overlap"]
    assert "loop vs resident" in capsys.readouterr().out


def test_resident_share_sweep_moves_less_as_the_share_rises(tmp_path, monkeypatch, capsys):
    """--resident-shares: a swap mode per share beside resident, at the first
    swap_times and num_arenas, under the budget that keeps that share of the
    state resident. The share reached rises with the target and the bytes
    moved fall; at share 1 only the step table still crosses. Each row's
    figures are its optimizer's memory_stats(). No timing assertions."""
    built = {}

    def build_and_keep(mode, model):
        built[mode.name] = optimizer = build_optimizer(mode, model)
        return optimizer

    build_optimizer = runner.build_optimizer
    monkeypatch.setattr(runner, "build_optimizer", build_and_keep)
    report, _ = run(tmp_path, "--repeats", "2", "--swap-times", "8,4", "--num-arenas", "2",
                    "--resident-shares", "0,0.5,1")
    assert report["settings"]["resident_shares"] == [0.0, 0.5, 1.0]
    rows = {row["mode"]: row for row in report["modes"]}
    names = [f"swap s8 a2 share {share}" for share in ("0", "0.5", "1")]
    assert list(rows) == ["resident", "swap s8 a2", "swap s4 a2"] + names
    sweep = [rows[name] for name in names]
    for row, target in zip(sweep, (0.0, 0.5, 1.0)):
        stats = built[row["mode"]].memory_stats()
        assert row["target_share"] == target and (row["swap_times"], row["num_arenas"]) == (8, 2)
        # Kept, so only the share changes (with nothing swapped, the plan names a single batch).
        assert (stats["plan"]["swap_times"], stats["plan"]["num_arenas"]) == ((8 if stats["batches"] else 1), 2)
        assert (row["h2d_bytes"], row["d2h_bytes"], row["host_bytes"]) == (
            stats["h2d_bytes"], stats["d2h_bytes"], stats["host_state_bytes"])
        assert row["resident_share"] == stats["resident_share"]
        assert row["device_budget_bytes"] == stats["device_budget_bytes"] >= stats["plan"]["device_bytes"]["total"]
        assert row["predicted_step_ms"] == stats["plan"]["predicted_step_seconds"] * 1e3 > 0
    shares = [row["resident_share"] for row in sweep]
    moved = [row["h2d_bytes"] for row in sweep]
    assert shares[0] < shares[1] < shares[2] and moved[0] > moved[1] > moved[2]
    # Share 0 is the budget of the plan without one: the same plan as the plain mode.
    assert (sweep[0]["h2d_bytes"], sweep[0]["resident_share"]) == (rows["swap s8 a2"]["h2d_bytes"],
                                                                   rows["swap s8 a2"]["resident_share"])
    # Share 1: every state resident, no batch; at most a step table (the packed kernel's) still moves.
    final = sweep[2]
    assert final["resident_share"] == pytest.approx(1.0, abs=1e-3) and final["batches"] == 0
    assert 0 <= final["h2d_bytes"] == final["d2h_bytes"] == final["host_bytes"] <= final["step_table_bytes"]
    out = capsys.readouterr().out
    assert "| swap s8 a2 share 0.5 |" in out and "predicted step() ms" in out and "step() vs resident" in out


@pytest.mark.slow  # (7 s of the README's tier)
def test_host_overhead_reports_each_path_and_situation(tmp_path, capsys):
    """--host-overhead: a row per (shape set, optimizer path) and per forward
    situation, with plain and SwapOptimizer times side by side, their ratio and
    the extra time split per batch and per param; a row per compact-state path
    with each form's ratio to the default states; the tables and the JSON."""
    report = tmp_path / "host.json"
    paths = ["SGD momentum foreach", "Lion (vouched for, learned)"]
    assert main(["--host-overhead", "--device", "cpu", "--quick", "--rounds", "2", "--repeats", "2",
                 "--paths", ";".join(paths), "--shape-sets", "1000 x 64", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert [row["path"] for row in data["step"]] == paths
    for row in data["step"]:
        assert row["shapes"] == "1000 x 64" and row["params"] == 1000 and row["batches"] == 16
        assert row["plain_ms"]["min"] <= row["plain_ms"]["median"]
        assert row["ratio"]["median"] > 0 and set(row) >= {"extra_us_per_param", "extra_us_per_batch"}
        assert 0 < row["floor_ratio"]["min"] <= row["floor_ratio"]["median"] < float("inf")
    assert [row["situation"] for row in data["forward"]] == [*host_overhead.SITUATIONS,
                                                             *host_overhead.FLOOR_SITUATIONS]
    assert all(row["plain_ms"]["median"] > 0 and row["ratio"]["median"] > 0 for row in data["forward"])
    assert [row["path"] for row in data["compact"]] == list(host_overhead.COMPACT_PATHS)
    for row in data["compact"]:
        assert row["elements"] == 65_536 and row["default_ms"]["min"] <= row["default_ms"]["median"]
        assert all(row[name]["ratio"]["median"] > 0 for name in host_overhead.COMPACT_STATES)
    assert data["rounds"] == 2 and data["environment"]["device"] == "cpu"
    out = capsys.readouterr().out
    assert "| 1000 x 64 | SGD momentum foreach | 16 |" in out and "| pending, another model |" in out
    assert "| AdamW (packed kernel) | 65,536 |" in out


def test_call_through_mode_calls_each_op_as_it_was_called():
    """The host-overhead bench's floor mode: each op, with its args and
    kwargs, gives what it gives without the mode (and its errors), and the
    mode sees ops (a mode below it is reached through it)."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 3, generator=generator), torch.randn(4, 3, generator=generator)
    with Recorder(), host_overhead.CallThroughMode() as mode:
        assert torch.overrides._get_current_function_mode_stack()[-1] is mode
        assert mode.__torch_function__.__func__ is swap_optimizer._C.torch_function_call_through
        added = torch.add(a, b, alpha=2.5)
        summed = a.sum(dim=1, keepdim=True)
        linear = torch.nn.functional.linear(a, b)
        with pytest.raises(RuntimeError, match="size"):
            torch.add(a, torch.ones(5))
    # (the same calls without the mode: bitwise)
    torch.testing.assert_close(added, torch.add(a, b, alpha=2.5), rtol=0, atol=0)
    torch.testing.assert_close(summed, a.sum(dim=1, keepdim=True), rtol=0, atol=0)
    torch.testing.assert_close(linear, torch.nn.functional.linear(a, b), rtol=0, atol=0)
    assert not torch.equal(added, torch.add(a, b))  # (alpha reached the op)
    assert {"add", "sum", "linear"} <= set(seen)


def test_floor_groups_are_the_params_in_order_one_group_per_batch():
    params = host_overhead._make_params(host_overhead.gpt2_shrunk_shapes(), torch.device("cpu"))
    groups = host_overhead._groups_per_batch(params, host_overhead.SWAP_TIMES)
    assert len(groups) == host_overhead.SWAP_TIMES
    assert [p for g in groups for p in g["params"]] == params and all(g["params"] for g in groups)

