"""`load_model(path)`: a model folder (dense, GPTQ or EXL2 safetensors) → (Model, Tokenizer).

The loader is where files meet modules: it reads config.json, validates every tensor it
takes against the shape the config implies, asks the format registry whether a projection
is quantized (and lets that format convert it into the kernel layout), and never leaves a
weight uninitialised.
"""
from __future__ import annotations

import dataclasses
import os
import re
import warnings

from pathlib import Path
from typing import Optional

import torch

from .config import ModelConfig, load_config, model_folder
from .errors import ConfigError, FormatError, is_int
from .formats.base import detect_format
from .formats.safetensors_io import WeightReader
from .formats.uniform4 import as_uniform4, pad_rows
from .model.linear import QuantLinear
from .model.llama import Model, invalidate_native_stacks


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


# The dtypes the kernels compute in (float64 and integer dtypes fail inside the first op that meets them)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_dtype(dtype) -> None:
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported: use one of "
                          f"{', '.join(map(str, SUPPORTED_DTYPES))} (or None: float16 on CUDA, float32 on CPU)")


def _as_device(device) -> torch.device:
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):   # torch's message lists every backend it knows, not the ones we run on
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}: exl_core runs on 'cpu' or 'cuda' (or 'cuda:N' for GPU N)")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but torch sees no CUDA GPU; use device='cpu'")
    return d


HEAD_KINDS = ("exact", "bf16", "int8")


def lighter_head(head: QuantLinear, kind: str) -> QuantLinear:
    """A dense head stored in fewer bytes, for decode (the head is the largest single read per token).

    exact: unchanged. bf16: w_t rounded to bfloat16 (half the bytes). int8: 8-bit round-to-nearest
    in groups of 32 rows (GPTQ layout, fp16 scales; ~0.3 of the fp32 bytes) through the qmatmul
    kernel. Measured on SmolLM2-135M (38 prompt rows, vs a float64 head): max abs logit error
    fp32 1.5e-5, bf16 0.10, int8 0.22 (rel. Frobenius 3.6e-3, same argmax on every row); logits
    reach 37.6 in magnitude. A head that is already packed is left alone."""
    if kind not in HEAD_KINDS:
        raise ConfigError(f"head={kind!r}: expected one of {', '.join(HEAD_KINDS)}")
    if kind == "exact" or head.is_quantized or head.lora is not None:
        return head
    if kind == "bf16":
        return QuantLinear.from_dense(head.w_t.t().to(torch.bfloat16), head.bias)
    if head.in_features % 32:
        raise ConfigError(f"head='int8' needs hidden_size a multiple of 32 (the kernel's row chunk), got "
                          f"{head.in_features}; use head='bf16'")
    if head.out_features % 4:          # four 8-bit zero points an int32 (GPTQ's packing)
        raise ConfigError(f"head='int8' needs vocab_size a multiple of 4 (the zero points' packing), got "
                          f"{head.out_features}; use head='bf16'")
    from .formats import gptq
    qc = {"bits": 8, "group_size": 32, "checkpoint_format": "gptq_v2"}
    w_t = head.w_t.float().cpu()
    bias = None if head.bias is None else head.bias.float().cpu()
    tensors = gptq.quantize_rtn(w_t, bits=8, group_size=32, checkpoint_format="gptq_v2", bias=bias)
    pw = gptq.read_layer(tensors, head.in_features, head.out_features, "lm_head (int8)", qc)
    return QuantLinear.from_packed(pw.to(head.w_t.device))


ACTIVATION_KINDS = ("exact", "int8")


def _mark_packed(model: Model, key: str, kind: str, kinds: tuple) -> None:
    """Sets packed.meta[key] = kind on every packed layer (the head too, when packed), or removes it
    for "exact"; the qmatmul dispatcher reads it per call. The fused decoder stack copies the choice
    per weight, so its cache is dropped."""
    if kind not in kinds:
        raise ConfigError(f"{key}={kind!r}: expected one of {', '.join(kinds)}")
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.is_quantized:
            if kind == "exact":
                m.packed.meta.pop(key, None)
            else:
                m.packed.meta[key] = kind
    invalidate_native_stacks()


def set_activations(model: Model, kind: str) -> None:
    """kind "int8": every packed layer (the head too, when packed) asks the qmatmul dispatcher for
    the int8-activation kernel, which serves small batches (decode) with x rounded to int8 per 32
    values (exl_core/ops/qmatmul.py); "exact" restores the exact fp32 path."""
    _mark_packed(model, "activations", kind, ACTIVATION_KINDS)


PREFILL_KINDS = ("exact", "bf16")


def set_prefill(model: Model, kind: str) -> None:
    """kind "bf16": every packed layer (the head too, when packed) asks the qmatmul dispatcher for the
    bf16-activation kernel, which serves prompt-sized calls (>= BF16_MIN_M = 9 rows) with x rounded
    to bf16 and the weights exact (AVX512_BF16 CPUs; elsewhere the exact kernel keeps serving);
    "exact" restores the exact fp32 path. Independent of set_activations, which governs the
    decode-sized calls (<= 8 rows): the two row ranges never overlap, and a caller may want one
    lossy path without the other (exact prompt scoring with int8 decode, or the reverse). The rule is
    the row count, not the phase: a decode step batching 9+ sequences, or a speculative verify pass of
    9+ rows, also runs bf16 (and the per-op path instead of the fused decoder stack)."""
    _mark_packed(model, "prefill", kind, PREFILL_KINDS)


def build_model(cfg: ModelConfig, reader: WeightReader, device="cpu", dtype: Optional[torch.dtype] = None,
                progress: bool = False, head: str = "exact", activations: str = "exact",
                prefill: str = "exact") -> Model:
    """head: "exact" (as stored, in `dtype`), "bf16" or "int8" for a dense head; see lighter_head.
    activations: "exact" or "int8" (see set_activations); prefill: "exact" or "bf16" (see set_prefill)."""
    if activations not in ACTIVATION_KINDS:
        raise ConfigError(f"activations={activations!r}: expected one of {', '.join(ACTIVATION_KINDS)}")
    if prefill not in PREFILL_KINDS:
        raise ConfigError(f"prefill={prefill!r}: expected one of {', '.join(PREFILL_KINDS)}")
    device = _as_device(device)
    if activations == "int8" and device.type != "cpu":
        raise ConfigError(f"activations='int8' has CPU kernels only; on {device} the layers would silently "
                          f"stay exact: use activations='exact'")
    if prefill == "bf16" and device.type != "cpu":
        raise ConfigError(f"prefill='bf16' has CPU kernels only; on {device} the layers would silently "
                          f"stay exact: use prefill='exact'")
    _check_dtype(dtype)
    dtype = dtype or default_dtype(device)
    names = reader.names()
    src = str(cfg.path or "model folder")
    fmt = detect_format(cfg.quantization_config, names, f"{src}/config.json" if cfg.path else "config.json")
    check_embedding(cfg, reader)

    check_unused_layers(cfg, names)
    warn_unread_tensors(cfg, names, src)

    def get(name: str, shape: tuple) -> torch.Tensor:
        if not reader.has(name):
            raise FormatError(f"{src}: tensor '{name}' is missing (expected shape {list(shape)} from config.json)")
        reader.check_float(name)
        t = reader.get_checked(name, shape).to(device)
        if has_nonfinite(t):     # else only the first forward's logits would say so, naming no tensor
            raise FormatError(f"{reader.file_of(name)}: tensor '{name}' holds NaN or inf values (a corrupt file?)")
        return t

    def linear(prefix: str, n_in: int, n_out: int, bias: bool) -> QuantLinear:
        packed = fmt is not None and fmt.has_layer(names, prefix)
        stray = check_layer_bias(reader, prefix, bias, src, dense=not packed)
        if packed:
            try:
                pw = fmt.load_layer(reader.get, reader.shape, prefix, n_in, n_out, cfg.quantization_config)
            except (FormatError, ConfigError) as e:   # the formats name the layer; say which folder holds it
                if str(src) in str(e):
                    raise
                raise type(e)(f"{src}: {e}") from e
            if stray:
                pw = dataclasses.replace(pw, bias=None)
            return QuantLinear.from_packed(pw.to(device))
        w = get(f"{prefix}.weight", (n_out, n_in)).to(dtype)
        b = get(f"{prefix}.bias", (n_out,)).to(dtype) if bias else None
        return QuantLinear.from_dense(w, b)

    # A stored head wins over the tie (ExLlamaV2 writes a quantized lm_head for tied models).
    has_head = reader.has("lm_head.weight") or (fmt is not None and fmt.has_layer(names, "lm_head"))
    if has_head:
        head_layer = linear("lm_head", cfg.hidden_size, cfg.vocab_size, False)
    elif cfg.tie_word_embeddings:
        head_layer = QuantLinear.from_dense(get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)).to(dtype))
    else:
        raise FormatError(f"{src}: tensor 'lm_head.weight' is missing and tie_word_embeddings is false")
    head_layer = lighter_head(head_layer, head)

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = lambda it: tqdm(it, desc="loading layers", unit="layer", leave=False)  # noqa: E731
    model = Model.build(cfg, get, linear, head_layer, dtype, progress=bar)
    share_input_perms(model)
    fold_down_perms(model)
    model = model.to(device).eval()
    if torch.device(device).type == "cuda" and os.environ.get("EXL_CORE_EXL2_AS_U4", "1") != "0":
        as_uniform4_weights(model)
    if torch.device(device).type == "cuda" and os.environ.get("EXL_CORE_NORM_BANK_ORDER", "0") == "1":
        order_perms_for_gather(model)
    set_activations(model, activations)
    set_prefill(model, prefill)
    return model


def has_nonfinite(t: torch.Tensor) -> bool:
    """Whether a float tensor holds NaN or inf, at memory speed: 16-bit values by their exponent bits (torch.isfinite
    on CPU half tensors ran at 0.6 GB/s, this at 2.3), wider ones by a float64 sum (NaN / inf propagate; finite
    weights cannot overflow it)."""
    if t.numel() == 0:
        return False
    if t.dtype in (torch.float16, torch.bfloat16):
        bits = t.reshape(-1).view(torch.int16) & 0x7FFF
        return bool(bits.max() >= (0x7C00 if t.dtype == torch.float16 else 0x7F80))
    return not bool(torch.isfinite(t.sum(dtype=torch.float64)))


def check_layer_bias(reader: WeightReader, prefix: str, config_bias: bool, src, dense: bool = False) -> bool:
    """A layer's bias in the file against config.json: missing where the config gives the layer one (a quantized
    layer would silently run without it; a dense one reports it where it is read, with its shape: `dense`), or
    non-zero where the config describes none (the output would differ from HF's model of this config): an error.
    True for a zero bias the config does not describe -- old GPTQ tools wrote them on every projection -- which the
    caller drops (the same function)."""
    in_file = reader.has(f"{prefix}.bias")
    if config_bias and not in_file and not dense:
        raise FormatError(f"{src}: tensor '{prefix}.bias' is missing (config.json gives this layer a bias)")
    stray = not config_bias and in_file
    if stray and bool(reader.get(f"{prefix}.bias").any()):
        raise ConfigError(f"{src}: the file has a non-zero '{prefix}.bias' but config.json describes this layer "
                          f"without a bias (attention_bias / mlp_bias?)")
    return stray


def check_unused_layers(cfg: ModelConfig, names) -> None:
    """Decoder layers in the file past config.json's num_hidden_layers: loading the first n of them would run a
    truncated model (garbage text, no error)."""
    idx = {int(m.group(1)) for m in map(_LAYER_NAME.match, names) if m}
    extra = sorted(i for i in idx if i >= cfg.num_hidden_layers)
    if extra:
        conf = cfg.path / "config.json" if cfg.path is not None else "config.json"
        raise ConfigError(f"{conf}: num_hidden_layers={cfg.num_hidden_layers}, but the weights hold layers up to "
                          f"model.layers.{extra[-1]} ({len(idx)} layers); config.json does not describe these weights")


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
# what a Llama-family model reads (a projection's tensors have format-specific names: weight, qweight, q_scale, ...)
_READ = re.compile(r"model\.(embed_tokens\.weight|norm\.weight|layers\.\d+\.((input|post_attention)_layernorm\.weight|"
                   r"self_attn\.[qkvo]_proj\.\w+|mlp\.(gate|up|down)_proj\.\w+))$|lm_head\.\w+$|"
                   r".*rotary_emb\.inv_freq$")      # old checkpoints' rope table: recomputed


def warn_unread_tensors(cfg: ModelConfig, names, src: str) -> None:
    """Tensors the model never reads, named in a warning (as transformers reports unexpected keys): q_norm /
    k_norm weights, say, belong to another architecture than config.json names, whose output this is not."""
    unread = sorted(n for n in names if not _READ.match(n))
    if unread:
        shown = ", ".join(unread[:5]) + (f" (+{len(unread) - 5} more)" if len(unread) > 5 else "")
        warnings.warn(f"{src}: {len(unread)} tensor(s) are not used by {cfg.architecture}: {shown}; if the model "
                      "needs them, config.json names another architecture", RuntimeWarning, stacklevel=3)


def check_embedding(cfg: ModelConfig, reader: WeightReader) -> None:
    """config.json's vocab_size and hidden_size against the embedding, which every format stores dense: checked
    before any layer is read, since a wrong hidden_size otherwise surfaces as a puzzle about packed rows inside the
    first quantized layer (the head)."""
    name = "model.embed_tokens.weight"
    if not reader.has(name):
        return                          # reported where it is read, with the shape it should have
    have = tuple(reader.shape(name))
    want = (cfg.vocab_size, cfg.hidden_size)
    if have == want:
        return
    bad = [f"{k}={w}" for i, (k, w) in enumerate(zip(("vocab_size", "hidden_size"), want))
           if len(have) != 2 or have[i] != w]
    conf = cfg.path / "config.json" if cfg.path is not None else "config.json"
    raise FormatError(f"{conf}: {' and '.join(bad)} contradict{'s' if len(bad) == 1 else ''} tensor '{name}' of "
                      f"shape {list(have)} in {reader.file_of(name)} (expected [vocab_size, hidden_size] = "
                      f"{list(want)}); config.json does not describe these weights")


def input_groups(model: Model):
    """Each layer's projections that read one input: (q, k, v) and (gate, up)."""
    for block in model.layers:
        a, m = block.self_attn, block.mlp
        yield (a.q_proj, a.k_proj, a.v_proj)
        yield (m.gate_proj, m.up_proj)


def share_input_perms(model: Model) -> None:
    """q/k/v and gate/up read one input; converters order their rows by that input's Hessian, so
    their act-order permutations are usually equal but stored per layer. One shared tensor lets
    qmatmul_many run the group in one call (it requires the same `perm` object)."""
    for group in input_groups(model):
        if not all(isinstance(layer, QuantLinear) and layer.is_quantized for layer in group):
            continue
        first = group[0].packed.perm
        for layer in group[1:]:
            pw = layer.packed
            if first is not None and pw.perm is not None and pw.perm is not first and torch.equal(pw.perm, first):
                layer.set_packed(dataclasses.replace(pw, perm=first))


def as_uniform4_weights(model: Model, max_growth: float = 1.15, formats=("exl2",)) -> int:
    """Rewrites every packed projection that is not uniform 4-bit (EXL2's mixed widths) as uniform 4-bit rows
    (formats.uniform4: exact; 5..8-bit values take a second row) where that grows it by at most max_growth, so the
    GPU runs it on the 4-bit decode kernels instead of the mixed-width ones.  Returns how many it rewrote.
    load_model calls it for CUDA models (EXL_CORE_EXL2_AS_U4=0: not).  H200, 7B-shaped EXL2 4.0 bpw, same call (stop
    30 call 1), with the attention storing o's input in its order: decode 1.1584x / 1.0821x / 1.0752x at batch 1 / 8 /
    32, the 2,048-token prompt 0.9516x (its GEMMs run over the extra rows); a merged LoRA adapter is re-quantized in
    the file's layout and rewritten again (lora_requant.requantize_like)."""
    n = 0
    for _, layer in model.linear_layers():
        # `formats`: the files' formats to rewrite (EXL2's mixed widths; GPTQ 8-bit would also take the rewrite,
        # never measured)
        if type(layer) is QuantLinear and layer.is_quantized and layer.packed.meta.get("format") in formats:
            u = as_uniform4(layer.packed, max_growth)
            if u is not None:
                layer.set_packed(u)
                n += 1
    for group in input_groups(model):          # one row count, so one launch serves each group
        pws = [layer.packed if type(layer) is QuantLinear and layer.is_quantized else None for layer in group]
        if None in pws or any(pw.rows is None for pw in pws):
            continue
        top = max(pw.rows for pw in pws)
        for layer, pw in zip(group, pws):
            layer.set_packed(pad_rows(pw, top))
    share_input_perms(model)                   # equal row layouts give equal permutations: the norm can write them
    if n:
        invalidate_native_stacks()
    return n


# The gather mapping of the GPU's permuted norm (csrc/cuda/pointwise_cuda.cu rms_norm_vec_kernel PERM) that
# order_perms_for_gather orders rows for: formats/gather_order.py gather_classes. EXL_CORE_GATHER_MAPPING names
# another, for an A/B against a build whose kernel uses it (bench/gpu.sh buildab; the orders change no product).
GATHER_MAPPING = "block"


def order_perms_for_gather(model: Model, mapping: Optional[str] = None) -> int:
    """Reorders the rows of each input group (q/k/v, gate/up) that shares one act-order permutation and one 4-bit
    group layout (EXL2's, not GPTQ's: below), inside its groups, so the permuted norm's shared-memory gather meets
    fewer bank conflicts (formats/gather_order.py: a random act-order's ~3.5 wavefronts a gather step to ~2.05 under
    the kernel's mapping; the products are unchanged, their sums may round differently). Returns how many groups it
    reordered. load_model calls it for CUDA models with EXL_CORE_NORM_BANK_ORDER=1: off by default, not yet measured
    on a GPU (stop 61)."""
    from .formats.gather_order import MAPPINGS, bank_order, reorder_rows, segments_and_twins
    mapping = mapping or os.environ.get("EXL_CORE_GATHER_MAPPING", GATHER_MAPPING)
    if mapping not in MAPPINGS:
        raise ConfigError(f"gather mapping {mapping!r} (EXL_CORE_GATHER_MAPPING?) is not one of {MAPPINGS}")
    elem_bytes = torch.finfo(model.dtype).bits // 8
    n = 0
    for group in input_groups(model):
        if not all(type(layer) is QuantLinear and layer.is_quantized for layer in group):
            continue
        pws = [layer.packed for layer in group]
        perm = pws[0].perm
        if perm is None or any(pw.perm is not perm or not torch.equal(pw.groups, pws[0].groups) for pw in pws[1:]):
            continue
        # GPTQ: a LoRA merge re-quantizes through gptq.read_layer, whose perm sorts g_idx back into the stored order
        # (lora_requant.requantize_like), so a merged layer would stop sharing the group's perm
        if any(pw.meta.get("format") == "gptq" for pw in pws):
            continue
        layouts = [segments_and_twins(pw) for pw in pws]
        if layouts[0] is None or any(lay != layouts[0] for lay in layouts[1:]):
            continue
        segs, twins = layouts[0]
        sigma = bank_order(perm, segs, twins, elem_bytes, mapping)
        new_perm = perm[sigma.to(perm.device)].contiguous()
        for layer, pw in zip(group, pws):
            layer.set_packed(reorder_rows(pw, sigma, new_perm))
        n += 1
    if n:
        invalidate_native_stacks()
    return n


def fold_down_perms(model: Model) -> None:
    """Moves each down_proj's act-order permutation into the output columns of gate_proj and up_proj: they then
    compute the intermediate channels in the order down_proj reads them (silu(gate) * up is per channel), and
    down_proj needs no gather of its input.  The MLP's function is unchanged (ExLlamaV2 reorders the same channels
    at load).  The decode kernels then stage x with plain 16-byte copies instead of a gather per block (H200 GEMV
    probe, EXL2-like down projection at one row, the same kernel instance: 16.87 us a layer without a permutation
    against 19.43 with the shared-memory gather), and batch decode drops one gather launch a layer: EXL2 7B-shaped
    decode 1.0456x / 1.0552x / 1.0403x at batch 1 / 8 / 32 (same call, bench/results/gpu_h200_nofold.json).  The layers record the reorder (input_order /
    output_order) for LoRA adapters.  EXL_CORE_FOLD_DOWN_PERM=0 leaves the checkpoint's order (A/B runs)."""
    if os.environ.get("EXL_CORE_FOLD_DOWN_PERM", "1") == "0":
        return
    for block in model.layers:
        m = block.mlp
        down, parts = m.down_proj, (m.gate_proj, m.up_proj)
        if not (type(down) is QuantLinear and down.is_quantized and down.packed.perm is not None and
                all(type(p) is QuantLinear and p.lora is None and p.out_features == down.in_features
                    for p in parts)):
            continue
        perm = down.packed.perm
        m.gate_proj, m.up_proj = (p.with_columns(perm) for p in parts)
        pw = down.packed
        down.set_packed(dataclasses.replace(pw, perm=None, meta=pw.portable_meta()))
        down.input_order = perm.cpu()
    invalidate_native_stacks()


def load_model(path, device="cpu", dtype: Optional[torch.dtype] = None, max_memory=None,
               progress: bool = False, load_tokenizer: bool = True, head: str = "exact",
               activations: str = "exact", prefill: str = "exact"):
    """Loads a model folder. Returns (Model, Tokenizer) (Tokenizer None when load_tokenizer=False).

    `head`: "exact" keeps a dense output layer as stored; "bf16" / "int8" store it in fewer
    bytes for faster decode at a stated logit error (see lighter_head).

    `activations`: "exact" (default) multiplies in fp32; "int8" lets decode-sized batches of
    quantized layers run with activations rounded to int8 per 32 values (see set_activations).

    `prefill`: "exact" (default) multiplies in fp32; "bf16" lets prompt-sized batches (>= 9 rows)
    of quantized layers run with activations rounded to bf16 on AVX512_BF16 CPUs (see set_prefill;
    ~1e-3 relative error per matmul, measured cost in bench/results/cpu_prompt_bf16_ppl.json).

    `max_memory` is accepted for API compatibility (bytes the weights may take); exceeding
    it raises instead of swapping.
    """
    # arguments first: a bad one should not cost reading the weights
    if max_memory is not None and (not is_int(max_memory) or max_memory <= 0):
        raise ConfigError(f"load_model: max_memory={max_memory!r} must be a number of bytes (an int > 0, "
                          "e.g. 10 * 2**30 for 10 GiB) or None")
    _as_device(device)
    _check_dtype(dtype)
    p = model_folder(path)                  # None, a file or a missing path: named as such
    cfg = load_config(p)
    reader = WeightReader(p)
    model = build_model(cfg, reader, device=device, dtype=dtype, progress=progress, head=head,
                        activations=activations, prefill=prefill)
    if max_memory is not None:
        used = sum(b.numel() * b.element_size() for b in model.buffers())
        if used > max_memory:
            raise ConfigError(f"{p}: weights need {used / 2**30:.2f} GiB, more than max_memory="
                              f"{max_memory / 2**30:.2f} GiB")
    tokenizer = None
    if load_tokenizer:
        from .tokenizer import Tokenizer
        tokenizer = Tokenizer.from_folder(p)
    return model, tokenizer
