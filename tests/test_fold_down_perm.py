"""loader.fold_down_perms: down_proj's act-order permutation moved into the output columns of gate_proj and
up_proj (what ExLlamaV2 does at load). The model computes the same function as in the checkpoint's order,
and LoRA adapters, written in the checkpoint's order, still apply to the right channels, on the fly and merged."""
from __future__ import annotations

import pytest
import torch

from exl_core.loader import load_model
from exl_core.model.lora import load_lora, set_active
from test_lora import make_adapter

# fp32 end to end: the fold changes no product or sum order, a wrong channel order changes logits by O(1)
ATOL = 1e-5


@pytest.fixture(scope="module", params=["gptq", "exl2"])
def act_order_dir(request, tiny_llama_dir, tmp_path_factory):
    from exl_core.quantize.rtn import quantize_model_rtn
    bits = 4 if request.param == "gptq" else [(6, 0.25), (3, 0.75)]
    return quantize_model_rtn(tiny_llama_dir, tmp_path_factory.mktemp(request.param) / "q", fmt=request.param,
                              bits=bits, group_size=32, act_order=True)


def _load(folder, monkeypatch, fold: bool):
    monkeypatch.setenv("EXL_CORE_FOLD_DOWN_PERM", "1" if fold else "0")
    return load_model(folder, dtype=torch.float32, load_tokenizer=False)[0]


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 1000, (2, 11), generator=torch.Generator().manual_seed(seed))


def test_fold_moves_the_permutation_and_keeps_the_logits(act_order_dir, monkeypatch):
    plain, folded = _load(act_order_dir, monkeypatch, False), _load(act_order_dir, monkeypatch, True)
    for bp, bf in zip(plain.layers, folded.layers):
        perm = bp.mlp.down_proj.packed.perm
        assert perm is not None and bf.mlp.down_proj.packed.perm is None
        assert not torch.equal(perm.cpu(), torch.arange(perm.numel()))   # a real reorder, or the test proves nothing
        assert torch.equal(bf.mlp.down_proj.input_order, perm.cpu())
        for name in ("gate_proj", "up_proj"):
            p, f = getattr(bp.mlp, name), getattr(bf.mlp, name)
            assert torch.equal(f.output_order, perm.cpu())
            assert torch.equal(f.packed.perm, p.packed.perm)         # their own input order is untouched
            # (out, in): the folded layer's output j is the checkpoint's output perm[j], in float64
            assert torch.equal(f.dense_weight(torch.float64), p.dense_weight(torch.float64)[perm])
        assert torch.equal(bf.mlp.down_proj.dense_weight(torch.float64),
                           bp.mlp.down_proj.dense_weight(torch.float64)[:, perm])
    ids = _ids(3)
    with torch.inference_mode():
        ref, got = plain.forward_batch(ids), folded.forward_batch(ids)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_fold_is_off_without_a_down_permutation(tiny_llama_dir, tmp_path, monkeypatch):
    from exl_core.quantize.rtn import quantize_model_rtn
    q = quantize_model_rtn(tiny_llama_dir, tmp_path / "q", fmt="gptq", bits=4, group_size=32, act_order=False)
    model = _load(q, monkeypatch, True)
    for b in model.layers:
        assert b.mlp.down_proj.packed.perm is None and b.mlp.down_proj.input_order is None
        assert b.mlp.gate_proj.output_order is None and b.mlp.up_proj.output_order is None


def test_lora_on_a_folded_model_matches_the_checkpoint_order(act_order_dir, tiny_llama_dir, tmp_path, monkeypatch):
    """The same adapter (every projection) on the fly and merged, on the folded model and on the checkpoint's order."""
    ad_dir = make_adapter(tmp_path / "a", tiny_llama_dir, r=4, alpha=8, seed=7)
    ids = _ids(5)
    out = {}
    for fold in (False, True):
        model = _load(act_order_dir, monkeypatch, fold)
        ad = load_lora(model, ad_dir, name="a")
        with torch.inference_mode():
            set_active(model, {"a": 1.0})
            fly = model.forward_batch(ids)
            set_active(model, None)
            ad.merge()
            merged = model.forward_batch(ids)
        out[fold] = (fly, merged)
    torch.testing.assert_close(out[True][0], out[False][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[True][1], out[False][1], atol=ATOL, rtol=0)
    assert (out[False][0] - out[False][1]).abs().max() > 10 * ATOL     # merging re-quantizes: the two differ
