"""Cheap per-step paths of the generator and sampler at batch 1 give exactly what the general
paths give."""
from __future__ import annotations

import math

import pytest
import torch

from exl_core.errors import InputError, SamplerError
from exl_core.generation.sampling import SamplerSettings, sample_batch


def _assert_fast_path_is_general_path(x: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    """sample_batch on float32 logits x [B >= 4, V] (the fast greedy path) and on their float64 copy (the general
    path): the same ids and logprob bits, logprobs as float64's log-softmax, a NaN raising; returns the ids."""
    B = x.shape[0]
    ids, lps = sample_batch(x, [s] * B)
    ids64, lps64 = sample_batch(x.double(), [s] * B)
    assert torch.equal(ids, ids64) and torch.equal(lps, lps64)
    ref = torch.log_softmax(x.double(), 1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(lps.double(), ref, atol=1e-5)
    bad = x.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        sample_batch(bad, s)
    return ids


def test_plain_greedy_fast_path_matches_general_path():
    """Greedy rows without bias/ban/penalty skip the float64 copy (float32 logits); float64 logits
    take the general path: same ids (ties -> lowest id) and logprobs, same errors."""
    from exl_core.generation.sampling import _plain_greedy
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3001, generator=g) * 3
    x[1, 7] = x[1, 9] = x[1].max() + 1          # a tie: lowest id wins
    x[2, :] = -math.inf
    x[2, 5] = 0.0
    s = SamplerSettings(temperature=0)
    assert _plain_greedy(x, [s] * 4, None, None, None) is not None
    assert _plain_greedy(x.double(), [s] * 4, None, None, None) is None
    assert _plain_greedy(x, [s, s, SamplerSettings(temperature=0, banned_tokens=[1]), s], None, None, None) is None
    ids = _assert_fast_path_is_general_path(x, s)
    assert ids[1] == 7 and ids[2] == 5
    dead = x.clone()
    dead[0] = -math.inf
    with pytest.raises(SamplerError, match="row 0"):
        sample_batch(dead, s)
    with pytest.raises(SamplerError, match="row 0"):
        sample_batch(dead.double(), s)


def _greedy_rows(V: int, g: torch.Generator) -> torch.Tensor:
    """Logit rows for greedy_pick's checks (_check_greedy_pick): a tie (ids 100 and V - 2), a single finite token,
    a NaN, a dead row, the maximum in the last column."""
    x = torch.randn(6, V, generator=g) * 4
    x[1, 100] = x[1, V - 2] = x[1].max() + 2       # tie: lowest id
    x[2, :] = -math.inf
    x[2, 17] = -3.0                                # a single finite token
    x[3, 5] = float("nan")
    x[4, :] = -math.inf                            # dead row
    x[5, V - 1] = 50.0                             # the maximum in the (ragged) tail
    return x


def _check_greedy_pick(x: torch.Tensor, ids, lse, m, lp) -> None:
    """greedy_pick's outputs (on any device) against a float64 brute force of x's rows (_greedy_rows): first index of
    the maximum, log-sum-exp, the chosen token's logprob from that lse, NaN flagged in row_max."""
    x, ids, lse, m, lp = (t.cpu() for t in (x, ids, lse, m, lp))
    V = x.shape[1]
    assert lse.dtype == torch.float64 and ids.dtype == torch.int64
    ref_lse = torch.logsumexp(x.double(), dim=1)
    for b in [0, 1, 2, 5]:
        row = x[b].double()
        assert int(ids[b]) == int((row == row.max()).nonzero()[0])
        assert float(m[b]) == float(row.max())
        assert abs(float(lse[b]) - float(ref_lse[b])) < 1e-6 * max(1.0, abs(float(ref_lse[b])))
        assert lp[b] == (x[b, ids[b]].double() - lse[b]).float()      # the chosen token's logprob
    assert int(ids[1]) == 100 and int(ids[2]) == 17 and int(ids[5]) == V - 1
    assert math.isnan(float(m[3])) and float(m[4]) == -math.inf


@pytest.mark.parametrize("isa", [0, 2])
def test_greedy_pick_op_against_float64(isa):
    """exl_core::greedy_pick (the CPU fast path's one op) vs a float64 brute force: first index of
    the maximum, log-sum-exp, NaN flagged in row_max; AVX-512 and scalar paths, ragged V."""
    from exl_core.ops.dispatch import has_op
    if not has_op("greedy_pick"):
        pytest.skip("extension without exl_core::greedy_pick")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))    # fresh data every run
    x = _greedy_rows(3001, g)
    prev = torch.ops.exl_core.cpu_isa_limit(isa)
    try:
        out = torch.ops.exl_core.greedy_pick(x)
    finally:
        torch.ops.exl_core.cpu_isa_limit(prev)
    _check_greedy_pick(x, *out)


@pytest.mark.cuda
@pytest.mark.parametrize("V", [3001, 32000, 49152, 151936])
@pytest.mark.parametrize("aligned", [True, False])
def test_greedy_pick_cuda_against_float64(V, aligned):
    """The CUDA kernel (csrc/cuda/greedy_cuda.cu) against the float64 brute force: float4 rows (V % 4 == 0, 16-byte
    aligned) and scalar ones (ragged V, or the rows a float off alignment); ids and row maxima equal the CPU op's."""
    from exl_core.ops.dispatch import has_cuda_kernel
    if not has_cuda_kernel("greedy_pick"):
        pytest.skip("extension without the CUDA greedy_pick")
    g = torch.Generator().manual_seed(V + aligned)
    x = _greedy_rows(V, g)
    buf = torch.full((x.numel() + 1,), float("nan"), device="cuda")
    xc = buf[:-1] if aligned else buf[1:]
    xc = xc.view(x.shape)
    xc.copy_(x)
    out = torch.ops.exl_core.greedy_pick(xc)
    assert all(t.is_cuda for t in out)
    _check_greedy_pick(x, *out)
    cpu = torch.ops.exl_core.greedy_pick(x)
    assert torch.equal(out[0].cpu(), cpu[0])
    assert torch.equal(out[2].cpu()[[0, 1, 2, 4, 5]], cpu[2][[0, 1, 2, 4, 5]])


@pytest.mark.cuda
def test_greedy_pick_cuda_rows_past_one_launch():
    """More rows than one launch's grid holds (65,535 on grid y): every row's id and maximum as torch's argmax and
    amax.  (Passed on the H200 in stop 48 call 1, bench/results/cuda_tests_h200_stop48_call1.txt.)"""
    from exl_core.ops.dispatch import has_cuda_kernel
    if not has_cuda_kernel("greedy_pick"):
        pytest.skip("extension without the CUDA greedy_pick")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(65535 + 7, 12, generator=g).cuda()
    ids, lse, m, lp = torch.ops.exl_core.greedy_pick(x)
    assert torch.equal(ids, x.argmax(1)) and torch.equal(m, x.amax(1))
    assert torch.allclose(lse, torch.logsumexp(x.double(), 1), rtol=0, atol=1e-6)


@pytest.mark.cuda
def test_plain_greedy_fast_path_on_cuda_matches_general_path():
    """On a GPU the sampler's fast greedy path (greedy_pick) and its general path (float64 copy, argmax, the chosen
    logprob through greedy_pick's lse) give the same ids and the same logprob bits; errors as on CPU.  (The logprob
    bits' assertion passed on the H200 in stop 48 call 1.)"""
    from exl_core.generation.logprobs import native_lse
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 32000, generator=g) * 3).cuda()
    x[1, 7] = x[1, 9] = x[1].max() + 1
    assert native_lse(x)
    ids = _assert_fast_path_is_general_path(x, SamplerSettings(temperature=0))
    assert int(ids[1]) == 7 and torch.equal(ids.cpu(), x.cpu().argmax(1))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.exl_core.greedy_pick(x.half())
