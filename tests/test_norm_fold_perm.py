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
    from exl_core.model import llama
    from exl_core.ops import norm_fold
    from exl_core.ops.activation import silu_mul
    from exl_core.ops.qmatmul import qmatmul, qmatmul_many
    calls = {"into": 0, "normed": 0}

    def into_run(residual, x, pw, up, xp, order):
        residual += qmatmul(x if up is None else silu_mul(x, up), pw)
        xp.zero_()
        xp[:, order.pos.long()] = residual
        if order.pos2 is not None:
            twice = order.pos2 >= 0
            xp[:, order.pos2[twice].long()] = residual[:, twice]
        calls["into"] += 1
        rows, n = residual.shape
        return residual.pow(2).reshape(rows, n // 32, 32).sum(-1).t().contiguous()      # [tiles, rows]

    def normed_run(residual, weight, eps, ss, xp, perm, weight_perm, pws):
        assert torch.equal(weight_perm, weight[perm.long()])
        r = torch.rsqrt(ss.sum(0) / residual.shape[-1] + eps)                           # the residual's width
        calls["normed"] += 1
        return qmatmul_many(xp * r[:, None] * weight_perm, list(pws))

    for disp, run in ((norm_fold.DISPATCH_ADD_SS_INTO, into_run), (norm_fold.DISPATCH_MANY_NORMED_PERM, normed_run)):
        monkeypatch.setattr(disp, "candidates", [Candidate("stand-in", lambda **_: None, run)] + disp.candidates)
    monkeypatch.setattr(norm_fold, "FOLD_PERM_ON", True)
    monkeypatch.setattr(llama, "FOLD_DEVICES", ("cpu", "cuda"))
    return calls


@pytest.mark.parametrize("uniform4", [False, True])
def test_fold_through_the_shared_order_keeps_the_logits(exl2_act_order_dir, monkeypatch, uniform4):
    from exl_core.loader import as_uniform4_weights, load_model
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    assert share_group_perms(model) == 2 * len(model.layers)
    if uniform4:                           # extended orders: some columns stored twice (OutOrder.pos2)
        assert as_uniform4_weights(model, max_growth=10.0) > 0
        assert model.layers[0].mlp.gate_proj.packed.rows is not None
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        ref = model.forward_batch(ids)
        calls = _stand_ins(monkeypatch)
        got = model.forward_batch(ids)
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
