"""y = x @ W (+ bias) for a quantized W in the kernel-native `PackedWeight` layout.

Candidates, in priority order (see `ops/dispatch.py`):
  cuda       -- inserted first by ops/cuda_candidates.py (GEMV / mma / dequant+cuBLAS by rows).
  cpu_int8   -- `exl_core::qmatmul_int8` (csrc/cpu/qmatmul_int8*.cpp), opt-in per weight
                (`pw.meta["activations"] == "int8"`, set by load_model(activations="int8")) and
                only for M <= INT8_MAX_M rows (decode): x quantized to int8 per 32-row chunk,
                integer dot products (AVX-512 VNNI / AVX2 / scalar, bit-identical). Not exact:
                x is replaced by its int8 rounding.
  cpu_bf16   -- `exl_core::qmatmul_bf16` (csrc/cpu/qmatmul_bf16*.cpp), opt-in per weight
                (`pw.meta["prefill"] == "bf16"`, set by load_model(prefill="bf16")) and only for
                M >= BF16_MIN_M rows (prompts): x rounded to bf16, raw q exact, products summed
                in fp32 by AVX512_BF16 `vdpbf16ps`; refused where the CPU lacks it (the exact
                kernel serves). Contract: the exact product of x rounded to bf16 (nearest even),
                i.e. torch_ref(x.bfloat16(), pw) up to fp32 summation order. Not exact: ~1e-3
                relative error from the rounding of x. Batch invariant among such calls.
  cpu_fused  -- `exl_core::qmatmul` C++ op (csrc/cpu/qmatmul*.cpp): fused dequantise + matmul,
                AVX-512 / AVX2 / scalar picked at run time. Batch invariant: row i of the
                result is bit-identical whatever the number of rows and their order.
  torch_ref  -- pure torch: unpack the bit streams, dequantise to fp32, matmul. Any device;
                NOT batch invariant (torch.mm blocks differently for different M).

`qmatmul_many(x, [pw, ...])` (q/k/v, gate/up) has its own dispatcher: `cpu_fused_multi`
(`exl_core::qmatmul_multi`, one kernel call, bit-identical to one qmatmul per weight) when the
weights share x's permutation, else `each` (one qmatmul per weight, any device); `cpu_int8_multi`
and `cpu_bf16_multi` go first on the same terms as cpu_int8 / cpu_bf16 (x rounded once for all
weights).

`qmatmul_silu(gate, up, pw)` (the MLP's down projection) is qmatmul(silu_mul(gate, up), pw): `each` runs the two
ops; the `cuda` candidate fuses the product into the batch-1 decode kernel's staging of x.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import InputError
from ..formats.bitpack import unpack_stream
from ..formats.packed import PackedWeight, scatter_rows
from .dispatch import Candidate, Dispatcher, has_op
from .input_grad import records_grad, with_input_grad

# ---------------------------------------------------------------------------- torch reference


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [K, N] in the original (unpermuted) row order, on pw's device, computed in torch.

    Same formula as the kernel, w = (q - zero) * scale, but not bit-matched to it; the float64
    specification stays `exl_core.formats.packed.dequantize_reference`."""
    dev = pw.qweight.device
    w_perm = torch.empty(pw.k_rows, pw.out_features, dtype=dtype, device=dev)
    for gi, (bits, k_start, k_len, q_start) in enumerate(pw.groups.tolist()):
        q = unpack_stream(pw.qweight[q_start:q_start + k_len * bits // 32], bits, k_len)
        w_perm[k_start:k_start + k_len] = ((q.to(dtype) - pw.zero[gi].to(dtype)) * pw.scale[gi].to(dtype))
    return scatter_rows(pw, w_perm)      # x[:, perm] @ W_perm == x @ W


def _run_torch_ref(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    w = dequantize(pw, torch.float32)                                # [K, N]
    y = x.reshape(-1, pw.in_features).to(torch.float32) @ w
    if pw.bias is not None:
        y = y + pw.bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], pw.out_features)


def _check_torch_ref(x: torch.Tensor, pw: PackedWeight) -> Optional[str]:
    if not x.is_floating_point():
        return f"x must be floating point, got {x.dtype}"
    return None


# ---------------------------------------------------------------------------- C++ kernels

_OP_DTYPES = (torch.float32, torch.bfloat16)
_VIA_FP32 = (torch.float16,)   # served by the kernel through an fp32 copy of x (exact widening)


def _prep_x(x: torch.Tensor, K: int) -> torch.Tensor:
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    if x2.dtype in _VIA_FP32:
        x2 = x2.to(torch.float32)
    return x2 if x2.is_contiguous() else x2.contiguous()


def _as_x(y: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """Kernel output [M, n] back to x's leading shape and dtype (free for 2-D x of a kernel dtype:
    decode makes ~120 of these calls per token, each microsecond counts)."""
    if x.dim() == 2 and y.dtype == x.dtype:
        return y
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def rows_reason(pw: PackedWeight) -> Optional[str]:
    """The CPU kernels take W_perm with K rows: a weight with more (formats.uniform4) runs the torch reference."""
    return None if pw.rows is None else f"{pw.rows} rows for {pw.in_features} inputs (formats.uniform4)"


def _check_cpu_fused(x: torch.Tensor, pw: PackedWeight) -> Optional[str]:
    if not has_op("qmatmul"):
        return "extension exl_core._C not built or has no qmatmul kernel"
    if (why := rows_reason(pw)) is not None:
        return why
    if x.device.type != "cpu" or pw.qweight.device.type != "cpu":
        return f"tensors not on CPU (x on {x.device}, qweight on {pw.qweight.device})"
    if x.dtype not in _OP_DTYPES and x.dtype not in _VIA_FP32:
        return f"x dtype {x.dtype} not supported (float32, bfloat16, float16)"
    if pw.scale.dtype != torch.float32 or pw.zero.dtype != torch.float32:
        return f"scale/zero must be float32, got {pw.scale.dtype}/{pw.zero.dtype}"
    return None


def _run_cpu_fused(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    y = torch.ops.exl_core.qmatmul(_prep_x(x, pw.in_features), pw.qweight, pw.groups, pw.scale, pw.zero,
                                   pw.perm, pw.bias)
    return _as_x(y, x, pw.out_features)


# ---------------------------------------------------------------------------- int8 activations

INT8_MAX_M = 8   # rows per call up to which the int8 path serves (decode-sized); larger calls stay exact


def wants_int8(pw: PackedWeight) -> bool:
    return pw.meta.get("activations") == "int8"


def _rows(x: torch.Tensor, K: int) -> int:
    return x.numel() // K if K else 0


def _check_cpu_int8(x: torch.Tensor, pw: PackedWeight) -> Optional[str]:
    if not wants_int8(pw):
        return "int8 activations not requested for this weight (load_model(..., activations='int8'))"
    if not has_op("qmatmul_int8"):
        return "extension exl_core._C not built with exl_core::qmatmul_int8"
    if (why := rows_reason(pw)) is not None:
        return why
    m = _rows(x, pw.in_features)
    if m > INT8_MAX_M:
        return f"{m} rows > {INT8_MAX_M}: large batches (prefill) keep the exact fp32 kernel"
    return _check_cpu_fused(x, pw)


def int8_zero(pw: PackedWeight) -> torch.Tensor:
    """The zero points the int8 kernel reads: [G], one per group, when every column of each group
    shares it (EXL2 always, symmetric GPTQ, the int8 head), else pw.zero [G, N]. The same values,
    so the same results, from a sixth fewer bytes per decode step at EXL2's 32-row groups (SmolLM2
    EXL2 int8 decode, two models in one process, best of 6 interleaved: 135.5 -> 144.0 and
    137.6 -> 145.8 tok/s). Cached on the weight for this very zero tensor at its in-place version
    (tensors made under inference_mode have none: edit those in place and the cache cannot tell)."""
    z = pw.zero
    version = None if z.is_inference() else z._version
    held = pw.__dict__.get("_int8_zero")
    if held is None or held[0] is not z or held[1] != version:
        per_group = z.dim() == 2 and z.shape[1] > 0 and bool((z == z[:, :1]).all())
        held = (z, version, z[:, 0].contiguous() if per_group else z)
        pw.__dict__["_int8_zero"] = held
    return held[2]


def _run_cpu_int8(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    y = torch.ops.exl_core.qmatmul_int8(_prep_x(x, pw.in_features), pw.qweight, pw.groups, pw.scale, int8_zero(pw),
                                        pw.perm, pw.bias)
    return _as_x(y, x, pw.out_features)


# ---------------------------------------------------------------------------- bf16 activations (prefill)

BF16_MIN_M = INT8_MAX_M + 1   # rows per call from which the bf16 path serves (prompts); the dispatch keys
                              # read one `rows <= INT8_MAX_M` flag for both switches


def wants_bf16(pw: PackedWeight) -> bool:
    return pw.meta.get("prefill") == "bf16"


def _bf16_ok() -> bool:
    # asked per call (cheap, one C++ call): tests cap the ISA at run time
    return has_op("qmatmul_bf16") and torch.ops.exl_core.qmatmul_bf16_supported()


def _check_cpu_bf16(x: torch.Tensor, pw: PackedWeight) -> Optional[str]:
    if not wants_bf16(pw):
        return "bf16 prefill not requested for this weight (load_model(..., prefill='bf16'))"
    if not has_op("qmatmul_bf16"):
        return "extension exl_core._C not built with exl_core::qmatmul_bf16"
    if (why := rows_reason(pw)) is not None:
        return why
    if not torch.ops.exl_core.qmatmul_bf16_supported():
        return "CPU lacks AVX512_BF16 (vdpbf16ps) or the ISA cap hides AVX-512"
    m = _rows(x, pw.in_features)
    if m < BF16_MIN_M:
        return f"{m} rows < {BF16_MIN_M}: decode-sized calls keep their kernels"
    return _check_cpu_fused(x, pw)


def _run_cpu_bf16(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    y = torch.ops.exl_core.qmatmul_bf16(_prep_x(x, pw.in_features), pw.qweight, pw.groups, pw.scale, pw.zero,
                                        pw.perm, pw.bias)
    return _as_x(y, x, pw.out_features)


def _key(x: torch.Tensor, pw: PackedWeight):
    # everything the checks above read (has_op / extension() are fixed once imported; the bf16 support
    # query only where cpu_bf16 could serve, so decode-sized calls pay nothing for it)
    small = _rows(x, pw.in_features) <= INT8_MAX_M
    return (x.device, x.dtype, pw.qweight.device, pw.scale.dtype, pw.zero.dtype, wants_int8(pw),
            wants_bf16(pw) and not small and _bf16_ok(), small, pw.rows is None)


DISPATCH = Dispatcher("qmatmul", [
    Candidate("cpu_int8", _check_cpu_int8, _run_cpu_int8),
    Candidate("cpu_bf16", _check_cpu_bf16, _run_cpu_bf16),
    Candidate("cpu_fused", _check_cpu_fused, _run_cpu_fused),
    Candidate("torch_ref", _check_torch_ref, _run_torch_ref),
], key=_key)


def qmatmul(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x [..., K] (float32/bfloat16/float16 for the CPU kernel; any float for the reference) -> [..., N]
    in x's dtype, accumulated in fp32: x @ dequantize(pw) + pw.bias."""
    if x.dim() < 1 or x.shape[-1] != pw.in_features:
        raise InputError(f"qmatmul: x has shape {tuple(x.shape)}, last dim must be in_features="
                         f"{pw.in_features} of the packed weight")
    if records_grad(x):            # adapter training over a frozen quantized weight (ops/input_grad.py)
        return with_input_grad(x, lambda t: DISPATCH(x=t, pw=pw), lambda: dequantize(pw, torch.float32))
    return DISPATCH(x=x, pw=pw)


# ---------------------------------------------------------------------------- several weights, one x
# q/k/v (and gate/up) read the same x: one call computes all of them, so the input is permuted
# and summed once and the threads fork once (decode makes ~200 such calls per token).

def _check_multi(op: str, check_one, x: torch.Tensor, pws: list[PackedWeight]) -> Optional[str]:
    """One call of `op` serves these weights: each passes `check_one`, and they share x's permutation."""
    if not has_op(op):
        return f"extension exl_core._C not built with exl_core::{op}"
    for i, pw in enumerate(pws):
        why = check_one(x, pw)
        if why is not None:
            return f"weight {i}: {why}"
    if any(pw.perm is not pws[0].perm for pw in pws):
        return "weights have different input permutations (the op permutes x once)"
    return None


def _run_multi(op, x: torch.Tensor, pws: list[PackedWeight], zero=lambda pw: pw.zero) -> list[torch.Tensor]:
    ys = op(_prep_x(x, pws[0].in_features), [pw.qweight for pw in pws], [pw.groups for pw in pws],
            [pw.scale for pw in pws], [zero(pw) for pw in pws], pws[0].perm, [pw.bias for pw in pws])
    return [_as_x(y, x, pw.out_features) for y, pw in zip(ys, pws)]


def _check_multi_cpu(x, pws):
    return _check_multi("qmatmul_multi", _check_cpu_fused, x, pws)


def _run_multi_cpu(x, pws):
    return _run_multi(torch.ops.exl_core.qmatmul_multi, x, pws)


def _check_multi_int8(x, pws):
    return _check_multi("qmatmul_int8_multi", _check_cpu_int8, x, pws)


def _run_multi_int8(x, pws):
    return _run_multi(torch.ops.exl_core.qmatmul_int8_multi, x, pws, int8_zero)


def _check_multi_bf16(x, pws):
    return _check_multi("qmatmul_bf16_multi", _check_cpu_bf16, x, pws)


def _run_multi_bf16(x, pws):
    return _run_multi(torch.ops.exl_core.qmatmul_bf16_multi, x, pws)


def _key_multi(x: torch.Tensor, pws: list[PackedWeight]):
    # everything the checks read: _check_multi_cpu's, and cuda_candidates' (its one-launch kernel
    # also needs N % 4 == 0 and 16-byte aligned buffers); the "each" fallback re-dispatches per weight
    return (x.device, x.dtype,
            tuple((pw.qweight.device, pw.scale.dtype, pw.zero.dtype, pw.out_features % 4,
                   (pw.qweight.data_ptr() | pw.scale.data_ptr() | pw.zero.data_ptr()) % 16) for pw in pws),
            all(pw.perm is pws[0].perm for pw in pws),
            tuple(wants_int8(pw) for pw in pws), tuple(wants_bf16(pw) for pw in pws),
            tuple(pw.k_rows - pw.in_features for pw in pws),
            _rows(x, pws[0].in_features) > INT8_MAX_M and any(map(wants_bf16, pws)) and _bf16_ok(),
            _rows(x, pws[0].in_features) <= INT8_MAX_M)


DISPATCH_MANY = Dispatcher("qmatmul_many", [
    Candidate("cpu_int8_multi", _check_multi_int8, _run_multi_int8),
    Candidate("cpu_bf16_multi", _check_multi_bf16, _run_multi_bf16),
    Candidate("cpu_fused_multi", _check_multi_cpu, _run_multi_cpu),
    Candidate("each", lambda x, pws: None, lambda x, pws: [qmatmul(x, pw) for pw in pws]),
], key=_key_multi)


def qmatmul_many(x: torch.Tensor, pws: list[PackedWeight]) -> list[torch.Tensor]:
    """[qmatmul(x, pw) for pw in pws], bit-identical to it on the CPU kernel, in one kernel call
    where the weights allow (same input permutation)."""
    pws = list(pws)
    if not pws:
        raise InputError("qmatmul_many: no weights given")
    for i, pw in enumerate(pws):
        if x.dim() < 1 or x.shape[-1] != pw.in_features:
            raise InputError(f"qmatmul_many: x has shape {tuple(x.shape)}, weight {i} has in_features="
                             f"{pw.in_features}")
    return DISPATCH_MANY(x=x, pws=pws)


# ---------------------------------------------------------------------------- SwiGLU's down projection
# qmatmul(silu_mul(gate, up), pw): the `cuda` candidate (ops/cuda_candidates.py) computes the product while the
# batch-1 decode kernel stages x, one launch instead of two; everywhere else the two ops run in turn.

def _run_silu_each(gate: torch.Tensor, up: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    from .activation import silu_mul
    return qmatmul(silu_mul(gate, up), pw)


DISPATCH_SILU = Dispatcher("qmatmul_silu", [
    Candidate("each", lambda gate, up, pw: None, _run_silu_each),
], key=lambda gate, up, pw: (gate.device, gate.dtype, up.device, up.dtype, pw.qweight.device, pw.scale.dtype,
                             pw.zero.dtype))


def qmatmul_silu(gate: torch.Tensor, up: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """qmatmul(silu_mul(gate, up), pw) (the MLP's down projection), the same values as the two calls."""
    if gate.shape != up.shape:
        raise InputError(f"qmatmul_silu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.dim() < 1 or gate.shape[-1] != pw.in_features:
        raise InputError(f"qmatmul_silu: gate has shape {tuple(gate.shape)}, last dim must be in_features="
                         f"{pw.in_features} of the packed weight")
    return DISPATCH_SILU(gate=gate, up=up, pw=pw)


# ---------------------------------------------------------------------------- into the residual stream
# residual += qmatmul(x, pw) (o and down): the `cuda` candidate (ops/cuda_candidates.py) does it in the GEMM of the
# dequantise + cuBLAS path (beta = 1, in place), where the prompt's rows go; everywhere else nothing is done and
# the caller adds (the RMSNorm that follows takes the residual: one pass, not two).

def _key_add(residual, x, pw):
    # everything cuda_candidates' _add_check and _qmatmul_check read; the candidates' row rules change only at
    # or below 64 rows (decode kernels take up to 32), so longer calls share one entry
    rows = x.numel() // max(1, pw.in_features)
    return (x.device, x.dtype, residual.device, residual.dtype, residual.is_contiguous(),
            tuple(residual.shape) == (rows, pw.out_features), rows if rows <= 64 else -1, pw.in_features,
            pw.qweight.device, pw.scale.dtype, pw.zero.dtype, pw.bias is None)


DISPATCH_ADD = Dispatcher("qmatmul_add_", [
    Candidate("none", lambda residual, x, pw: None, lambda residual, x, pw: False),
], key=_key_add)


def adds_in_place(residual: torch.Tensor, x: torch.Tensor, pw: PackedWeight) -> bool:
    """Whether qmatmul_add_(residual, x, pw) would do the add (x: any tensor of its device, dtype and shape)."""
    return DISPATCH_ADD.choose(residual=residual, x=x, pw=pw).name != "none"


def qmatmul_add_(residual: torch.Tensor, x: torch.Tensor, pw: PackedWeight) -> bool:
    """residual += qmatmul(x, pw) in place where one kernel call does it; returns whether it did (False: nothing
    done, the caller adds qmatmul(x, pw) its own way)."""
    return DISPATCH_ADD(residual=residual, x=x, pw=pw)


# ---------------------------------------------------------------------------- fake (meta) impl

def _register_fake() -> None:
    if not has_op("qmatmul") or getattr(_register_fake, "done", False):
        return
    _register_fake.done = True

    # every quantized matmul op has the same signature: one weight -> [M, N], a list -> one per weight;
    # the int8 ops also take panel-major words [N/32, Q, 32]
    def cols(q):
        return q.shape[0] * 32 if q.dim() == 3 else q.shape[1]

    def single(name):
        def fake(x, qweight, groups, scale, zero, perm, bias):
            torch._check(x.dim() == 2, lambda: f"{name}: x must be 2-D")
            torch._check(qweight.dim() == 2 or (name.startswith("qmatmul_int8") and qweight.dim() == 3),
                         lambda: f"{name}: qweight must be 2-D")
            return x.new_empty((x.shape[0], cols(qweight)))
        return fake

    def multi(name):
        def fake(x, qweight, groups, scale, zero, perm, bias):
            torch._check(x.dim() == 2, lambda: f"{name}: x must be 2-D")
            return [x.new_empty((x.shape[0], cols(q))) for q in qweight]
        return fake

    for op in ("qmatmul", "qmatmul_int8", "qmatmul_bf16"):
        if has_op(op):
            torch.library.register_fake(f"exl_core::{op}")(single(op))
        if has_op(f"{op}_multi"):
            torch.library.register_fake(f"exl_core::{op}_multi")(multi(f"{op}_multi"))


_register_fake()
