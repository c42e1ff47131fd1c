"""Cheap per-step paths of the generator and sampler at batch 1 give exactly what the general
paths give."""
from __future__ import annotations

import math

import pytest
import torch

from exl_core.errors import InputError, SamplerError
from exl_core.generation.sampling import SamplerSettings, sample_batch


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
    ids, lps = sample_batch(x, [s] * 4)
    ids64, lps64 = sample_batch(x.double(), [s] * 4)
    assert torch.equal(ids, ids64) and ids[1] == 7 and ids[2] == 5
    assert torch.equal(lps, lps64)
    ref = torch.log_softmax(x.double(), 1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(lps.double(), ref, atol=1e-5)
    bad = x.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        sample_batch(bad, s)
    dead = x.clone()
    dead[0] = -math.inf
    with pytest.raises(SamplerError, match="row 0"):
        sample_batch(dead, s)
    with pytest.raises(SamplerError, match="row 0"):
        sample_batch(dead.double(), s)
