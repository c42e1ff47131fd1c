"""LoRA adapters: on the fly vs merged references, per-row mixes, merges of quantized layers,
and clear refusals of bad adapters. Adapters are random, written in PEFT's file layout."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from exl_core.errors import LoraError
from exl_core.model.context import ContiguousContext
from exl_core.model.lora import load_lora, lora_manager, row_plan, set_active

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUB = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
       "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": (h, nq), "k_proj": (h, nkv), "v_proj": (h, nkv), "o_proj": (nq, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}       # (in, out)


def make_adapter(folder: Path, model_dir: Path, r: int = 4, alpha: float = 8.0, targets=TARGETS,
                 layers=None, std: float = 0.1, config_r=None, seed=None, bad_in: bool = False,
                 rslora: bool = False, as_bin: bool = False) -> Path:
    """A random PEFT LoRA folder for the model in `model_dir` (B non-zero, unlike a fresh PEFT init)."""
    from safetensors.torch import save_file
    cfg = json.loads((model_dir / "config.json").read_text())
    layers = range(cfg["num_hidden_layers"]) if layers is None else layers
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ())))
    tensors = {}
    for li in layers:
        for t in targets:
            n_in, n_out = _shapes(cfg)[t]
            key = f"base_model.model.model.layers.{li}.{SUB[t]}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in + (3 if bad_in else 0), generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * std
    folder.mkdir(parents=True, exist_ok=True)
    if as_bin:
        torch.save(tensors, folder / "adapter_model.bin")
    else:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": config_r or r, "lora_alpha": alpha, "target_modules": list(targets),
        "use_rslora": rslora, "base_model_name_or_path": str(model_dir), "bias": "none"}))
    return folder


def merged_folder(model_dir: Path, adapters: list[tuple[Path, float]], dst: Path) -> Path:
    """Dense copy of model_dir with W += sum w * scale * B @ A, computed in float64 from the files."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(model_dir, dst)
    st = next(dst.glob("*.safetensors"))
    w = load_file(str(st))
    for folder, weight in adapters:
        cfg = json.loads((folder / "adapter_config.json").read_text())
        scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
        ad = load_file(str(folder / "adapter_model.safetensors"))
        for k, a in ad.items():
            if ".lora_A." in k:
                mod = k[len("base_model.model."):].replace(".lora_A.weight", "")
                b = ad[k.replace("lora_A", "lora_B")]
                base = w[f"{mod}.weight"]
                w[f"{mod}.weight"] = (base.double() + weight * scale * b.double() @ a.double()).to(base.dtype)
    save_file(w, str(st), metadata={"format": "pt"})
    return dst


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids).logits.float()


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    from exl_core.loader import load_model
    model, _ = load_model(tiny_llama_dir, dtype=torch.float32, load_tokenizer=False)
    return model


def _fresh(tiny_llama_dir):
    from exl_core.loader import load_model
    return load_model(tiny_llama_dir, dtype=torch.float32, load_tokenizer=False)[0]


# fp32 end to end; differences come from summation order only (logits are O(1..10)).
ATOL = 2e-4


def test_on_the_fly_equals_merged_reference(tiny_llama_dir, tmp_path):
    model = _fresh(tiny_llama_dir)
    a = make_adapter(tmp_path / "a", tiny_llama_dir, r=4, alpha=8)
    b = make_adapter(tmp_path / "b", tiny_llama_dir, r=8, alpha=4, targets=("q_proj", "v_proj", "down_proj"),
                     rslora=True)
    ids = torch.randint(0, 49152, (2, 11))
    plain = model.forward_batch(ids)
    load_lora(model, a)
    load_lora(model, b)
    assert torch.equal(model.forward_batch(ids), plain)      # loaded, not chosen: no effect
    set_active(model, {"a": 1.0, "b": 0.5})
    got = model.forward_batch(ids)
    set_active(model, None)
    ref = hf_logits(merged_folder(tiny_llama_dir, [(a, 1.0), (b, 0.5)], tmp_path / "merged"), ids)
    assert (got - plain).abs().max() > 100 * ATOL            # the adapters matter
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-4)


def test_merge_unmerge_dense(tiny_llama_dir, tmp_path):
    model = _fresh(tiny_llama_dir)
    a = make_adapter(tmp_path / "a", tiny_llama_dir)
    ids = torch.randint(0, 49152, (1, 9))
    plain = model.forward_batch(ids)
    ad = load_lora(model, a, name="x")
    ad.activate()
    fly = model.forward_batch(ids)
    set_active(model, None)
    report = ad.merge()
    assert max(report.values()) < 1e-6
    merged = model.forward_batch(ids)
    torch.testing.assert_close(merged, fly, atol=ATOL, rtol=1e-4)
    with pytest.raises(LoraError, match="merged"):
        set_active(model, {"x": 1.0})
    ad.unmerge()
    assert torch.equal(model.forward_batch(ids), plain)      # exact restore


def test_rows_with_different_mixes_match_running_alone(tiny_llama_dir, tmp_path):
    model = _fresh(tiny_llama_dir)
    load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir), name="a")
    load_lora(model, make_adapter(tmp_path / "b", tiny_llama_dir, r=2), name="b")
    mixes = [{"a": 1.0}, {"b": 1.0}, {"a": 1.0, "b": 0.5}, {}]
    lens = [5, 3, 7, 4]
    seqs = [torch.randint(0, 49152, (n,)) for n in lens]
    alone = []
    for s, mix in zip(seqs, mixes):
        set_active(model, mix)
        alone.append(model.forward_batch(s[None])[0])
    set_active(model, None)
    plan, r = [], 0
    for n, mix in zip(lens, mixes):
        plan.append((r, r + n, mix))
        r += n
    ctx = ContiguousContext(lens, [None] * len(lens))
    with torch.inference_mode(), row_plan(model, plan):
        out = torch.full((sum(lens), 49152), float("nan"))
        out[:] = model.forward(torch.cat(seqs), ctx)
    torch.testing.assert_close(out, torch.cat(alone), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("fmt,bits", [("gptq", 4), ("exl2", 4)])
def test_quantized_on_the_fly_and_merge(tiny_llama_dir, tmp_path, fmt, bits):
    from exl_core.loader import load_model
    from exl_core.quantize.rtn import quantize_model_rtn
    qdir = quantize_model_rtn(tiny_llama_dir, tmp_path / "q", fmt=fmt, bits=bits, group_size=32)
    model, _ = load_model(qdir, dtype=torch.float32, load_tokenizer=False)
    ad = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir), name="a")
    layers = dict(model.linear_layers())
    name = "model.layers.1.mlp.down_proj"
    layer = layers[name]
    assert layer.is_quantized
    base_w = layer.dense_weight(torch.float64)                   # float64 dequantisation
    target = base_w + ad.delta(name).double()
    x = torch.randn(6, layer.in_features)
    set_active(model, {"a": 1.0})
    y = torch.full((6, layer.out_features), float("nan"))
    y[:] = layer(x)
    set_active(model, None)
    torch.testing.assert_close(y.double(), x.double() @ target.t(), atol=1e-4, rtol=1e-4)

    report = ad.merge()
    # re-quantizing costs about what quantizing the base did (4-bit RTN, groups of 32)
    assert 0 < max(report.values()) < 0.15
    new_w = layer.dense_weight(torch.float64)
    assert layer.is_quantized and torch.equal(layer.packed.groups, ad._saved[name][1].groups)
    assert (new_w - target).norm() < (base_w - target).norm()   # the merge moved towards W + delta
    ad.unmerge()
    assert torch.equal(layer.dense_weight(torch.float64), base_w)


def test_bad_adapters(tiny_llama_dir, tmp_path, base):
    with pytest.raises(LoraError, match="rank mismatch"):
        load_lora(base, make_adapter(tmp_path / "rank", tiny_llama_dir, r=4, config_r=8))
    with pytest.raises(LoraError, match="do not match the base model"):
        load_lora(base, make_adapter(tmp_path / "shape", tiny_llama_dir, bad_in=True))
    with pytest.raises(LoraError, match="layers.5.*not an attention/MLP projection.*2 layers"):
        load_lora(base, make_adapter(tmp_path / "absent", tiny_llama_dir, layers=[5]))
    with pytest.raises(LoraError, match="pickled"):
        load_lora(base, make_adapter(tmp_path / "pkl", tiny_llama_dir, as_bin=True))
    with pytest.raises(LoraError, match="adapter_config.json not found"):
        load_lora(base, tmp_path)
    # an adapter made for a model with another hidden size
    other = tmp_path / "other_model"
    other.mkdir()
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["hidden_size"] = 32
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match="do not match the base model"):
        load_lora(base, make_adapter(tmp_path / "mismatch", other))
    # nothing half-loaded, and no empty manager left behind (its existence keeps a model off CUDA graphs)
    assert lora_manager(base) is None or not lora_manager(base).adapters
    ok = load_lora(base, tmp_path / "pkl", allow_pickle=True)    # trusted: loads
    assert ok.rank == 4
    with pytest.raises(LoraError, match="already loaded"):
        load_lora(base, tmp_path / "pkl", allow_pickle=True)
    with pytest.raises(LoraError, match="no adapter named"):
        set_active(base, {"nope": 1.0})
    for nan in (float("nan"), float("inf"), True):   # activate() refused these; merge() wrote NaN weights
        with pytest.raises(LoraError, match="merge: weight of adapter .* must be a finite number"):
            ok.merge(nan)
    assert not ok.merged
    ok.unload()
    # adapter_config.json of the wrong JSON kinds: a LoraError naming the file, not an AttributeError
    folder = make_adapter(tmp_path / "kinds", tiny_llama_dir)
    good = json.loads((folder / "adapter_config.json").read_text())
    for cfg, what in (([good], "expected a JSON object"), (dict(good, rank_pattern=["q_proj"]), "'rank_pattern' must"),
                      (dict(good, alpha_pattern="q_proj"), "'alpha_pattern' must")):
        (folder / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(LoraError, match=f"adapter_config.json: {what}"):
            load_lora(base, folder)
    # values json reads but no adapter can have: NaN / Infinity scale every update into NaN, "false" is truthy
    for over, what in (({"lora_alpha": float("nan")}, "'lora_alpha' must be a positive finite number"),
                       ({"lora_alpha": float("inf")}, "'lora_alpha' must be a positive finite number"),
                       ({"r": 4.5}, "'r' must be a positive integer"),
                       ({"rank_pattern": {"q_proj": "four"}}, "'rank_pattern.'q_proj'.' must be a positive integer"),
                       ({"rank_pattern": {"q_proj": None}}, "'rank_pattern.'q_proj'.' must be a positive integer"),
                       ({"alpha_pattern": {"q_proj": -2}}, "'alpha_pattern.'q_proj'.' must be a positive finite"),
                       ({"alpha_pattern": {"q_proj": float("nan")}}, "'alpha_pattern.'q_proj'.' must be a positive"),
                       ({"use_rslora": "false"}, "'use_rslora' must be true or false")):
        (folder / "adapter_config.json").write_text(json.dumps(dict(good, **over)))
        with pytest.raises(LoraError, match=f"adapter_config.json: {what}"):
            load_lora(base, folder)
    (folder / "adapter_config.json").write_text(json.dumps(dict(good, r=float(good["r"]))))
    load_lora(base, folder, name="float_rank").unload()         # 4.0 is a rank, as PEFT would read it
    (folder / "adapter_config.json").write_text(json.dumps(good))
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    save_file(dict(tensors, **{key.replace("lora_A.weight", "lora_A.default.weight"): tensors[key].clone()}),
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="has more than one lora_A weight"):    # one of the two was dropped silently
        load_lora(base, folder)
    (folder / "adapter_config.json").write_text('{"r": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(LoraError, match="adapter_config.json: unreadable JSON .*nested too deeply"):
        load_lora(base, folder)          # was a bare RecursionError


def test_merge_into_weights_rewritten_as_uniform4_rows(exl2_act_order_dir, tiny_llama_dir, tmp_path):
    """EXL2 rewritten as uniform 4-bit rows (loader.as_uniform4_weights, the CUDA default): a merge re-quantizes in
    the file's own layout (its widths, groups and order), then rewrites again -- the same weights as merging into the
    model loaded without the rewrite; the model's logits agree; q/k/v and gate/up share one permutation again (the
    permuted norm's condition)."""
    from test_norm_perm import share_group_perms

    from exl_core.loader import as_uniform4_weights, input_groups, load_model
    from exl_core.model.linear import shared_perm
    plain = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    rewritten = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    for model in (plain, rewritten):
        share_group_perms(model)                  # one order per group, as converters write them
    assert as_uniform4_weights(rewritten, max_growth=10.0) > 0
    assert all(shared_perm(g) is not None for g in input_groups(rewritten))
    folder = make_adapter(tmp_path / "a", tiny_llama_dir, seed=3)
    for model in (plain, rewritten):
        load_lora(model, folder, name="a").merge()
    a, b = dict(plain.linear_layers()), dict(rewritten.linear_layers())
    assert any(m.packed.rows is not None for m in b.values())             # extra rows again after the merge
    # one permutation tensor per group again (shared_perm itself declines layers with a LoRA hook attached)
    assert all(m.packed.perm is g[0].packed.perm for g in input_groups(rewritten) for m in g)
    for name, layer in a.items():
        torch.testing.assert_close(b[name].dense_weight(torch.float64), layer.dense_weight(torch.float64),
                                   rtol=0, atol=1e-6)
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(rewritten.forward_batch(ids), plain.forward_batch(ids), rtol=0, atol=1e-4)


def test_merges_are_undone_in_reverse_order_only(tiny_llama_dir, tmp_path):
    """Each merge saves the weights as they were (holding the merges before it): unmerging out of order would
    restore weights without a later adapter's update while it still counts as merged (regression: silently
    corrupted base weights)."""
    model = _fresh(tiny_llama_dir)
    ids = torch.randint(0, 49152, (1, 7))
    plain = model.forward_batch(ids)
    a = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, seed=1), name="a")
    b = load_lora(model, make_adapter(tmp_path / "b", tiny_llama_dir, seed=2), name="b")
    a.merge()
    b.merge()
    for wrong in (a.unmerge, a.unload):
        with pytest.raises(LoraError, match="'b' was merged after it"):
            wrong()
    assert a.merged and b.merged
    b.unmerge()
    a.unmerge()
    assert torch.equal(model.forward_batch(ids), plain)      # exact base weights again


def test_rank_and_alpha_patterns_match_as_peft_does(tiny_llama_dir, tmp_path):
    """PEFT matches a pattern key as a regex after a "." boundary: "q_proj|v_proj" or a layer-qualified name
    (regression: those were missed, and the default alpha or rank silently used)."""
    model = _fresh(tiny_llama_dir)
    folder = make_adapter(tmp_path / "p", tiny_llama_dir, r=4, alpha=8.0)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["alpha_pattern"] = {"q_proj|v_proj": 32.0, r"layers\.1\.mlp\.down_proj": 2.0}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    ad = load_lora(model, folder, name="p")
    scales = {m: ad.layers[m].scale for m in ad.layers}
    for m, s in scales.items():
        want = 32.0 / 4 if m.endswith(("q_proj", "v_proj")) else 2.0 / 4 if m == "model.layers.1.mlp.down_proj" \
            else 8.0 / 4
        assert s == pytest.approx(want), m
    ad.unload()
    cfg["alpha_pattern"] = {"q_proj(": 1.0}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match="not a valid regular expression"):
        load_lora(model, folder, name="bad")


def test_unloading_the_last_adapter_leaves_the_base_model(tiny_llama_dir, tmp_path):
    """unload() emptied the adapter out of each layer's hook but left the hooks (and the manager): a model with no
    adapter still ran the per-op path instead of the fused CPU stack, and shard_model refused it as having adapters."""
    model = _fresh(tiny_llama_dir)
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(3))
    base = model.forward_batch(ids)
    a = load_lora(model, make_adapter(tmp_path / "a", tiny_llama_dir, seed=1), name="a")
    b = load_lora(model, make_adapter(tmp_path / "b", tiny_llama_dir, seed=2, targets=("q_proj",)), name="b")
    a.unload()
    hooked = {n for n, layer in model.linear_layers() if layer.lora is not None}
    assert hooked == {f"model.layers.{i}.self_attn.q_proj" for i in range(model.config.num_hidden_layers)}
    b.activate()
    assert not torch.equal(model.forward_batch(ids), base)
    set_active(model, None)
    b.unload()
    assert lora_manager(model) is None
    assert all(layer.lora is None for _, layer in model.linear_layers())
    assert torch.equal(model.forward_batch(ids), base)
    b.unload()                                                # twice: a no-op
    assert lora_manager(model) is None
