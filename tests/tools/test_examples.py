"""The examples/ scripts, run as a user runs them (`python examples/X.py`, in
a fresh process each), in the slow tier: for each, a run interrupted after its
checkpoint and resumed in a new process ends with the same params and
optimizer state as an uninterrupted run, bitwise. Each needs its framework
(`pip install transformers accelerate lightning`; .ci/run installs the
versions docs/integrations.md names) and is skipped without it. Without it,
an example itself says how to install it; the examples run under `python -P`
as without it; the Lightning one takes pytorch_lightning where lightning is
missing (default tier: no framework needed)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

EXAMPLES = os.path.join(ROOT, "examples")


def needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: pip install {' '.join(missing)}")


def hiding(folder, *modules, **replacements):
    """An environment whose PYTHONPATH puts `folder` first, holding a module
    for each of `modules` that fails to import (as if not installed), and one
    per keyword whose import runs the given source instead of the real one."""
    for module in modules:
        (folder / f"{module}.py").write_text("raise ImportError('not installed here')\n")
    for module, source in replacements.items():
        (folder / f"{module}.py").write_text(source)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))


def run_example(script, output_dir, *arguments, launcher=(), env=None):
    """Runs an example from a scratch folder (the checkout is not on sys.path:
    it imports the installed swap_optimizer) and returns its output."""
    command = [*launcher, os.path.join(EXAMPLES, script), "--output-dir", str(output_dir), *arguments]
    if not launcher:
        command.insert(0, sys.executable)
    out = subprocess.run(command, cwd=output_dir.parent, capture_output=True, text=True, timeout=900, env=env)
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


def resumed_equals_uninterrupted(tmp_path, script, *arguments, launcher=(), finals=("final.pt",), env=None):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    run_example(script, straight, "--phase", "straight", *arguments, launcher=launcher, env=env)
    first = run_example(script, resumed, "--phase", "first", *arguments, launcher=launcher, env=env)
    last = run_example(script, resumed, "--phase", "resume", *arguments, launcher=launcher, env=env)
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
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_module(tmp_path, package):
    """With lightning, and with only the standalone pytorch_lightning (lightning hidden)."""
    needs(package)
    env = None
    if package == "pytorch_lightning":
        (tmp_path / "hidden").mkdir()
        env = hiding(tmp_path / "hidden", "lightning")
    first, last = resumed_equals_uninterrupted(tmp_path, "lightning_module.py", env=env)
    assert "step 3:" in first and "step 4:" in last and "step 1:" not in last


PYTHON_FLAGS = pytest.mark.parametrize("flags", [(), ("-P",)], ids=["python", "python -P"])


@PYTHON_FLAGS
@pytest.mark.parametrize("script, hidden, names, package", [
    ("hf_trainer.py", ("transformers",), "transformers", "transformers"),
    ("accelerate_loop.py", ("accelerate",), "accelerate", "accelerate"),
    ("lightning_module.py", ("lightning", "pytorch_lightning"), "lightning or pytorch_lightning", "lightning"),
])
def test_an_example_without_its_framework_says_how_to_install_it(tmp_path, flags, script, hidden, names, package):
    """Also under `python -P`, which leaves the script's folder (and so common.py) off sys.path."""
    command = [sys.executable, *flags, os.path.join(EXAMPLES, script), "--output-dir", str(tmp_path / "run")]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=hiding(tmp_path, *hidden))
    assert out.returncode != 0
    assert f"skipped: {script} needs {names}; install it with `pip install '{package}'`" in out.stderr, out.stderr


@pytest.mark.slow  # a real run (seconds); the default tier checks -P through the missing-framework messages
def test_an_example_runs_under_python_P(tmp_path):
    """The README runs the package with `python -P`, which leaves the script's
    folder off sys.path; an example run so finds common.py beside it all the
    same. (Without -P: the slow tier's runs, and the tests above.)"""
    command = [sys.executable, "-P", os.path.join(EXAMPLES, "overlap_and_compact.py"), "--output-dir",
               str(tmp_path / "run"), "--phase", "straight", "--steps", "2", "--stop-at", "1"]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "step 2:" in out.stdout and (tmp_path / "run" / "final.pt").exists()
    out = subprocess.run([sys.executable, "-P", os.path.join(EXAMPLES, "fsdp2_torchrun.py"), "--help"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "--phase" in out.stdout, out.stderr[-4000:]


def test_the_lightning_example_takes_pytorch_lightning_without_lightning(tmp_path):
    """Where only the standalone pytorch_lightning is installed, the example
    imports it (a stand-in here, which says so) instead of asking for lightning."""
    env = hiding(tmp_path, "lightning", pytorch_lightning="raise SystemExit('the stand-in pytorch_lightning')\n")
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "lightning_module.py"), "--output-dir",
                          str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert "the stand-in pytorch_lightning" in out.stderr and "skipped" not in out.stderr, out.stderr
