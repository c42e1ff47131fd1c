"""SamplerSettings and the sampling functions' inputs: invalid values refused with the field named, ints too large
for a float, token ids against the vocabulary, penalties that overflow the logits, the valid edges, shapes."""
from __future__ import annotations

import pytest
import torch

from exl_core.errors import InputError, SamplerError
from exl_core.generation.sampling import SamplerSettings, processed_probs, sample, sample_batch
from test_sampling import NEG, kept, probs64


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", float("nan")),
    ("typical", 0.0), ("typical", 1.2),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("nan")),
    ("frequency_penalty", float("nan")), ("presence_penalty", float("inf")),
    ("penalty_range", -2), ("penalize_prompt", 1), ("temperature_last", "yes"),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {3: float("nan")}), ("logit_bias", {3: float("inf")}),
    ("logit_bias", [1, 2]), ("banned_tokens", [4, -2]), ("banned_tokens", ["a"]),
    # an iterator was used up by the check, an array / tensor failed at sample time (len(), truth value)
    ("banned_tokens", iter([2])), ("banned_tokens", (t for t in [2])), ("banned_tokens", torch.tensor([1, 2])),
])
def test_invalid_settings_name_the_field(field, value):
    with pytest.raises(SamplerError, match=field):
        SamplerSettings(**{field: value})
    s = SamplerSettings()
    setattr(s, field, value)                       # mutated after construction
    with pytest.raises(SamplerError, match=field):
        s.validate()


def test_ints_too_large_for_a_float_are_refused():
    """math.isfinite / float() raised a bare OverflowError on them."""
    for field in ("temperature", "top_p", "repetition_penalty", "frequency_penalty"):
        for v in (10 ** 400, -10 ** 400):
            with pytest.raises(SamplerError, match=f"SamplerSettings.{field}=.* is invalid"):
                SamplerSettings(**{field: v})
    for v in (10 ** 400, -10 ** 400):
        with pytest.raises(SamplerError, match="logit_bias.*biases must be finite numbers or -inf"):
            SamplerSettings(logit_bias={1: v})
    import sys
    if sys.get_int_max_str_digits():                 # past Python's int -> str limit, repr() itself fails
        with pytest.raises(SamplerError, match="temperature=<a number too large to print> is invalid"):
            SamplerSettings(temperature=10 ** sys.get_int_max_str_digits())


def test_token_ids_checked_against_vocab():
    s = SamplerSettings(logit_bias={100: 1.0}, banned_tokens=[5])
    s.validate()                                   # vocab unknown: fine
    with pytest.raises(SamplerError, match=r"logit_bias.*\[0, 50\)"):
        s.validate(vocab_size=50)
    with pytest.raises(SamplerError, match="logit_bias"):
        processed_probs(torch.randn(50), s)
    with pytest.raises(SamplerError, match="banned_tokens"):
        sample(torch.randn(4), SamplerSettings(banned_tokens=[4]))


def test_penalties_that_overflow_the_logits_are_refused():
    """Accepted extremes (repetition_penalty 1e-308, frequency_penalty -1e308) overflowed a logit to inf: the row
    became NaN and sample() returned a fixed token."""
    for s in (SamplerSettings(repetition_penalty=1e-308), SamplerSettings(frequency_penalty=-1e308)):
        with pytest.raises(SamplerError, match="overflowed"):
            sample(torch.tensor([1.0, 2.0, 0.5]), s, history=[0, 0, 1])
        with pytest.raises(SamplerError, match="overflowed"):
            processed_probs(torch.tensor([1.0, 2.0, 0.5]), s, history=[0, 0, 1])


def test_valid_edges_accepted():
    SamplerSettings(temperature=0, top_p=1.0, min_p=1.0, typical=1.0, top_k=0, penalty_range=0,
                    logit_bias={0: NEG}).validate(1)
    assert SamplerSettings.greedy().is_greedy and not SamplerSettings().is_greedy
    import numpy as np                              # numpy scalars are numbers too
    for ok in (range(0, 2), {0: 1, 1: 1}.keys(), (0, 1), {0, 1}):     # any sized container of ids
        assert kept(probs64([5.0, 1.0, 2.0], SamplerSettings(banned_tokens=ok))) == {2}
    s = SamplerSettings(top_k=np.int64(3), temperature=np.float32(0.5), banned_tokens=[np.int64(0)])
    ps = probs64([5.0, 1.0, 2.0, 3.0, 4.0], s)
    assert kept(ps) == {2, 3, 4}


def test_shape_errors():
    with pytest.raises(InputError, match=r"\[V\]"):
        sample(torch.randn(2, 5), SamplerSettings())
    with pytest.raises(InputError, match="2 SamplerSettings"):
        sample_batch(torch.randn(3, 5), [SamplerSettings()] * 2)
    with pytest.raises(InputError, match="floating"):
        sample(torch.arange(5), SamplerSettings())
