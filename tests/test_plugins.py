"""exl_core.plugins: entry-point discovery, failure isolation, activation, import cost.

Plugins are real installed-looking distributions: a `*.dist-info` folder with METADATA and
entry_points.txt next to a module, on a temporary sys.path entry, found by importlib.metadata
exactly like a pip-installed one. Sockets to anything but loopback are blocked.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import pytest

from exl_core import plugins

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(monkeypatch):
    """A clean plugin manager before and after the test."""
    plugins._reset_for_tests()
    yield
    plugins._reset_for_tests()


def _make_dist(root: Path, dist: str, version: str, eps: dict[str, str], modules: dict[str, str]) -> None:
    """Write module files and a dist-info declaring entry points in the exl_core group."""
    for mod, src in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(src))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "\n".join(f"{k} = {v}" for k, v in eps.items())
    (info / "entry_points.txt").write_text(f"[exl_core]\n{lines}\n")


GOOD = """
    from exl_core.plugins import hookimpl
    CALLS = {"activate": 0}

    @hookimpl
    def exl_core_register_integration():
        return {"name": "good", "version": "1.2.3", "kind": "test"}

    @hookimpl
    def exl_core_activate():
        CALLS["activate"] += 1

    @hookimpl
    def exl_core_register_metrics():
        return {"answer_len": len}
"""
BROKEN_IMPORT = """
    raise ImportError("this plugin needs a package that is not installed: {tag}")
"""
BAD_ACTIVATE = """
    from exl_core.plugins import hookimpl

    @hookimpl
    def exl_core_activate():
        raise RuntimeError("activation exploded")

    @hookimpl
    def exl_core_register_metrics():
        return {"answer_len": str}     # clashes with the good plugin's metric
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    tag = uuid.uuid4().hex[:8]          # fresh module names: nothing cached from another test
    names = {"good": f"good_{tag}", "broken": f"broken_{tag}", "bad": f"bad_{tag}"}
    _make_dist(tmp_path, f"exl-good-{tag}", "1.2.3", {f"good{tag}": names["good"]}, {names["good"]: GOOD})
    _make_dist(tmp_path, f"exl-broken-{tag}", "0.0.1", {f"broken{tag}": names["broken"]},
               {names["broken"]: BROKEN_IMPORT.replace("{tag}", tag)})
    _make_dist(tmp_path, f"exl-bad-{tag}", "0.2", {f"bad{tag}": names["bad"]}, {names["bad"]: BAD_ACTIVATE})
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path, tag, names


def test_discovery_reports_broken_plugin_by_name_and_keeps_the_others(fresh, plugin_dir):
    _, tag, names = plugin_dir
    with pytest.warns(plugins.PluginWarning, match=f"broken{tag}"):
        pm = plugins.get_plugin_manager()
    assert pm.has_plugin(f"good{tag}") and pm.has_plugin(f"bad{tag}")
    assert not pm.has_plugin(f"broken{tag}")
    assert plugins.get_plugin_manager() is pm          # one manager per process

    rows = {r["name"]: r for r in plugins.list_plugins()}
    good = rows[f"good{tag}"]
    assert good["distribution"] == f"exl-good-{tag}" and good["version"] == "1.2.3"
    assert good["entry_point"] == names["good"]
    assert good["integration"] == {"name": "good", "version": "1.2.3", "kind": "test"}
    assert "exl_core_activate" in good["hooks"] and good["error"] is None
    broken = rows[f"broken{tag}"]
    assert broken["distribution"] == f"exl-broken-{tag}" and broken["version"] == "0.0.1"
    assert "not installed" in broken["error"] and broken["hooks"] == []
    assert [r["name"] for r in plugins.list_plugins()] == sorted(rows)


def test_activate_runs_once_and_isolates_a_failing_hook(fresh, plugin_dir):
    _, tag, names = plugin_dir
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        activated = plugins.activate_plugins()
        again = plugins.activate_plugins()
    good = sys.modules[names["good"]]
    assert f"good{tag}" in activated and f"bad{tag}" not in activated
    assert again == activated and good.CALLS["activate"] == 1   # repeated calls report, never re-run
    msgs = [str(w.message) for w in caught if issubclass(w.category, plugins.PluginWarning)]
    assert any(f"bad{tag}" in m and "activation exploded" in m for m in msgs), msgs
    assert any(f"broken{tag}" in m for m in msgs), msgs
    row = {r["name"]: r for r in plugins.list_plugins()}[f"bad{tag}"]
    assert "activation exploded" in row["error"]


def test_collect_merges_registries_and_warns_on_clash(fresh, plugin_dir):
    _, tag, _ = plugin_dir
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = plugins.collect("exl_core_register_metrics")
    assert metrics["answer_len"] in (len, str) and list(metrics) == ["answer_len"]
    assert any("answer_len" in str(w.message) and "already provided" in str(w.message) for w in caught)


def test_disable_switch_skips_discovery(fresh, plugin_dir, monkeypatch):
    monkeypatch.setenv(plugins.DISABLE_ENV, "1")
    assert plugins.activate_plugins() == []
    assert plugins._pm is None                 # not even the entry points were scanned
    assert sys.modules.get(plugin_dir[2]["good"]) is None


def test_in_process_plugin_registered_after_activation_is_activated(fresh):
    plugins.activate_plugins()
    seen = []

    class Late:
        @plugins.hookimpl
        def exl_core_activate(self):
            seen.append("late")

        @plugins.hookimpl
        def exl_core_register_integration(self):
            return {"name": "late", "version": "0", "kind": "test"}

    name = plugins.register_plugin(Late(), name="late-plugin")
    assert seen == ["late"]
    row = {r["name"]: r for r in plugins.list_plugins()}[name]
    assert row["integration"]["name"] == "late" and row["distribution"] is None


def test_format_and_architecture_hooks_reach_their_registries(fresh, monkeypatch):
    from exl_core import config
    from exl_core.formats import base
    monkeypatch.setattr(base, "FORMATS", dict(base.FORMATS))          # restored after the test
    monkeypatch.setattr(config, "ARCHITECTURES", dict(config.ARCHITECTURES))
    tag = uuid.uuid4().hex[:6]

    class FakeFormat:
        name = f"fake{tag}"
        tensor_suffixes = ("fake_w",)

        def detect(self, quant_config, tensor_names):
            return any(n.endswith(".fake_w") for n in tensor_names)

        def has_layer(self, tensor_names, prefix):
            return f"{prefix}.fake_w" in tensor_names

        def load_layer(self, read, shape, prefix, in_features, out_features, quant_config):
            raise NotImplementedError

    class Provider:
        @plugins.hookimpl
        def exl_core_register_formats(self):
            return [FakeFormat()]

        @plugins.hookimpl
        def exl_core_register_architectures(self):
            return [config.ArchSpec(f"Fake{tag}ForCausalLM", default_attention_bias=True)]

    class Broken:
        @plugins.hookimpl
        def exl_core_register_architectures(self):
            raise ValueError("no spec today")

    plugins.register_plugin(Provider(), name="provider")
    plugins.register_plugin(Broken(), name="broken-registry")
    with pytest.warns(plugins.PluginWarning, match="broken-registry.*no spec today"):
        plugins.activate_plugins()
    assert isinstance(base.FORMATS[f"fake{tag}"], FakeFormat)
    assert base.detect_format(None, {"model.layers.0.mlp.up_proj.fake_w"}).name == f"fake{tag}"
    assert config.ARCHITECTURES[f"Fake{tag}ForCausalLM"].default_attention_bias


def _run(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=str(REPO), timeout=120)


def test_broken_plugin_never_breaks_import_exl_core(plugin_dir):
    root, tag, _ = plugin_dir
    r = _run("""
        import warnings, json
        warnings.simplefilter("always")
        import exl_core, exl_core.plugins as p
        names = p.activate_plugins()
        print(json.dumps(names))
    """, extra_path=root)
    assert r.returncode == 0, r.stderr
    assert f"good{tag}" in json.loads(r.stdout.strip().splitlines()[-1])
    assert f"broken{tag}" in r.stderr and "PluginWarning" in r.stderr


def test_activation_keeps_import_cheap_and_registers_hf_quantizer_on_demand():
    """With the adapters installed, activation imports neither transformers nor langchain/llama_index,
    yet transformers' registry knows `exl2` as soon as it is imported."""
    from importlib.metadata import entry_points
    if "hf" not in {ep.name for ep in entry_points(group="exl_core")}:
        pytest.skip("exl-core-hf not installed (pip install -e adapters/hf --no-build-isolation)")
    r = _run("""
        import sys, json
        import exl_core, exl_core.plugins as p
        p.activate_plugins()
        heavy = sorted(m for m in ("transformers", "langchain_core", "llama_index.core") if m in sys.modules)
        from transformers.quantizers import auto
        print(json.dumps({"heavy": heavy, "exl2": "exl2" in auto.AUTO_QUANTIZER_MAPPING,
                          "cfg": auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get("exl2").__name__}))
    """)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"heavy": [], "exl2": True, "cfg": "ExlQuantConfig"}


@pytest.mark.slow      # a second fresh process importing transformers
def test_hf_quantizer_registers_when_transformers_was_imported_first():
    from importlib.metadata import entry_points
    if "hf" not in {ep.name for ep in entry_points(group="exl_core")}:
        pytest.skip("exl-core-hf not installed (pip install -e adapters/hf --no-build-isolation)")
    r = _run("""
        from transformers.quantizers import auto
        assert "exl2" not in auto.AUTO_QUANTIZER_MAPPING
        import exl_core, exl_core.plugins as p
        p.activate_plugins()
        print(auto.AUTO_QUANTIZER_MAPPING["exl2"].__name__)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "ExlHfQuantizer"


def test_installed_adapters_declare_entry_points():
    from importlib.metadata import entry_points
    eps = {ep.name: ep for ep in entry_points(group="exl_core")}
    expected = {"hf": "exl-core-hf", "langchain": "langchain-exl", "llamaindex": "llama-index-llms-exl"}
    missing = [n for n in expected if n not in eps]
    if missing:
        pytest.skip(f"adapters not installed: {missing} (see README: pip install -e adapters/...)")
    for name, dist in expected.items():
        assert eps[name].dist.metadata["Name"] == dist
        mod = eps[name].load()                 # the plugin module itself must import cheaply
        assert hasattr(mod, "exl_core_register_integration")


# an exception that escapes the engine's worker thread (a caller's sink raising into it) fails the test
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


# ---- SharedEngine: one worker thread serving many callers ------------------------------------------
#
# A stand-in model (embedding -> one causal attention layer through the cache -> head) and a
# character tokenizer keep these tests independent of the real Llama model. Reference: greedy
# decoding by recomputing the whole sequence without any cache, one job at a time.

import asyncio  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402

from exl_core.errors import InputError  # noqa: E402


class AttnLM(torch.nn.Module):
    def __init__(self, vocab=40, hidden=32, heads=2, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.h, self.d = heads, hidden // heads
        self.config = types.SimpleNamespace(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                                            num_attention_heads=heads, num_key_value_heads=heads, head_dim=self.d,
                                            sliding_window=None, max_position_embeddings=1024, eos_token_ids=[])
        self.emb = torch.randn(vocab, hidden, generator=g)
        self.pos = torch.randn(1024, hidden, generator=g) * 0.5       # position signal (no rope needed)
        self.wq, self.wk, self.wv = (torch.randn(hidden, hidden, generator=g) * 0.4 for _ in range(3))
        self.head = torch.randn(hidden, vocab, generator=g) * 2
        self.fail_next = False

    device = property(lambda self: torch.device("cpu"))
    dtype = property(lambda self: torch.float32)

    def forward(self, ids, ctx):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("stand-in kernel failure")
        x = self.emb[ids] + self.pos[ctx.positions]                   # (T, hidden)
        t = x.shape[0]
        q, k, v = ((x @ w).view(t, self.h, self.d) for w in (self.wq, self.wk, self.wv))
        x = x + ctx.attend(0, q, k, v, self.d ** -0.5, None).reshape(t, -1)
        if ctx.logit_rows is not None:
            x = x[ctx.logit_rows]
        return (x @ self.head).float()


class LetterTokenizer:
    eos_token_ids: set = set()
    bos_token_id = None
    special_ids = frozenset()
    byte_fallback_ids = frozenset()

    def encode(self, text, add_bos=None, special=True):
        return [ord(c) - 97 for c in text]

    def decode(self, ids, skip_special=True):
        return "".join(chr(97 + (i % 26)) if i < 26 else "0123456789!?.,"[i - 26] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)


def _greedy_reference(model, prompt, n):
    from exl_core.model.context import ContiguousContext
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model.forward(torch.tensor(ids), ContiguousContext([len(ids)], [None]))
            ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


@pytest.fixture
def engine():
    model = AttnLM(seed=int.from_bytes(os.urandom(2), "little"))
    return plugins.SharedEngine("stand-in", cache_tokens=2048, model=model, tokenizer=LetterTokenizer())


def _job(prompt, n=12):
    import exl_core
    return exl_core.Job(prompt, max_new_tokens=n, sampler=exl_core.SamplerSettings(temperature=0))


def test_engine_serves_concurrent_threads_and_asyncio(engine):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))
    prompts = [torch.randint(0, 26, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (7,), generator=g)]
    want = [_greedy_reference(engine.model, p, 12) for p in prompts]
    got: dict[int, list] = {}

    def worker(i):
        job = _job(prompts[i])
        results = list(engine.stream(job))
        assert results[-1].finish_reason == "length"
        got[i] = [t for r in results for t in r.token_ids]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()

    async def main():                                  # meanwhile, asyncio callers
        async def one(i):
            return i, [t async for r in engine.astream(_job(prompts[i])) for t in r.token_ids]
        return await asyncio.gather(*(one(i) for i in (4, 5)))
    for i, toks in asyncio.run(main()):
        got[i] = toks
    batch_jobs = [_job(prompts[6])]
    texts = engine.run(batch_jobs)
    got[6] = batch_jobs[0].generated
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(7)] == want
    assert texts == [LetterTokenizer().decode(want[6])]


def test_engine_abandoned_stream_cancels_and_errors_reach_callers(engine):
    job = _job(list(range(5)), n=200)
    it = engine.stream(job)
    next(it)
    it.close()                                         # caller walks away after one token
    for _ in range(100):
        if job.done:
            break
        threading.Event().wait(0.05)
    assert job.done and job.finish_reason in ("cancelled", "callback") and len(job.generated) < 200

    with pytest.raises(InputError):                    # bad request: raised in the caller's thread
        list(engine.stream(_job([99, 1, 2])))

    engine.model.fail_next = True                      # model failure: the waiting caller hears it
    with pytest.raises(RuntimeError, match="stand-in kernel failure"):
        list(engine.stream(_job([1, 2, 3])))
    ok = _job([3, 1, 4, 1, 5], n=6)                    # and the engine keeps working afterwards
    list(engine.stream(ok))
    assert ok.generated == _greedy_reference(engine.model, [3, 1, 4, 1, 5], 6)


def test_shared_engine_is_one_per_folder(monkeypatch, tmp_path):
    loads = []

    def fake_load(path, device="cpu", dtype=None):
        loads.append(path)
        return AttnLM(), LetterTokenizer()
    import exl_core
    monkeypatch.setitem(vars(exl_core), "load_model", fake_load)   # no real loader needed
    plugins.release_engines()
    try:
        a = plugins.shared_engine(tmp_path, cache_tokens=512)
        b = plugins.shared_engine(str(tmp_path) + "/.", cache_tokens=512)
        c = plugins.shared_engine(tmp_path, cache_tokens=1024)
        assert a is b and c is not a and c.model is a.model and len(loads) == 1   # weights loaded once
        assert a.cache.max_tokens != c.cache.max_tokens
    finally:
        plugins.release_engines()


def test_engine_one_jobs_error_leaves_the_others_running(engine):
    """A step error that ends one job (every token banned) reached every caller of the engine and cancelled their
    jobs; now only that job's caller hears it, as the Generator's own astream does."""
    import exl_core
    good = _job([1, 2, 3, 4], n=30)
    it = engine.stream(good)
    first = next(it)                                   # running
    bad = exl_core.Job([5, 6], max_new_tokens=4,
                       sampler=exl_core.SamplerSettings(temperature=1.0, banned_tokens=list(range(40))))
    with pytest.raises(exl_core.errors.SamplerError, match="every token is banned"):
        list(engine.stream(bad))
    rest = list(it)
    assert rest[-1].finish_reason == "length"
    got = [t for r in [first, *rest] for t in r.token_ids]
    assert got == _greedy_reference(engine.model, [1, 2, 3, 4], 30)


def test_engine_async_enqueue_does_not_hold_the_event_loop_for_a_step(engine):
    """astream's enqueue waits for the generator's lock, which a running step holds: it ran on the event loop's
    thread and stalled every other task for a whole step. It now runs in a thread whenever the lock is busy."""
    import time
    started = threading.Event()

    def slow(ids, row):
        started.set()
        time.sleep(1.0)                                    # a step that holds the lock ~1 s
    busy = _job([3, 1, 4], n=1)
    busy.token_filter = slow
    t = threading.Thread(target=lambda: list(engine.stream(busy)))
    t.start()
    assert started.wait(30)

    from exl_core.testing import event_loop_longest_stall
    results = []

    async def consume():
        results.extend([r async for r in engine.astream(_job([2, 7, 1], n=5))])
    gap = event_loop_longest_stall(consume)
    t.join(30)
    assert results[-1].finish_reason == "length"
    assert gap < 0.5, gap                                  # the loop kept ticking through the step (~1 s)


def test_engine_run_cancels_submitted_jobs_when_a_later_one_is_refused(engine):
    """run() submitted jobs one by one: when a later prompt was refused the earlier ones ran on unread."""
    ok = _job([1, 2, 3], n=500)
    with pytest.raises(InputError):
        engine.run([ok, _job([99, 1, 2])])             # token 99 is outside the vocabulary
    for _ in range(100):
        if ok.done:
            break
        threading.Event().wait(0.05)
    assert ok.done and ok.finish_reason == "cancelled" and len(ok.generated) < 500


def test_released_engine_stops_its_worker_and_is_freed(monkeypatch, tmp_path):
    """release_engines() forgot the engines but their worker threads ran on, holding model and cache; and a daemon
    worker still inside torch at interpreter exit aborted the process (close_engines runs at exit)."""
    import gc
    import weakref
    import exl_core
    monkeypatch.setitem(vars(exl_core), "load_model",
                        lambda path, device="cpu", dtype=None: (AttnLM(), LetterTokenizer()))
    plugins.release_engines()
    eng = plugins.shared_engine(tmp_path, cache_tokens=512)
    list(eng.stream(_job([1, 2], n=3)))
    worker = eng._thread
    assert worker.is_alive()
    long_job = _job([3, 4], n=100000)
    it = eng.stream(long_job)
    next(it)
    plugins.close_engines()                            # what atexit runs: the worker stops, the running job ends
    assert not worker.is_alive()
    assert long_job.done and long_job.finish_reason == "cancelled"
    list(it)
    list(eng.stream(_job([1, 2], n=3)))                # used again: a new worker
    worker = eng._thread
    ref = weakref.ref(eng)
    del eng, it, long_job                             # a job's callback holds its engine
    plugins.release_engines()
    gc.collect()
    assert not worker.is_alive() and ref() is None


def test_engine_stream_ends_when_the_jobs_own_callback_stops_it(engine):
    """A job whose callback returns False is ended by the generator (finish "callback") after its result went to
    the caller's queue with no finish reason: the stream waited forever (or saw the reason only by a race)."""
    seen = []
    job = _job([1, 2, 3], n=50)
    job.callback = lambda r: seen.append(r) or len(seen) < 3
    results = list(engine.stream(job))
    assert len(results) == 3 and results[-1].finish_reason == "callback" and job.finish_reason == "callback"
    raising = _job([4, 5, 6], n=50)

    def boom(r):
        raise ValueError("user callback failed")
    raising.callback = boom
    with pytest.raises(ValueError, match="user callback failed"):
        list(engine.stream(raising))
    assert raising.done


def test_adapter_setting_helpers():
    """The adapters' dtype and stop settings: "fp16" raised a bare AttributeError (getattr(torch, "fp16")), and a
    per-call stop string was split into one stop per character."""
    assert plugins.dtype_setting("fp16", "X") is torch.float16
    assert plugins.dtype_setting("bfloat16", "X") is torch.bfloat16 and plugins.dtype_setting(None, "X") is None
    assert plugins.dtype_setting(torch.float32, "X") is torch.float32
    with pytest.raises(InputError, match="ChatExl: dtype='int8' is not supported"):
        plugins.dtype_setting("int8", "ChatExl")
    assert plugins.stop_strings(["a", "bc"], "QQQe", owner="X") == ["a", "bc", "QQQe"]
    assert plugins.stop_strings(None, None, owner="X") is None
    assert plugins.stop_strings(["a"], ["a", "b"], owner="X") == ["a", "b"]
    with pytest.raises(InputError, match="Exl: stop must be a string or a list of strings"):
        plugins.stop_strings(None, [1, 2], owner="Exl")


def test_engine_astream_cancelled_during_its_enqueue_leaves_no_job_running(engine):
    """astream's enqueue runs in an executor thread; a task cancelled while it waits must not leave the job it was
    enqueuing to run on unread."""
    gate, entered = threading.Event(), threading.Event()
    enqueue = engine.generator.enqueue

    def slow(job):
        entered.set()
        gate.wait(10)
        return enqueue(job)
    engine.generator.enqueue = slow
    job = _job([1, 2, 3], n=400)

    async def main():                                  # the loop lives on after the cancel, as a server's does
        task = asyncio.ensure_future(engine.astream(job).__anext__())
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        for _ in range(200):
            if job.done:
                break
            await asyncio.sleep(0.05)
    asyncio.run(main())
    assert job.done and job.finish_reason == "cancelled" and len(job.generated) < 400


def test_engine_survives_a_callback_raising_on_its_cancelled_result(engine):
    """A caller leaving a stream whose job's own callback raises on the cancelled result: the cancel, run by the
    worker, let the error out and killed the thread; every other caller then waited forever."""
    other = _job([4, 5, 6], n=40)
    it_other = engine.stream(other)
    next(it_other)
    job = _job([1, 2, 3], n=300)

    def cb(r):
        if r.finish_reason == "cancelled":
            raise ValueError("user callback failed on the cancelled result")
    job.callback = cb
    it = engine.stream(job)
    next(it)
    it.close()                                         # the worker cancels it between steps
    rest = list(it_other)
    assert rest[-1].finish_reason == "length" and engine._thread.is_alive()
    assert other.generated == _greedy_reference(engine.model, [4, 5, 6], 40)
