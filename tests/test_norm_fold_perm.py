"""The model's side of the RMSNorm fold through a shared act-order (model/llama.py _produce_fold / _consume_fold,
ops/norm_fold.py's second part, EXL_CORE_NORM_FOLD_PERM=1), on the CPU: torch stand-ins take the place of the CUDA
kernels (tests/test_cuda_norm_fold.py checks those), doing what their contract says -- the producer adds into the
residual, returns its sums of squares per 32-column tile and stores the residual in the consumers' order through the
OutOrder maps; the consumer normalises that copy with r from the sums over the residual's own width and the norm
weight in the same order.  The logits must be the unfolded model's: this checks the maps, the permuted norm weight,
the width r divides by, and the plumbing between the blocks."""
from __future__ import annotations

import pytest
import torch

from exl_core.ops.dispatch import Candidate
from test_norm_perm import share_group_perms


def _stand_ins(monkeypatch) -> dict:
    """The CUDA candidates' run functions (ops/cuda_norm_fold.py _add_ss_into_run, _normed_perm_run) installed as they
    are, over torch stand-ins for the two launches below them (_add_ss_run, _normed_run: the kernels' contract), so
    what those run functions pass on -- the maps, xp, the norm weight in order, norm_k -- is what is tested.  Their
    checks cannot run here (they ask for CUDA tensors): they accept."""
    from exl_core.model import llama
    from exl_core.ops import cuda_norm_fold as nf
    from exl_core.ops import norm_fold
    from exl_core.ops.activation import silu_mul
    from exl_core.ops.qmatmul import qmatmul, qmatmul_many
    calls = {"into": 0, "normed": 0}

    def add_ss_run(residual, x, pw, up, xp=None, order=None):            # qgemm_kslice_add_ with xp
        residual += qmatmul(x if up is None else silu_mul(x, up), pw)
        xp.zero_()
        xp[:, order.pos.long()] = residual
        if order.pos2 is not None:
            twice = order.pos2 >= 0
            xp[:, order.pos2[twice].long()] = residual[:, twice]
        calls["into"] += 1
        rows, n = residual.shape
        return residual.pow(2).reshape(rows, n // 32, 32).sum(-1).t().contiguous()      # [tiles, rows]

    def normed_run(x, weight, eps, ss, pws, norm_k=0):                 # qgemm_kslice_multi's fold with norm_k
        assert norm_k > 0 and ss.shape[0] == norm_k // 32
        r = torch.rsqrt(ss.sum(0) / norm_k + eps)
        calls["normed"] += 1
        return qmatmul_many(x * r[:, None] * weight, list(pws))

    monkeypatch.setattr(nf, "_add_ss_run", add_ss_run)
    monkeypatch.setattr(nf, "_normed_run", normed_run)
    for disp, run in ((norm_fold.DISPATCH_ADD_SS_INTO, nf._add_ss_into_run),
                      (norm_fold.DISPATCH_MANY_NORMED_PERM, nf._normed_perm_run)):
        monkeypatch.setattr(disp, "candidates", [Candidate("stand-in", lambda **_: None, run)] + disp.candidates)
    monkeypatch.setattr(norm_fold, "FOLD_PERM_ON", True)
    monkeypatch.setattr(llama, "FOLD_DEVICES", ("cpu", "cuda"))
    return calls


def _model(exl2_act_order_dir, uniform4: bool):
    from exl_core.loader import as_uniform4_weights, load_model
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    assert share_group_perms(model) == 2 * len(model.layers)
    if uniform4:                           # extended orders: some columns stored twice (OutOrder.pos2)
        assert as_uniform4_weights(model, max_growth=10.0) > 0
        assert model.layers[0].mlp.gate_proj.packed.rows is not None
    return model


IDS = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(8))


@pytest.mark.parametrize("uniform4", [False, True])
def test_fold_through_the_shared_order_keeps_the_logits(exl2_act_order_dir, monkeypatch, uniform4):
    model = _model(exl2_act_order_dir, uniform4)
    with torch.inference_mode():
        ref = model.forward_batch(IDS)
        calls = _stand_ins(monkeypatch)
        got = model.forward_batch(IDS)
    L = len(model.layers)
    assert calls == {"into": 2 * L - 1, "normed": 2 * L - 1}   # o every layer, down all but the last; q/k/v: not layer 0
    assert float(ref.abs().max()) > 1e-2
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_fold_off_by_default(exl2_act_order_dir, monkeypatch):
    """Without EXL_CORE_NORM_FOLD_PERM=1 the model never asks the permuted fold (on a GPU the plain path runs)."""
    from exl_core.loader import load_model
    from exl_core.model import llama
    from exl_core.ops import norm_fold
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    share_group_perms(model)
    calls = _stand_ins(monkeypatch)
    monkeypatch.setattr(norm_fold, "FOLD_PERM_ON", False)
    blk = model.layers[0]
    x = torch.randn(3, model.config.hidden_size)
    assert llama._perm_fold(blk.post_attention_layernorm, (blk.mlp.gate_proj, blk.mlp.up_proj), x) is None
    with torch.inference_mode():
        model.forward_batch(torch.randint(0, 1000, (1, 5)))
    assert calls == {"into": 0, "normed": 0}


def test_a_next_block_that_takes_no_fold_gets_none(exl2_act_order_dir, monkeypatch):
    """A Block subclass (its own forward) after a plain one: the down projection before it leaves no fold in another
    block's order -- the logits stay the unfolded model's, and that boundary is not folded."""
    from exl_core.model.llama import Block
    model = _model(exl2_act_order_dir, True)
    with torch.inference_mode():
        ref = model.forward_batch(IDS)

    class Own(Block):
        def forward(self, h, residual, ctx, cos_sin, ss=None):
            return Block.forward(self, h, residual, ctx, cos_sin, None)      # takes no fold
    model.layers[1].__class__ = Own
    with torch.inference_mode():
        calls = _stand_ins(monkeypatch)
        got = model.forward_batch(IDS)
    L = len(model.layers)
    assert calls == {"into": 2 * L - 2, "normed": 2 * L - 2}              # layer 0's down has nothing to serve
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_norm_weight_edited_in_place_reaches_the_fold(exl2_act_order_dir, monkeypatch):
    """The norm weight in the layers' order is cached: an in-place edit of the weight (load_state_dict, copy_) makes
    a new one."""
    model = _model(exl2_act_order_dir, True)
    norms = [b.post_attention_layernorm.weight for b in model.layers]
    with torch.inference_mode():
        calls = _stand_ins(monkeypatch)
        model.forward_batch(IDS)                                           # the cache is made
    with torch.no_grad():
        for w in norms:
            w.mul_(1.7)
    with torch.inference_mode():
        got = model.forward_batch(IDS)
        monkeypatch.setattr(__import__("exl_core.ops.norm_fold", fromlist=["x"]), "FOLD_PERM_ON", False)
        ref = model.forward_batch(IDS)
    assert calls["normed"] > 0
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_a_fold_made_for_other_layers_runs_the_norm_unfused(exl2_act_order_dir, monkeypatch):
    """_consume_fold with a fold _produce_fold made for another norm and other layers: the residual (already added
    to) goes through the plain norm and those layers -- never through xp in another order."""
    from exl_core.model import llama
    from exl_core.model.linear import linear_many
    from exl_core.ops.norm import rms_norm
    model = _model(exl2_act_order_dir, True)
    b0, b1 = model.layers[0], model.layers[1]
    calls = _stand_ins(monkeypatch)
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    residual = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        qkv1 = (b1.self_attn.q_proj, b1.self_attn.k_proj, b1.self_attn.v_proj)
        fold = llama._produce_fold(residual, x, b0.self_attn.o_proj, None, b1.input_layernorm, qkv1)
        assert fold is not None and fold[1] is not None and calls["into"] == 1
        qkv0 = (b0.self_attn.q_proj, b0.self_attn.k_proj, b0.self_attn.v_proj)
        got = llama._consume_fold(residual, fold, b0.input_layernorm, qkv0)
        want = linear_many(rms_norm(residual, b0.input_layernorm.weight, b0.input_layernorm.eps), qkv0)
        right = llama._consume_fold(residual, fold, b1.input_layernorm, qkv1)      # the layers it was made for
        ref = linear_many(rms_norm(residual, b1.input_layernorm.weight, b1.input_layernorm.eps), qkv1)
    assert calls["normed"] == 1
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for g, w in zip(right, ref):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)
