"""formats/gather_order.py and loader.order_perms_for_gather: rows reordered inside their groups for the permuted
norm's gather -- the cost model against a direct simulation of the kernel's warp reads, the reorder keeping every
row in its group and twins in step, the weight unchanged (float64 dequantisation) and a model's logits unchanged."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from exl_core.formats.gather_order import (MAPPINGS, bank_order, gather_classes, mean_wavefronts, reorder_rows,
                                           segments_and_twins)
from exl_core.formats.packed import dequantize_reference
from exl_core.formats.uniform4 import as_uniform4
from test_uniform4 import mixed


def kernel_wavefronts(perm: np.ndarray, elem_bytes: int) -> float:
    """rms_norm_vec_kernel PERM's gather read by read: thread t of warp w at step (i, e) reads entry perm[V v + e],
    v = 32 w + t + 256 i; a step costs the most distinct 4-byte words one of the 32 banks holds."""
    V, P = 16 // elem_bytes, len(perm)
    costs = []
    for w in range(8):
        for i in range(-(-P // (V * 256))):
            for e in range(V):
                banks: dict[int, set] = {}
                for t in range(32):
                    v = 32 * w + t + 256 * i
                    if V * v + e < P:
                        word = int(perm[V * v + e]) * elem_bytes // 4
                        banks.setdefault(word % 32, set()).add(word)
                if banks:
                    costs.append(max(len(s) for s in banks.values()))
    return float(np.mean(costs))


@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_cost_model_is_the_kernels_reads(elem_bytes):
    rng = np.random.default_rng(elem_bytes)
    for perm in (rng.permutation(1024), np.concatenate([rng.permutation(1024), rng.integers(0, 1024, 96)])):
        assert mean_wavefronts(perm, elem_bytes) == pytest.approx(kernel_wavefronts(perm, elem_bytes))
    assert mean_wavefronts(np.arange(1024), 2) == pytest.approx(4.0)      # ascending order: 4-way conflicts


@pytest.mark.parametrize("V", [4, 8])
def test_spread_classes_are_the_prepared_kernels_steps(V):
    """The `spread` mapping as the prepared kernel (ca12b2d) computes it: thread (warp w, lane l) at step i writes
    vector l C + w + 8 i (C = ceil(vectors / 32); none where w + 8 i >= C or the vector is past the row). For every
    row length the kernel takes, each vector is written once and a warp's step (with an entry e) is one class."""
    for pvec in range(1, 256 * 4 + 1):
        cols = -(-pvec // 32)
        w, i, lane = np.meshgrid(np.arange(8), np.arange(4), np.arange(32), indexing="ij")
        c = w + 8 * i
        vi = np.where(c < cols, np.minimum(lane * cols + c, pvec), pvec)
        written = vi[vi < pvec]
        assert sorted(written.tolist()) == list(range(pvec))
        cls = gather_classes(pvec * V, 16 // V, "spread")
        for ww in range(8):
            for ii in range(4):
                vs = vi[ww, ii][vi[ww, ii] < pvec]
                for e in range(V):
                    assert len(set(cls[V * vs + e].tolist())) <= 1
        assert len(np.unique(cls)) == len({(int(a), e) for a in np.unique(c[vi < pvec]) for e in range(V)})


def test_bank_order_keeps_rows_in_their_groups_and_cuts_conflicts():
    rng = np.random.default_rng(0)
    perm = np.concatenate([rng.permutation(4096), rng.integers(0, 4096, 256)])
    segs = [(g, 128) for g in range(0, len(perm), 128)]
    for mapping, bound in (("block", 2.2), ("spread", 1.6)):
        sigma = bank_order(perm, segs, mapping=mapping).numpy()
        for g0, n in segs:
            assert sorted(sigma[g0:g0 + n]) == list(range(g0, g0 + n))
        assert mean_wavefronts(perm, 2, mapping) > 3.3
        assert mean_wavefronts(perm[sigma], 2, mapping) < bound
    assert kernel_wavefronts(perm[bank_order(perm, segs).numpy()], 2) < 2.2


def test_twins_take_their_main_groups_order():
    pw = as_uniform4(mixed(256, 8, (6, 4, 3, 8), seed=3), max_growth=10.0)
    segs, twins = segments_and_twins(pw)
    assert len(twins) == 2                                     # the 6- and 8-bit groups
    sigma = bank_order(pw.perm, segs, twins)
    new = reorder_rows(pw, sigma)
    assert not torch.equal(new.perm, pw.perm)
    for main, twin in twins.items():
        assert torch.equal(new.perm[main:main + 64], new.perm[twin:twin + 64])
        assert not torch.equal(new.perm[main:main + 64], pw.perm[main:main + 64])     # reordered, in step
    bad = dict(twins)
    main = next(iter(bad))
    bad[main] = segs[0][0] if segs[0][0] != main else segs[1][0]   # not its twin
    with pytest.raises(ValueError, match="not a twin"):
        bank_order(pw.perm, segs, bad)


def test_reorder_rows_refuses_a_row_leaving_its_group():
    pw = mixed(128, 8, (4,), seed=2)
    sigma = torch.arange(128)
    sigma[[0, 100]] = sigma[[100, 0]]
    with pytest.raises(ValueError, match="within itself"):
        reorder_rows(pw, sigma)


@pytest.mark.parametrize("widths", [(4,), (5, 4, 3), (8, 6, 4, 2)])
def test_reordered_rows_are_the_same_weight(widths):
    pw = mixed(256, 16, widths, seed=11)
    u = as_uniform4(pw, max_growth=10.0) if widths != (4,) else pw
    segs, twins = segments_and_twins(u)
    new = reorder_rows(u, bank_order(u.perm, segs, twins))
    assert not torch.equal(new.qweight, u.qweight)
    assert torch.equal(dequantize_reference(new), dequantize_reference(pw))


def test_other_layouts_are_left_alone():
    assert segments_and_twins(mixed(128, 8, (3,), seed=1)) is None           # not 4-bit
    assert segments_and_twins(mixed(128, 8, (4,), seed=1, perm=False)) is None   # no act-order


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_model_reordered_keeps_the_logits(exl2_act_order_dir, monkeypatch, mapping):
    """A tiny EXL2 act-order model, q/k/v and gate/up sharing one permutation and rewritten as uniform 4-bit rows:
    order_perms_for_gather reorders every group, the layers still share one permutation, and the logits stay those
    of the model before, through the gathering path and through the norm writing the shared order (CPU, fp32)."""
    from test_norm_perm import share_group_perms

    from exl_core.loader import as_uniform4_weights, input_groups, load_model, order_perms_for_gather
    from exl_core.model import llama
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    assert order_perms_for_gather(model) == 0                 # every layer its own permutation: nothing shared
    share_group_perms(model)
    assert as_uniform4_weights(model, max_growth=10.0) > 0
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        ref = model.forward_batch(ids)
    before = [g[0].packed.perm for g in input_groups(model)]
    assert order_perms_for_gather(model, mapping) == 2 * len(model.layers)
    for group, old in zip(input_groups(model), before):
        assert group[0].packed.perm is not old and all(m.packed.perm is group[0].packed.perm for m in group)
        assert mean_wavefronts(group[0].packed.perm, 4, mapping) <= mean_wavefronts(old, 4, mapping)
    with torch.inference_mode():
        got = model.forward_batch(ids)
        monkeypatch.setattr(llama, "NORM_PERM_DEVICES", ("cuda", "cpu"))
        normed = model.forward_batch(ids)
    assert float(ref.abs().max()) > 1e-2
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(normed, ref, rtol=0, atol=1e-4)


def test_unknown_mapping_is_refused(monkeypatch):
    from exl_core.errors import ConfigError
    from exl_core.loader import order_perms_for_gather
    with pytest.raises(ConfigError, match="EXL_CORE_GATHER_MAPPING"):
        order_perms_for_gather(None, "zigzag")
    monkeypatch.setenv("EXL_CORE_GATHER_MAPPING", "zigzag")         # read per call, not at import
    with pytest.raises(ConfigError, match="'zigzag'"):
        order_perms_for_gather(None)


def test_lora_merge_requantizes_a_reordered_weight_to_its_order():
    """lora_requant.requantize_like on a reordered rewrite: quantized in the file's groups (the same rows a group,
    in the new order), rewritten again: the same values as re-quantizing the original, and the same permutation as
    the reordered weight (so layers merged and not merged still share one)."""
    import dataclasses

    from exl_core.model.lora_requant import requantize_like
    pw = mixed(256, 8, (6, 5, 4, 3), seed=7)             # EXL2 stores widths non-increasing
    pw = dataclasses.replace(pw, meta=dict(pw.meta, format="exl2"))
    u = as_uniform4(pw, max_growth=10.0)
    segs, twins = segments_and_twins(u)
    new = reorder_rows(u, bank_order(u.perm, segs, twins))
    w = dequantize_reference(pw).float() + 0.01 * torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    again = requantize_like(new, w, "q_proj")
    assert torch.equal(again.perm, new.perm)
    assert torch.equal(dequantize_reference(again), dequantize_reference(requantize_like(pw, w, "q_proj")))


def test_gptq_groups_are_left_alone(exl2_act_order_dir):
    """A GPTQ layer's LoRA merge would re-quantize it into its stored row order (gptq.read_layer sorts g_idx), so a
    group with a GPTQ weight is not reordered: the tiny model's groups, shared and rewritten as uniform 4-bit rows
    (which order_perms_for_gather reorders, above), each with its first weight marked as GPTQ's."""
    import dataclasses

    from test_norm_perm import share_group_perms

    from exl_core.loader import as_uniform4_weights, input_groups, load_model, order_perms_for_gather
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    share_group_perms(model)
    assert as_uniform4_weights(model, max_growth=10.0) > 0
    for group in input_groups(model):
        pw = group[0].packed
        group[0].set_packed(dataclasses.replace(pw, meta=dict(pw.meta, format="gptq")))
    assert all(segments_and_twins(m.packed) is not None for g in input_groups(model) for m in g)
    assert order_perms_for_gather(model) == 0
