"""The attention output stored in o_proj's act-order (ops.attention.OutOrder / out_order_for, model/llama.py
_attend_for_o): the store map against x[..., perm] for permutations and for the extended ones of weights with extra
rows, its refusals, and a model whose o projection then reads that order without a gather giving the gathering path's
logits.  The CUDA kernel's stores are tested in tests/test_cuda_attn_out_order.py; here a context stores through the
map the way that kernel does (scatter to pos, and to pos2 where it has an entry), on the CPU per-op path."""
from __future__ import annotations

import pytest
import torch

from exl_core.ops.attention import OutOrder, out_order_for


def stored(x: torch.Tensor, order: OutOrder) -> torch.Tensor:
    """What the kernel writes for output rows x (T, width) under `order` (paged_attention_kernel.cuh store_out)."""
    y = torch.full((x.shape[0], order.cols), float("nan"), dtype=x.dtype)
    y[:, order.pos.long()] = x
    if order.pos2 is not None:
        twice = order.pos2 >= 0
        y[:, order.pos2[twice].long()] = x[:, twice]
    return y


@pytest.mark.parametrize("extra", [0, 1, 37, 64])
def test_store_map_gives_the_weight_order(extra):
    g = torch.Generator().manual_seed(extra)
    width = 64
    again = torch.randperm(width, generator=g)[:extra]          # columns an extra row reads again (each once)
    perm = torch.cat([torch.randperm(width, generator=g), again])
    perm = perm[torch.randperm(perm.numel(), generator=g)] if extra == 37 else perm   # extras anywhere, not only last
    order = out_order_for(perm, width)
    assert order is not None and order.cols == width + extra and order.pos.dtype == torch.int32
    assert (order.pos2 is None) == (extra == 0)
    x = torch.randn(3, width, generator=g)
    assert torch.equal(stored(x, order), x[:, perm])             # every column written, in the weight's order


@pytest.mark.parametrize("perm,why", [
    (torch.tensor([0, 1, 2, 0, 0]), "a column read three times"),
    (torch.tensor([0, 1, 1, 3]), "a column never read"),
    (torch.tensor([0, 1, 2, 4]), "an entry past the width"),
    (torch.tensor([0, 1, -1, 3]), "a negative entry"),
    (torch.tensor([0, 1, 2]), "fewer entries than columns"),
])
def test_store_map_refuses_what_no_store_can_give(perm, why):
    assert out_order_for(perm, 4) is None, why


def _ordering_context(calls: list):
    """A ContiguousContext class whose attend_rope_ordered stores attention's output through the map (as the CUDA
    kernel does) -- the CPU has no such kernel, so the model's contexts there return None."""
    from exl_core.model.context import ContiguousContext
    from exl_core.ops.rope import apply_rope

    class Ordering(ContiguousContext):
        def attend_rope_ordered(self, layer, q, k, v, cos_sin, scale, window, order):
            q, k = apply_rope(q, k, self.positions, cos_sin)
            out = self.attend(layer, q, k, v, scale, window)
            calls.append(order.cols)
            return stored(out.reshape(out.shape[0], -1), order)
    return Ordering


@pytest.mark.parametrize("uniform4", [False, True], ids=["exl2", "exl2-as-uniform4"])
def test_model_with_o_reading_the_stored_order_keeps_the_logits(exl2_act_order_dir, uniform4,
                                                                 monkeypatch):
    """EXL2 act-order (o has its own permutation): o's input stored in that order and o run without its gather gives
    the gathering path's logits (fp32: the same products and sums).  Rewritten as uniform 4-bit rows, o's extra rows
    read some columns twice: the map's second positions."""
    from exl_core.loader import as_uniform4_weights, load_model
    from exl_core.model import llama
    model = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0]
    if uniform4:
        assert as_uniform4_weights(model, max_growth=10.0) > 0
    o = model.layers[0].self_attn.o_proj
    assert o.packed.perm is not None and (o.packed.rows is not None) == uniform4
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(8))
    calls = []
    with torch.inference_mode():
        ref = model.forward_batch(ids)
        monkeypatch.setattr(llama, "ContiguousContext", _ordering_context(calls))
        assert not calls and model.forward_batch(ids) is not None and not calls   # the default: CUDA only
        monkeypatch.setattr(llama, "ATTN_OUT_ORDER_DEVICES", ("cuda", "cpu"))
        got = model.forward_batch(ids)
    assert len(calls) == len(model.layers)                # every layer's o read the stored order
    assert (max(calls) > o.in_features) == uniform4       # extra rows: wider than attention's output
    assert float(ref.abs().max()) > 1e-2
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_no_order_without_a_permutation_or_for_a_view(tiny_llama_dir, exl2_act_order_dir, tmp_path):
    from exl_core.loader import load_model
    from exl_core.model.linear import Prepermuted, input_out_order
    from exl_core.quantize.rtn import quantize_model_rtn
    q = quantize_model_rtn(tiny_llama_dir, tmp_path / "q", fmt="gptq", bits=4, group_size=32, act_order=False)
    o = load_model(q, dtype=torch.float32, load_tokenizer=False)[0].layers[0].self_attn.o_proj
    assert o.packed.perm is None and input_out_order(o, o.in_features) is None
    o = load_model(exl2_act_order_dir, dtype=torch.float32, load_tokenizer=False)[0].layers[0].self_attn.o_proj
    order = input_out_order(o, o.in_features)
    assert order is not None and input_out_order(o, o.in_features) is order            # made once
    assert input_out_order(o, o.in_features + 1) is None                                 # not attention's width
    assert input_out_order(Prepermuted(o), o.in_features) is None                        # a view has no permutation
    o.lora = object()
    assert input_out_order(o, o.in_features) is None                                     # LoRA: not plain
