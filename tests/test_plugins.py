"""exl_core.plugins: entry-point discovery, failure isolation, activation, import cost.

Plugins are real installed-looking distributions: a `*.dist-info` folder with METADATA and
entry_points.txt next to a module, on a temporary sys.path entry, found by importlib.metadata
exactly like a pip-installed one. Sockets to anything but loopback are blocked.
"""
from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import pytest

from exl_core import plugins

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Refuse socket connections to anything but loopback / unix sockets."""
    real = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host not in ("127.0.0.1", "::1", "localhost") and not str(host).startswith("127."):
            raise RuntimeError(f"network access attempted in a test: {address!r}")
        return real(self, address)
    monkeypatch.setattr(socket.socket, "connect", guarded)


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
    assert again == [] and good.CALLS["activate"] == 1
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
