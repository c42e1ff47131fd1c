"""The whole model on CUDA: quantized tiny Llama logits vs the CPU model, generator batching."""
from __future__ import annotations

import random

import pytest
import torch

from exl_core.testing import assert_same_tokens_up_to_ties

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=["gptq", "exl2"])
def quant_dir(request, tiny_model_factory, tmp_path_factory):
    from exl_core.quantize.rtn import quantize_model_rtn
    # hidden 128 / intermediate 352: K multiples of 32 with several groups, N multiples of 4 and not
    src = tiny_model_factory("llama", seed=random.randrange(1000), hidden_size=128, intermediate_size=352,
                             num_attention_heads=4, num_key_value_heads=2)
    dst = tmp_path_factory.mktemp(f"q_{request.param}")
    bits = 4 if request.param == "gptq" else [(6, 0.25), (4, 0.5), (3, 0.25)]
    return quantize_model_rtn(src, dst, fmt=request.param, bits=bits, group_size=32,
                              act_order=request.param == "exl2")


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert not torch.isnan(a).any()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("T", [1, 7, 40])
def test_cuda_logits_match_cpu(quant_dir, T):
    from exl_core.loader import load_model
    cpu, _ = load_model(quant_dir, device="cpu", dtype=torch.float32, load_tokenizer=False)
    gpu, _ = load_model(quant_dir, device="cuda", dtype=torch.float16, load_tokenizer=False)
    assert any(m.is_quantized for _, m in gpu.linear_layers())
    ids = torch.randint(0, cpu.config.vocab_size, (2, T))
    ref = cpu.forward_batch(ids)
    got = gpu.forward_batch(ids.cuda())
    assert got.shape == ref.shape
    assert _rel(got, ref) < 2e-2
    # decode continues from cached K/V the same way on both devices
    kv_c = [cpu.new_sequence_kv(T + 4) for _ in range(2)]
    kv_g = [gpu.new_sequence_kv(T + 4) for _ in range(2)]
    cpu.forward_batch(ids, kv_c)
    gpu.forward_batch(ids.cuda(), kv_g)
    nxt = torch.randint(0, cpu.config.vocab_size, (2, 1))
    assert _rel(gpu.forward_batch(nxt.cuda(), kv_g), cpu.forward_batch(nxt, kv_c)) < 2e-2


def test_perplexity_of_a_gpu_model_matches_the_cpu_one(quant_dir):
    """The evaluator on a CUDA model (`exl eval ppl --device cuda`): the targets meet the logits on their device."""
    from exl_core.eval.perplexity import perplexity
    from exl_core.loader import load_model
    cpu, _ = load_model(quant_dir, device="cpu", dtype=torch.float32, load_tokenizer=False)
    gpu, _ = load_model(quant_dir, device="cuda", dtype=torch.float16, load_tokenizer=False)
    ids = torch.randint(0, cpu.config.vocab_size, (70,)).tolist()
    ref, got = perplexity(cpu, ids, ctx=32, stride=16), perplexity(gpu, ids, ctx=32, stride=16)
    assert got.tokens == ref.tokens and abs(got.ppl / ref.ppl - 1) < 2e-2


def test_generator_batched_equals_alone_on_gpu(quant_dir):
    from exl_core.cache import Cache
    from exl_core.generation import Generator, Job
    from exl_core.generation.sampling import SamplerSettings
    from exl_core.loader import load_model
    greedy = SamplerSettings(temperature=0.0)
    model, _ = load_model(quant_dir, device="cuda", dtype=torch.float32, load_tokenizer=False)
    prompts = [[random.randrange(1000) for _ in range(random.randint(3, 50))] for _ in range(4)]

    def run(gen):
        while gen.has_work():
            gen.iterate()
    def job(p):
        return Job(p, max_new_tokens=8, sampler=greedy, stop_on_eos=False, return_logprobs=True)
    gen = Generator(model, Cache(model, max_tokens=1024, page_size=16), max_batch_tokens=128, max_chunk_size=32)
    together = gen.enqueue([job(p) for p in prompts])
    run(gen)
    for p, j in zip(prompts, together):
        g = Generator(model, Cache(model, max_tokens=1024, page_size=16), max_batch_tokens=128, max_chunk_size=32)
        alone = g.enqueue(job(p))
        run(g)
        # cuBLAS (prefill) rounds differently for different row counts: equal up to near-ties
        assert_same_tokens_up_to_ties(alone.generated, alone.logprobs, j.generated, j.logprobs, 2e-3)
        assert len(j.generated) == 8


@pytest.mark.parametrize("T", [1, 7, 40])
def test_cuda_uniform4_rewrite_matches_cpu(quant_dir, T):
    """EXL2's mixed widths rewritten as uniform 4-bit rows on the GPU (loader.as_uniform4_weights, the CUDA
    default): the logits still match the CPU model's."""
    from exl_core.loader import as_uniform4_weights, load_model
    cpu, _ = load_model(quant_dir, device="cpu", dtype=torch.float32, load_tokenizer=False)
    gpu, _ = load_model(quant_dir, device="cuda", dtype=torch.float16, load_tokenizer=False)
    n = as_uniform4_weights(gpu, max_growth=10.0)
    assert (n > 0) == ("exl2" in str(quant_dir))
    ids = torch.randint(0, cpu.config.vocab_size, (2, T))
    assert _rel(gpu.forward_batch(ids.cuda()), cpu.forward_batch(ids)) < 2e-2
