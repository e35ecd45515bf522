"""The examples/ scripts, run as a user runs them (`python examples/X.py`, in
a fresh process each), in the slow tier: for each, a run interrupted after its
checkpoint and resumed in a new process ends with the same params and
optimizer state as an uninterrupted run, bitwise. Each needs its framework
(`pip install transformers accelerate lightning`; .ci/run installs the
versions docs/integrations.md names) and is skipped without it. Without it,
an example itself says how to install it (default tier)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: pip install {' '.join(missing)}")


def run_example(script, output_dir, *arguments, launcher=()):
    """Runs an example from a scratch folder (the checkout is not on sys.path:
    it imports the installed swap_optimizer) and returns its output."""
    command = [*launcher, os.path.join(EXAMPLES, script), "--output-dir", str(output_dir), *arguments]
    if not launcher:
        command.insert(0, sys.executable)
    out = subprocess.run(command, cwd=output_dir.parent, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{' '.join(command)}\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    return out.stdout


def assert_same_final(first, second, finals=("final.pt",)):
    for name in finals:
        a = torch.load(first / name, weights_only=False)
        b = torch.load(second / name, weights_only=False)
        assert a["params"].keys() == b["params"].keys()
        for key in a["params"]:
            assert torch.equal(a["params"][key], b["params"][key]), key
        assert_equal_nested(a["optimizer"], b["optimizer"], "optimizer")


def assert_equal_nested(a, b, where):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal_nested(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def resumed_equals_uninterrupted(tmp_path, script, *arguments, launcher=(), finals=("final.pt",)):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    run_example(script, straight, "--phase", "straight", *arguments, launcher=launcher)
    first = run_example(script, resumed, "--phase", "first", *arguments, launcher=launcher)
    last = run_example(script, resumed, "--phase", "resume", *arguments, launcher=launcher)
    assert_same_final(straight, resumed, finals)
    return first, last


@pytest.mark.slow
def test_accelerate_loop(tmp_path):
    needs("accelerate")
    first, last = resumed_equals_uninterrupted(tmp_path, "accelerate_loop.py")
    assert "step 3:" in first and "step 4:" not in first and "step 4:" in last and "step 1:" not in last
    assert "optimizer state:" in last


@pytest.mark.slow
@pytest.mark.parametrize("state_dtype", ["8bit", "bf16"])
def test_overlap_and_compact(tmp_path, state_dtype):
    first, last = resumed_equals_uninterrupted(tmp_path, "overlap_and_compact.py", "--state-dtype", state_dtype)
    assert "step 3:" in first and "step 4:" in last and "step 1:" not in last


@pytest.mark.slow
def test_fsdp2_torchrun(tmp_path):
    """torchrun with 2 ranks (gloo on the CPU): every rank's shards and state."""
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")  # a free port
    first, last = resumed_equals_uninterrupted(tmp_path, "fsdp2_torchrun.py", launcher=torchrun,
                                               finals=("final_rank0.pt", "final_rank1.pt"))
    assert "step 3:" in first and "step 4:" in last and "step 1:" not in last


@pytest.mark.slow
@pytest.mark.parametrize("via", ["optimizers", "optimizer_cls_and_kwargs"])
def test_hf_trainer(tmp_path, via):
    needs("transformers", "accelerate")
    first, last = resumed_equals_uninterrupted(tmp_path, "hf_trainer.py", "--via", via)
    assert "[before the checkpoint]" in first and "[at the end]" in last
    assert (tmp_path / "resumed" / "checkpoint-3" / "optimizer.pt").exists()


@pytest.mark.slow
def test_lightning_module(tmp_path):
    needs("lightning")
    first, last = resumed_equals_uninterrupted(tmp_path, "lightning_module.py")
    assert "step 3:" in first and "step 4:" in last and "step 1:" not in last


@pytest.mark.parametrize("script, module", [("hf_trainer.py", "transformers"), ("accelerate_loop.py", "accelerate"),
                                            ("lightning_module.py", "lightning")])
def test_an_example_without_its_framework_says_how_to_install_it(tmp_path, script, module):
    (tmp_path / f"{module}.py").write_text("raise ImportError('not installed here')\n")  # hides the real one
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--output-dir", str(tmp_path / "run")],
                         cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode != 0
    assert f"skipped: {script} needs {module}; install it with `pip install '{module}'`" in out.stderr, out.stderr
