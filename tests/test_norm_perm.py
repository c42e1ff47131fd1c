"""ops/norm_perm.py (the RMSNorm written in an act-order) and its use in the model (model/llama.py _norm_many): the
op against the torch reference norm with its columns gathered, and a model whose q/k/v and gate/up share their
permutations giving the same logits with the norm writing their order as with every projection gathering x."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exl_core.errors import InputError
from exl_core.ops.norm import rms_norm_ref
from exl_core.ops.norm_perm import rms_norm_permuted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("perm_dtype", [torch.int32, torch.int64])
def test_op_is_the_norm_with_its_columns_permuted(dtype, with_residual, perm_dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    res = torch.randn(5, 96, generator=g).to(dtype) if with_residual else None
    perm = torch.randperm(96, generator=g).to(perm_dtype)
    got = rms_norm_permuted(x, w, 1e-5, perm, res)
    ref = rms_norm_ref(x, w, 1e-5, res)
    if with_residual:
        torch.testing.assert_close(got[0], ref[0][:, perm.long()], rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)        # h stays in natural order
    else:
        torch.testing.assert_close(got, ref[:, perm.long()], rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_op_refuses_bad_arguments():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(InputError, match="perm"):
        rms_norm_permuted(x, w, 1e-5, torch.arange(7))
    with pytest.raises(InputError, match="perm"):
        rms_norm_permuted(x, w, 1e-5, torch.arange(8).float())
    with pytest.raises(InputError, match="residual"):
        rms_norm_permuted(x, w, 1e-5, torch.arange(8), torch.randn(3, 8))
    with pytest.raises(InputError, match="weight"):
        rms_norm_permuted(x, torch.ones(7), 1e-5, torch.arange(8))
    with pytest.raises(InputError, match="site"):
        rms_norm_permuted(x, w, 1e-5, torch.arange(8), site="qkv")


def share_group_perms(model) -> int:
    """Gives every layer of an input group (q/k/v, gate/up) the group's first act-order permutation, as ExLlamaV2's
    converter writes them (RTN orders each weight by its own energy).  k, v and up then compute other functions,
    the same for every path compared.  Returns how many groups share one."""
    from exl_core.loader import input_groups
    from exl_core.model.llama import invalidate_native_stacks
    n = 0
    for group in input_groups(model):
        first = group[0].packed.perm
        if first is None:
            continue
        for layer in group[1:]:
            pw = layer.packed
            layer.set_packed(dataclasses.replace(pw, perm=first, meta=pw.portable_meta()))
        n += 1
    invalidate_native_stacks()
    return n


def rewritten_shared_exl2(tiny_model_factory, tmp_path, **load):
    """A tiny EXL2 act-order model (hidden 128, intermediate 352: 6 / 4 / 3-bit groups of 32 rows) loaded with `load`
    (device, dtype), its q/k/v and gate/up sharing one permutation (share_group_perms), rewritten as uniform 4-bit
    rows (extra rows for the 6-bit groups; after loader.fold_down_perms, down's read whole chunks again)."""
    from exl_core.loader import as_uniform4_weights, load_model
    from exl_core.quantize.rtn import quantize_model_rtn
    src = tiny_model_factory("llama", seed=7, hidden_size=128, intermediate_size=352, num_attention_heads=4,
                             num_key_value_heads=2)
    q = quantize_model_rtn(src, tmp_path / "q", fmt="exl2", bits=[(6, 0.25), (4, 0.5), (3, 0.25)], group_size=32,
                           act_order=True)
    model = load_model(q, load_tokenizer=False, **load)[0]
    share_group_perms(model)
    assert as_uniform4_weights(model, max_growth=10.0) > 0
    return model


def record_norm_widths(monkeypatch) -> list:
    """Wraps the model's rms_norm_permuted: the returned list gets the width of every output it writes."""
    from exl_core.model import llama
    widths, real = [], llama.rms_norm_permuted

    def recorded(x, weight, eps, perm, residual=None, site="mlp"):
        out = real(x, weight, eps, perm, residual, site)
        widths.append((out if residual is None else out[0]).shape[-1])
        return out
    monkeypatch.setattr(llama, "rms_norm_permuted", recorded)
    return widths


def test_model_norm_writing_the_shared_order_keeps_the_logits(exl2_act_order_dir, monkeypatch):
    """On the CPU per-op path (the model's default keeps the gathers there: NORM_PERM_DEVICES), both ways: fp32, the
    same products and sums, so the logits agree to rounding of the gathered and permuted copies (none)."""
    from exl_core.loader import load_model
    from exl_core.model import llama
    from exl_core.model.linear import shared_perm
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    assert share_group_perms(model) == 2 * len(model.layers)
    blk = model.layers[0]
    assert shared_perm((blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj)) is not None
    assert shared_perm((blk.mlp.gate_proj, blk.mlp.up_proj)) is not None
    qkv = (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj)
    p32 = shared_perm(qkv)                               # the int32 copy the norm kernel reads: the same entries
    assert p32.dtype == torch.int32 and torch.equal(p32.long(), qkv[0].packed.perm.long())
    assert shared_perm(qkv) is p32                       # made once
    assert shared_perm((blk.self_attn.q_proj, blk.self_attn.o_proj)) is None     # another permutation
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(4))
    calls = []
    real = llama.rms_norm_permuted
    dtypes = []

    def counted(x, weight, eps, perm, residual=None, site="mlp"):
        dtypes.append(perm.dtype)
        calls.append(site)
        return real(x, weight, eps, perm, residual, site)
    with torch.inference_mode():
        ref = model.forward_batch(ids)
        ref_step = model.forward_batch(ids[:, :1])
        assert not calls                                   # the CPU default keeps the gathers
        monkeypatch.setattr(llama, "NORM_PERM_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(llama, "rms_norm_permuted", counted)
        got = model.forward_batch(ids)
        batch_dtypes, dtypes[:] = set(dtypes), []
        got_step = model.forward_batch(ids[:, :1])
    assert calls == ["attn", "mlp"] * len(model.layers) * 2  # every q/k/v and gate/up input written permuted, the
    # launch policy told which of them follows (ops/cuda_norm_perm.py)
    assert batch_dtypes == {torch.int32} and set(dtypes) == {torch.int32}
    assert float(ref.abs().max()) > 1e-2                  # logits that can show a wrong order
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_step, ref_step, rtol=0, atol=1e-5)


def test_op_refuses_a_permutation_of_another_dtype():
    """The op takes int32 / int64 entries; an int16 (or float) perm is bad input, named in the error."""
    from exl_core.model.linear import shared_perm
    x, w = torch.randn(2, 64), torch.ones(64)
    for bad in (torch.arange(64, dtype=torch.int16), torch.arange(64, dtype=torch.float32)):
        with pytest.raises(InputError, match=str(bad.dtype)):
            rms_norm_permuted(x, w, 1e-5, bad)
    assert shared_perm([torch.nn.Linear(2, 2)]) is None   # not a packed layer


def test_op_with_a_longer_permutation_repeats_columns():
    """perm longer than H (weights with extra rows, formats/uniform4.py): y's last dim is perm's length."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 32, generator=g), torch.rand(32, generator=g) + 0.5
    perm = torch.cat([torch.randperm(32, generator=g), torch.tensor([5, 0, 31, 5])])
    torch.testing.assert_close(rms_norm_permuted(x, w, 1e-5, perm), rms_norm_ref(x, w, 1e-5)[:, perm], rtol=0, atol=1e-6)


def test_uniform4_rows_norm_writing_the_extended_order_keeps_the_logits(exl2_act_order_dir, monkeypatch):
    """EXL2 rewritten as uniform 4-bit rows (loader.as_uniform4_weights: 5..8-bit values take an extra row that reads
    its x column again): q/k/v (and gate/up) with the same row layout share the extended permutation, and the norm
    writing all of its columns gives the logits of the gathering path (CPU per-op path, fp32)."""
    from exl_core.loader import as_uniform4_weights, load_model
    from exl_core.model import llama
    from exl_core.model.linear import shared_perm
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    share_group_perms(model)
    assert as_uniform4_weights(model, max_growth=10.0) > 0
    blk = model.layers[0]
    qkv = (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj)
    assert all(m.packed.rows is not None for m in qkv)           # extra rows: the test's point
    p = shared_perm(qkv)
    assert p is not None and p.numel() == blk.self_attn.q_proj.packed.rows > blk.self_attn.q_proj.in_features
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(6))
    widths = record_norm_widths(monkeypatch)
    with torch.inference_mode():
        ref = model.forward_batch(ids)
        monkeypatch.setattr(llama, "NORM_PERM_DEVICES", ("cuda", "cpu"))
        got = model.forward_batch(ids)
    assert len(widths) == 2 * len(model.layers) and max(widths) > model.config.hidden_size   # extended x written
    assert float(ref.abs().max()) > 1e-2
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_prepermuted_caches_go_with_a_move(exl2_act_order_dir, monkeypatch):
    """The twin weights and int32 permutations linear.py caches on a layer are dropped when the layer's tensors move
    (QuantLinear._apply), so they never keep old copies alive."""
    from exl_core.loader import load_model
    from exl_core.model import llama
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    share_group_perms(model)
    monkeypatch.setattr(llama, "NORM_PERM_DEVICES", ("cpu",))
    with torch.inference_mode():
        model.forward_batch(torch.tensor([[1, 2, 3]]))
    q = model.layers[0].self_attn.q_proj
    assert "_unpermuted" in q.__dict__ and "_perm32" in q.__dict__
    model.to(torch.float32)
    assert "_unpermuted" not in q.__dict__ and "_perm32" not in q.__dict__


def test_moving_the_model_keeps_shared_permutations_shared(exl2_act_order_dir):
    """Each layer's buffers move separately (nn.Module._apply), which made one copy of a shared permutation per layer
    and turned shared_perm (the permuted norm's condition) off after model.to(...); Model._apply shares them again."""
    from exl_core.loader import input_groups, load_model
    from exl_core.model.linear import shared_perm
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    assert share_group_perms(model) == 2 * len(model.layers)
    model.to("meta")
    groups = list(input_groups(model))
    assert all(g[0].packed.perm.is_meta for g in groups)
    assert all(shared_perm(g) is not None for g in groups)


def test_cuda_policy_asks_for_the_lean_instance_from_the_batch_decode_rows(monkeypatch):
    """ops/cuda_norm_perm.py: the lean instance (perm staged in shared memory) from the rows qgemm_wide takes after
    the norm, the regular one below (where the lean one read slower at batch 1, stop 36 call 3); before q/k/v the
    regular one at every row count by default (stop 64 call 4)."""
    import os
    import subprocess
    import sys
    from exl_core.ops import cuda_candidates as cc
    from exl_core.ops import cuda_norm_perm as cnp
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXL_CORE_NORM_PERM")}
    default = subprocess.run([sys.executable, "-c", "import exl_core.ops.cuda_norm_perm as c; print(c._ATTN)"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert default == "regular"                        # the module's own default, outside this process's settings
    monkeypatch.setattr(cnp, "_LEAN", None)            # the default, whatever the environment says
    for site in ("attn", "mlp"):
        monkeypatch.setattr(cnp, "_ATTN", "lean")
        assert cnp._lean(cc.WIDE_MIN_ROWS, site) and cnp._lean(cc.WIDE_MAX_ROWS, site)
        assert not cnp._lean(cc.WIDE_MIN_ROWS - 1, site)
        monkeypatch.setattr(cnp, "_ATTN", "regular")      # the regular instance before q/k/v only
        assert cnp._lean(cc.WIDE_MAX_ROWS, site) == (site == "mlp")
        monkeypatch.setattr(cnp, "_LEAN", "0")
        assert not cnp._lean(cc.WIDE_MAX_ROWS, site)
        monkeypatch.setattr(cnp, "_LEAN", None)
