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


def test_unknown_activations_kind_is_refused():
    r = run_cli("run", "-p", "hi", "--activations", "fp4")
    assert r.returncode == 2
    assert "--activations" in r.stderr and "invalid choice" in r.stderr


def test_int8_activations_with_tensor_parallel_is_refused(tmp_path):
    r = run_cli("run", "-m", str(tmp_path), "-p", "hi", "--tensor-parallel", "--activations", "int8")
    assert r.returncode == 2
    assert "--tensor-parallel" in r.stderr and "Traceback" not in r.stderr


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


def test_unknown_prefill_kind_is_refused():
    r = run_cli("run", "-p", "hi", "--prefill", "fp8")
    assert r.returncode == 2
    assert "--prefill" in r.stderr and "invalid choice" in r.stderr


def test_bf16_prefill_with_tensor_parallel_is_refused(tmp_path):
    r = run_cli("run", "-m", str(tmp_path), "-p", "hi", "--tensor-parallel", "--prefill", "bf16")
    assert r.returncode == 2
    assert "--prefill bf16" in r.stderr and "Traceback" not in r.stderr
