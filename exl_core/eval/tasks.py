"""Task metrics: multiple-choice accuracy by log-likelihood (`exl eval task`), as lm-evaluation-harness scores
HellaSwag, ARC, PIQA and the like.

A task is a JSONL file, one example a line: {"context": str, "choices": [str, ...], "answer": int} (the index of
the right choice). Each choice is scored by the log-probability of its tokens after the context's:

    score(c)      = sum_i log p(c_i | context, c_<i)
    acc           = fraction of examples whose highest score is the answer
    acc_norm      = the same with score(c) / len(c in UTF-8 bytes), which does not favour short choices

As lm-evaluation-harness does, a choice's tokens are those of context + choice after the context's (the context
encoded as the tokenizer encodes a prompt, with its BOS setting), with whitespace that ends the context moved to the
choice first; so a choice is written as it follows the context (" Paris" after "The capital of France is"). Encoding
a choice on its own instead gave SentencePiece tokenizers (Llama-2, Mistral) an extra word-start token in every
choice. No data ships with exl_core: bring the task's file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..errors import InputError
from ..textfiles import jsonl_objects
from .perplexity import require_in_vocab


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass
class TaskResult:
    acc: float
    acc_norm: float
    examples: int
    scores: list            # per example: each choice's summed log-probability (nats)

    def as_dict(self) -> dict:
        return {"acc": self.acc, "acc_norm": self.acc_norm, "examples": self.examples}


def read_task(path, limit: Optional[int] = None) -> list[Example]:
    """The examples of a JSONL task file, checked line by line (the error names the file and the line)."""
    p = Path(path)
    if limit is not None and limit < 1:
        raise InputError(f"task limit {limit} must be >= 1")
    out = []
    for n, d in jsonl_objects(p, "task file"):
        ctx, choices, ans = (d.get(k) if isinstance(d, dict) else None for k in ("context", "choices", "answer"))
        if not isinstance(ctx, str) or not isinstance(choices, list) or len(choices) < 2 or \
                not all(isinstance(c, str) and c for c in choices):
            raise InputError(f"{p}:{n}: an example needs a \"context\" string and \"choices\", a list of two or more "
                             "non-empty strings")
        if isinstance(ans, bool) or not isinstance(ans, int) or not 0 <= ans < len(choices):
            raise InputError(f"{p}:{n}: \"answer\" must be the index of the right choice (0..{len(choices) - 1}), "
                             f"got {ans!r}")
        out.append(Example(ctx, tuple(choices), ans))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise InputError(f"task file {p} holds no examples")
    return out


@torch.inference_mode()
def choice_logprob(model, context_ids: Sequence[int], choice_ids: Sequence[int]) -> float:
    """sum_i log p(choice_i | context, choice_<i) under `model` (one forward pass over context + choice)."""
    if not context_ids or not choice_ids:
        raise InputError("a context and a choice need at least one token each")
    ids = torch.as_tensor(list(context_ids) + list(choice_ids), dtype=torch.int64)
    logits = model.forward_batch(ids[None].to(model.device))[0].float().cpu()
    n = len(context_ids)
    lp = torch.log_softmax(logits[n - 1:-1].double(), -1)                 # rows predicting the choice's tokens
    return lp.gather(-1, torch.as_tensor(list(choice_ids))[:, None])[:, 0].sum().item()


def evaluate_task(model, tokenizer, examples: Sequence[Example], progress: bool = False) -> TaskResult:
    it = examples
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(examples, desc="task", unit="example")
    right = right_norm = 0
    scores = []
    for i, ex in enumerate(it):
        context = ex.context.rstrip()
        moved = ex.context[len(context):]                 # the context's trailing whitespace goes with the choice
        ctx = tokenizer.encode(context)
        if not ctx:     # "" is fine where the tokenizer adds a BOS (minimal-pair tasks), else nothing to score on
            raise InputError(f"task example {i + 1}: its context encodes to no tokens (an empty context needs a "
                             "tokenizer that adds a BOS)")
        s = []
        for c in ex.choices:
            whole = tokenizer.encode(context + moved + c)
            require_in_vocab(whole, model.config.vocab_size, f"task example {i + 1}")
            if len(whole) <= len(ctx):
                raise InputError(f"task example {i + 1}: choice {c!r} adds no tokens after the context")
            s.append(choice_logprob(model, ctx, whole[len(ctx):]))      # as lm-evaluation-harness splits them
        norm = [v / len(c.encode("utf-8")) for v, c in zip(s, ex.choices)]
        right += max(range(len(s)), key=s.__getitem__) == ex.answer
        right_norm += max(range(len(norm)), key=norm.__getitem__) == ex.answer
        scores.append(s)
    return TaskResult(right / len(examples), right_norm / len(examples), len(examples), scores)


def evaluate_task_file(model_dir, task_file, limit: Optional[int] = None, device: str = "cpu",
                       progress: bool = False) -> TaskResult:
    from ..loader import load_model
    examples = read_task(task_file, limit)
    model, tok = load_model(model_dir, device=device)
    return evaluate_task(model, tok, examples, progress)
