"""The decode attention kernel storing its output in o_proj's act-order (exl_core::paged_attention_rope's out_pos /
out_pos2 / out_cols; ops.attention.rope_paged_attention_ordered): its output is the plain launch's with the columns
in the weight's order, bit for bit, for every way the kernel writes (one split, the cluster merge, the combine
kernel), for a permutation and for the extended order of a weight with extra rows; and the Generator decoding an
act-order model with o reading that order gives the same tokens and log-probabilities as o gathering its input."""
from __future__ import annotations

import random

import pytest
import torch
from test_cuda_paged_attention import _decode_rope_case, _need_kernel, _splits

pytestmark = pytest.mark.cuda


def _perm(width: int, extra: int, seed: int) -> torch.Tensor:
    """A weight's act-order over `width` columns; with extra > 0, extra rows that read columns again (each at most
    once more), placed after the permutation as formats/uniform4.py appends them."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randperm(width, generator=g), torch.randperm(width, generator=g)[:extra]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_lens,hq,hkv,d,merge", [
    ([129] * 32, 32, 32, 128, "one split"),                     # the bench's batch 32: the one-wave instance
    ([60] * 70, 8, 8, 128, "one split"),                        # the default G 1 instance
    ([400], 8, 2, 128, "cluster"),                              # 2..8 splits of a small grid
    ([300], 4, 2, 256, "cluster"),
    ([2000], 8, 2, 128, "combine kernel"),                      # more than 8 splits
    ([400 - i for i in range(40)], 8, 2, 128, "combine kernel"),  # 2..8 splits over a larger grid
    ([5, 33, 200], 9, 3, 64, None),                             # 3 heads padded to the 4-head instance
    # one stored value a thread (G * D <= 128: the bench's G 1, D 128 at batch 1), whichever merge the grid takes
    ([400], 8, 8, 128, None),
    ([300], 4, 2, 64, None),
    ([60] * 6, 4, 2, 64, None),
])
@pytest.mark.parametrize("extra", [0, 100], ids=["perm", "perm+100"])
def test_ordered_output_is_the_plain_output_in_the_weight_order(dtype, k_lens, hq, hkv, d, merge, extra):
    from exl_core.ops import attention as att
    _need_kernel()
    q, k, v, pos, cos_sin, kc0, vc0, slots, table, cu, lens = _decode_rope_case(
        len(k_lens), k_lens, hq, hkv, d, 16, dtype, seed=hq * d + len(k_lens) + extra)
    rows, n = len(k_lens), _splits(len(k_lens), hkv, table, 16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    path = "one split" if n == 1 else "cluster" if n <= 8 and rows * hkv * n <= 2 * sms else "combine kernel"
    assert merge in (None, path), (n, path)                     # the shapes take the store site they are for
    width, scale = hq * d, d ** -0.5
    perm = _perm(width, extra, seed=width + extra)
    order = att.out_order_for(perm, width, device="cuda")
    assert order is not None and order.cols == width + extra
    kc, vc = kc0.clone(), vc0.clone()
    plain = att.rope_paged_attention(q, k, v, pos, cos_sin, kc, vc, slots, table, cu, lens, scale, None, 1)
    ko, vo = kc0.clone(), vc0.clone()
    got = att.rope_paged_attention_ordered(q, k, v, pos, cos_sin, ko, vo, slots, table, cu, lens, scale, None, 1, order)
    assert got is not None and got.shape == (rows, width + extra)
    assert torch.isfinite(plain).all()
    assert torch.equal(got, plain.reshape(rows, width)[:, perm.cuda()])
    assert torch.equal(ko.nan_to_num(7.0), kc.nan_to_num(7.0)) and torch.equal(vo.nan_to_num(7.0), vc.nan_to_num(7.0))


def test_ordered_launch_refuses_what_it_cannot_serve():
    """Maps of another width, dtype or device, and rows past the first of a sequence (max_q_len 2), give None with
    nothing done: the caller runs the plain launch (a map the C++ check would refuse must not reach it)."""
    from exl_core.ops import attention as att
    _need_kernel()
    q, k, v, pos, cos_sin, kc, vc, slots, table, cu, lens = _decode_rope_case(2, [20, 9], 4, 2, 64, 8,
                                                                               torch.float16, seed=5)
    args = (q, k, v, pos, cos_sin, kc, vc, slots, table, cu, lens, 0.125, None)
    good = att.out_order_for(_perm(256, 0, 1), 256, device="cuda")
    assert att.rope_paged_attention_ordered(*args, 2, good) is None
    for bad in (att.out_order_for(_perm(128, 0, 1), 128, device="cuda"),       # another width
                att.out_order_for(_perm(256, 0, 1), 256, device="cpu"),        # another device
                att.OutOrder(good.pos.long(), None, 256),                      # int64
                att.OutOrder(good.pos, None, 255)):                            # fewer columns than attention's
        assert att.rope_paged_attention_ordered(*args, 1, bad) is None
    before = kc.clone()
    assert att.rope_paged_attention_ordered(*args, 1, good) is not None
    assert not torch.equal(before.nan_to_num(7.0), kc.nan_to_num(7.0))       # the served launch wrote the own keys


@pytest.fixture(scope="module", params=["exl2", "gptq", "exl2-u4"])
def act_order_model(request, tiny_model_factory, tmp_path_factory):
    """An act-order model (o_proj has its own permutation): EXL2 with mixed widths, GPTQ 4-bit, and the EXL2 one
    rewritten as uniform 4-bit rows (loader.as_uniform4_weights: o's extended order reads some columns twice)."""
    from exl_core.loader import as_uniform4_weights, load_model
    from exl_core.quantize.rtn import quantize_model_rtn
    fmt = request.param.split("-")[0]
    src = tiny_model_factory("llama", seed=9, vocab_size=500, hidden_size=256, intermediate_size=384,
                             num_attention_heads=4, num_key_value_heads=2)
    bits = [(6, 0.25), (4, 0.5), (3, 0.25)] if fmt == "exl2" else 4
    q = quantize_model_rtn(src, tmp_path_factory.mktemp(f"{request.param}_ao"), fmt=fmt, bits=bits,
                           group_size=32, act_order=True)
    model = load_model(q, device="cuda", dtype=torch.float16, load_tokenizer=False)[0]
    if request.param == "exl2-u4":
        assert as_uniform4_weights(model, max_growth=10.0) > 0
        assert model.layers[0].self_attn.o_proj.packed.rows is not None
    assert model.layers[0].self_attn.o_proj.packed.perm is not None
    model.variant = request.param
    return model


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_generator_with_o_reading_the_stored_order_matches_the_gathering_path(act_order_model, graphs, monkeypatch):
    """Batches of 3..1 decode rows (the staged batch-1 kernel and the skinny ones): tokens and log-probabilities bit
    for bit with EXL_CORE_ATTN_OUT_ORDER's path and without it (o gathering its input itself); for the uniform
    4-bit rewrite up to near-ties."""
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    from exl_core.model import llama
    from exl_core.model.linear import Prepermuted
    _need_kernel()
    model = act_order_model
    rnd = random.Random(4)
    prompts = [[rnd.randrange(3, 500) for _ in range(n)] for n in (6, 33, 17)]
    views = []
    real = Prepermuted.__init__

    def counted(self, layer):
        views.append(layer)
        real(self, layer)
    monkeypatch.setattr(Prepermuted, "__init__", counted)

    def run():
        gen = Generator(model, Cache(model, max_tokens=2048, page_size=16), None, max_batch_tokens=256,
                        max_chunk_size=64, cuda_graphs=graphs)
        jobs = gen.enqueue([Job(p, max_new_tokens=m, sampler=SamplerSettings(temperature=0.0), stop_on_eos=False,
                                return_logprobs=True) for p, m in zip(prompts, (9, 14, 5))])
        while gen.has_work():
            gen.iterate()
        return [(j.generated, list(j.logprobs)) for j in jobs]

    monkeypatch.setattr(llama, "ATTN_OUT_ORDER_DEVICES", ())
    theirs = run()
    assert not views
    monkeypatch.setattr(llama, "ATTN_OUT_ORDER_DEVICES", ("cuda",))
    mine = run()
    assert len(views) >= len(model.layers)          # o read the stored order (eager steps; graphs record it once)
    if model.variant != "exl2-u4":
        assert mine == theirs
        return
    # o's weight without its extended order is a plain uniform 4-bit weight of more rows, which the kernels'
    # launch rules may route differently than the gathering path: the same tokens up to near-ties
    from exl_core.testing import assert_same_tokens_up_to_ties
    for (ta, la), (tb, lb) in zip(mine, theirs):
        assert_same_tokens_up_to_ties(ta, la, tb, lb, 2e-3)
