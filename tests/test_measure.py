"""EXL2 measurement: each candidate's error in residual-stream units, checked against a direct
forward of the whole decoder layer (calib_forward.layer_forward) with that one linear quantized."""
import re

import pytest
import torch

from exl_core.quantize.calib_forward import (LINEARS, Dims, attention, layer_forward, linear, mlp_act, rms_norm,
                                             rope_inv_freq, rope_tables)
from exl_core.quantize.gptq_solver import gptq_quantize_multi
from exl_core.quantize.measure import CANDIDATES, REF_CANDIDATE, _hessian, measure_layer


def _layer(seed, hidden=64, inter=128, heads=4, kv=2):
    g = torch.Generator().manual_seed(seed)
    hd = hidden // heads
    shapes = {"self_attn.q_proj": (heads * hd, hidden), "self_attn.k_proj": (kv * hd, hidden),
              "self_attn.v_proj": (kv * hd, hidden), "self_attn.o_proj": (hidden, heads * hd),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    w = {f"{n}.weight": torch.randn(*s, generator=g) * 0.1 for n, s in shapes.items()}
    w["input_layernorm.weight"] = torch.rand(hidden, generator=g) + 0.5
    w["post_attention_layernorm.weight"] = torch.rand(hidden, generator=g) + 0.5
    d = Dims(hidden, heads, kv, hd, 1e-5, None)
    h = torch.randn(4, 48, hidden, generator=g)
    return w, d, h


def _inputs(w, d, h, cos, sin):
    """Dense inputs of each linear (independent of measure_layer's own bookkeeping)."""
    x = rms_norm(h, w["input_layernorm.weight"], d.eps)
    att = attention(x, w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"],
                    None, None, None, d, cos, sin)
    h1 = h + linear(att, w["self_attn.o_proj.weight"])
    x2 = rms_norm(h1, w["post_attention_layernorm.weight"], d.eps)
    m = mlp_act(x2, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"])
    return {"self_attn.q_proj": x, "self_attn.k_proj": x, "self_attn.v_proj": x, "self_attn.o_proj": att,
            "mlp.gate_proj": x2, "mlp.up_proj": x2, "mlp.down_proj": m}, h1


@pytest.mark.parametrize("seed", [0, 1])
def test_residual_errors_match_direct_forward(seed):
    torch.manual_seed(seed)
    w, d, h = _layer(seed)
    cos, sin = rope_tables(rope_inv_freq(d.head_dim, 10000.0, None), torch.arange(h.shape[1]))
    cands = CANDIDATES
    rec, h_next = measure_layer(h, w, d, cos, sin, cands, 0.01, "L.")
    dense = layer_forward(h, w, d, cos, sin)
    assert torch.allclose(h_next, dense, atol=1e-5, rtol=1e-5)      # dense propagation
    inputs, h1 = _inputs(w, d, h, cos, sin)
    # residual after the sub-layer holding the linear: h1 (attention) or the layer output (MLP)
    resid = {n: (h1 if n.startswith("self_attn") else dense) for n in LINEARS}
    probe = [cands.index(REF_CANDIDATE), 0, len(cands) - 3]           # 3-bit, 2-bit, ~7-bit
    for n in LINEARS:
        r = rec[f"L.{n}"]
        assert len(r["err"]) == len(cands) and r["shape"] == list(w[f"{n}.weight"].shape)
        res = gptq_quantize_multi(w[f"{n}.weight"], _hessian(inputs[n]), [cands[i].plan(r["shape"][1]) for i in probe],
                                  damp=0.01)
        for i, q in zip(probe, res):
            wq = dict(w)
            wq[f"{n}.weight"] = q.w_hat
            if n.startswith("mlp"):
                delta = layer_forward(h, wq, d, cos, sin) - dense
            else:                    # attention linears are measured at the attention sub-layer's output
                delta = _inputs(wq, d, h, cos, sin)[1] - h1
            direct = (delta.double().pow(2).sum(-1) / resid[n].double().pow(2).sum(-1)).mean().item()
            if i == probe[0]:
                assert r["err"][i] == pytest.approx(direct, rel=1e-3), n     # the gain's own point
            else:
                # other candidates: first-order scaling of the output error, right within 2x
                assert direct / 2 < r["err"][i] < direct * 2, (n, cands[i].name, r["err"][i], direct)
        # more bits, less error (the allocator relies on a meaningful order)
        assert r["err"][0] > r["err"][cands.index(REF_CANDIDATE)] > r["err"][-1]


def test_a_measurement_file_nested_too_deeply_is_refused_by_name(tmp_path):
    from exl_core.errors import InputError
    from exl_core.quantize.measure import load_measurement
    path = tmp_path / "measurement.json"
    path.write_text('{"layers": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(InputError, match=f"{path}: not valid JSON .*nested too deeply"):
        load_measurement(path, {})          # was a bare RecursionError


def test_pruned_inputs_give_finite_errors_and_a_non_finite_error_is_refused(monkeypatch):
    """32 pruned MLP neurons (up_proj rows and down_proj columns 0): NaN quantized weights made every error NaN,
    and `gain = ... if sq[ref] > 0 else 0.0` turned them into zero error -- the allocator starved the layer."""
    from exl_core.errors import ExlError
    from exl_core.quantize import measure
    w, d, h = _layer(3)
    w["mlp.up_proj.weight"][:32] = 0
    w["mlp.down_proj.weight"][:, :32] = 0
    cos, sin = rope_tables(rope_inv_freq(d.head_dim, 10000.0, None), torch.arange(h.shape[1]))
    rec, _ = measure_layer(h, w, d, cos, sin, CANDIDATES, 0.01, "L.")
    for n in ("mlp.up_proj", "mlp.down_proj"):
        err = rec[f"L.{n}"]["err"]
        assert all(e > 0 and e < float("inf") for e in err), (n, err)
        assert err[0] > err[-1]

    def nan_quantizer(*a, **kw):
        res = gptq_quantize_multi(*a, **kw)
        res[1].w_hat[0, 0] = float("nan")
        return res
    monkeypatch.setattr(measure, "gptq_quantize_multi", nan_quantizer)
    with pytest.raises(ExlError, match=r"L\.self_attn\.q_proj: the measured quantization error is not finite "
                                       rf"\(candidates {re.escape(CANDIDATES[1].name)}\)"):
        measure_layer(h, w, d, cos, sin, CANDIDATES, 0.01, "L.")


def _measurement(tmp_path, layers):
    import json

    from exl_core.quantize.measure import MEASUREMENT_VERSION, candidates_to_json
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"version": MEASUREMENT_VERSION, "candidates": candidates_to_json(CANDIDATES),
                                "info": {}, "layers": layers}))
    return path


def test_a_malformed_measurement_record_is_refused_naming_the_file_and_layer(tmp_path):
    """-m with a record missing "shape" was a KeyError, "err": null a TypeError (raw tracebacks from exl convert)."""
    from exl_core.errors import InputError
    from exl_core.quantize.measure import load_measurement
    n = len(CANDIDATES)
    good = {"shape": [64, 128], "numel": 64 * 128, "bits": [1000 + i for i in range(n)],
            "err": [1.0 / (i + 1) for i in range(n)], "out_err": [0.0] * n, "gain": 1.0}
    expect = {"L.q_proj": (64, 128)}
    assert load_measurement(_measurement(tmp_path, {"L.q_proj": good}), expect)[0]["L.q_proj"] == good
    bad = [({k: v for k, v in good.items() if k != "shape"}, "no 'shape'"),
           ({k: v for k, v in good.items() if k != "err"}, "no 'err'"),
           (dict(good, err=None), '"err" must be a list of 20 numbers .*got null'),
           (dict(good, err=good["err"][:-1]), '"err" must be a list of 20 numbers .*got 19'),
           (dict(good, err=[None] * n), '"err" holds a value that is not a finite number'),
           (dict(good, err=[float("nan")] * n), '"err" holds a value that is not a finite number'),
           (dict(good, err=[-1.0] * n), '"err" holds a value that is not a finite number ≥ 0'),
           (dict(good, bits="many"), '"bits" must be a list'),
           (dict(good, shape=[64]), r'"shape" must be \[out_features, in_features\]'),
           (dict(good, shape=["64", 128]), r'"shape" must be \[out_features, in_features\]'),
           (dict(good, numel=None), '"numel" None is not 64×128'),
           (dict(good, fixed="yes"), '"fixed" must be true or false'),
           ([1, 2], "the record must be an object, not list")]
    for rec, match in bad:
        path = _measurement(tmp_path, {"L.q_proj": rec})
        with pytest.raises(InputError, match=f"{re.escape(str(path))}: layer L.q_proj: {match}"):
            load_measurement(path, expect)
    with pytest.raises(InputError, match=f"{re.escape(str(path))}: \"layers\" must be an object"):
        load_measurement(_measurement(tmp_path, [good]), expect)
    path.write_text(path.read_text().replace('"group_size"', '"gs"'))
    with pytest.raises(InputError, match=f"{re.escape(str(path))}: \"candidates\" is not a list"):
        load_measurement(path, expect)
