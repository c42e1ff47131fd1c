"""The `exl` command end to end (subprocess, as a user runs it)."""
import subprocess
import sys

import pytest


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "exl_core.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.real_model
def test_run_default_model_answers_paris(smollm2_dir):
    r = run_cli("run", "-p", "What is the capital of France?", "--max-new-tokens", "24", "--threads", "2")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "decode:" in r.stderr and "tokens/s" in r.stderr


@pytest.mark.real_model
def test_run_with_int8_activations_answers_paris(smollm2_dir):
    r = run_cli("run", "-p", "What is the capital of France?", "--max-new-tokens", "24", "--threads", "2",
                "--activations", "int8")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_empty_prompt_is_a_clear_error():
    r = run_cli("run", "-p", "   ")
    assert r.returncode == 2
    assert "prompt is empty" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_folder_is_a_clear_error(tmp_path):
    r = run_cli("run", "-m", str(tmp_path / "nope"), "-p", "hi")
    assert r.returncode == 2
    assert "not found" in r.stderr and "Traceback" not in r.stderr


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    r = run_cli("run", "-m", str(tmp_path), "-p", "hi")
    assert r.returncode == 2
    assert "GPT2LMHeadModel" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flag,bad", [("--activations", "fp4"), ("--prefill", "fp8")])
def test_unknown_lossy_mode_kind_is_refused(flag, bad):
    r = run_cli("run", "-p", "hi", flag, bad)
    assert r.returncode == 2
    assert flag in r.stderr and "invalid choice" in r.stderr


@pytest.mark.parametrize("flag,kind,named", [("--activations", "int8", "--tensor-parallel"),
                                             ("--prefill", "bf16", "--prefill bf16")])
def test_lossy_mode_with_tensor_parallel_is_refused(tmp_path, flag, kind, named):
    r = run_cli("run", "-m", str(tmp_path), "-p", "hi", "--tensor-parallel", flag, kind)
    assert r.returncode == 2
    assert named in r.stderr and "Traceback" not in r.stderr
