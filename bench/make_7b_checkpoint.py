"""Writes a random-weight Llama-2-7B-shaped checkpoint directly in GPTQ or EXL2 layout.

No real weights and no download: packed integers are uniform random (every code equally
likely, which is what a kernel's speed depends on), scales are plausible for a 7B model
(dequantised weights of std ~0.01), norms are ones, embeddings/head fp16 N(0, 0.02).

    python bench/make_7b_checkpoint.py --fmt gptq --out /tmp/llama7b_gptq
    python bench/make_7b_checkpoint.py --fmt exl2 --out /tmp/llama7b_exl2   # ~4.0 bpw, 5/4/3-bit mix, act-order
                                                                           # shared by q/k/v and by gate/up

Smaller shapes for a dry run on the CPU: --layers 2 --hidden 256 --inter 768 --vocab 1000.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from exl_core.formats.safetensors_io import ShardedWriter

G = 128   # rows per group


def _rand_words(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-2**31, 2**31, (rows, n), generator=gen, dtype=torch.int64).to(torch.int32)


def gptq_layer(K: int, N: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """4-bit g128 symmetric v1 checkpoint: qzeros store 8-1 = 7 in every nibble."""
    groups = K // G
    return {
        "qweight": _rand_words(K // 8, N, gen),
        "qzeros": torch.full((groups, N // 8), 0x77777777, dtype=torch.int32),
        "scales": (torch.rand(groups, N, generator=gen) * 0.002 + 0.002).to(torch.float16),
        "g_idx": (torch.arange(K, dtype=torch.int32) // G),
    }


def exl2_segments(K: int) -> list[tuple[int, int]]:
    """[(bits, rows)]: ~1/11 of rows at 5 bits, 9/11 at 4, 1/11 at 3 -> 4.0 bits on average."""
    edge = max(G, (K // 11) // G * G)
    return [(5, edge), (4, K - 2 * edge), (3, edge)]


def exl2_layer(K: int, N: int, gen: torch.Generator, invperm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """invperm: the act-order permutation's inverse to store (one shared by a group), else a fresh random one."""
    words, q_groups, qrow = [], [], 0
    for bits, rows in exl2_segments(K):
        for _ in range(rows // G):
            nq = G * bits // 32
            words.append(_rand_words(nq, N, gen))
            q_groups += [bits, qrow]
            qrow += nq
    ng = len(q_groups) // 2
    return {
        "q_weight": torch.cat(words),
        "q_invperm": invperm if invperm is not None else torch.randperm(K, generator=gen).to(torch.int32),
        "q_scale": _rand_words(ng, N // 8, gen) & 0x77777777,            # codes 0..7 -> scale (c+1)^2/256*max
        "q_scale_max": torch.full((ng,), 0.01, dtype=torch.float16),
        "q_groups": torch.tensor(q_groups, dtype=torch.int16),
    }


def make(out: Path, fmt: str, layers: int = 32, hidden: int = 4096, inter: int = 11008, vocab: int = 32000,
         heads: int = 32, kv_heads: int = 32, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    layer_fn = gptq_layer if fmt == "gptq" else exl2_layer
    qc = ({"quant_method": "gptq", "bits": 4, "group_size": G, "sym": True, "desc_act": False,
           "checkpoint_format": "gptq"} if fmt == "gptq" else
          {"quant_method": "exl2", "version": "0.2.0", "bits": 4.0, "head_bits": 16})
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16", "quantization_config": qc}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    d = hidden // heads
    with ShardedWriter(out, max_shard_bytes=4 * 1024 ** 3) as w:
        w.add("model.embed_tokens.weight", (torch.randn(vocab, hidden, generator=gen) * 0.02).half())
        for i in range(layers):
            p = f"model.layers.{i}"
            # EXL2: as ExLlamaV2's converter writes them, k and v share q's act-order permutation (they are quantized
            # with q's Hessian) and gate shares up's; o and down have their own.
            shared = {"qkv": torch.randperm(hidden, generator=gen).to(torch.int32),
                      "gu": torch.randperm(hidden, generator=gen).to(torch.int32)} if fmt == "exl2" else {}
            group = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
                     "mlp.gate_proj": "gu", "mlp.up_proj": "gu"}
            for name, (k, n) in {"self_attn.q_proj": (hidden, heads * d), "self_attn.k_proj": (hidden, kv_heads * d),
                                 "self_attn.v_proj": (hidden, kv_heads * d), "self_attn.o_proj": (heads * d, hidden),
                                 "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
                                 "mlp.down_proj": (inter, hidden)}.items():
                kw = {"invperm": shared[group[name]]} if fmt == "exl2" and name in group else {}
                for suffix, t in layer_fn(k, n, gen, **kw).items():
                    w.add(f"{p}.{name}.{suffix}", t)
            w.add(f"{p}.input_layernorm.weight", torch.ones(hidden, dtype=torch.float16))
            w.add(f"{p}.post_attention_layernorm.weight", torch.ones(hidden, dtype=torch.float16))
        w.add("model.norm.weight", torch.ones(hidden, dtype=torch.float16))
        w.add("lm_head.weight", (torch.randn(vocab, hidden, generator=gen) * 0.02).half())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", choices=["gptq", "exl2"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=32)
    a = ap.parse_args()
    make(a.out, a.fmt, a.layers, a.hidden, a.inter, a.vocab, a.heads, a.heads)
    print(f"wrote {a.fmt} checkpoint to {a.out}")


if __name__ == "__main__":
    main()
