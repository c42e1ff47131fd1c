"""Re-quantisation of a merged LoRA update into a packed layer's own format (LoraAdapter.merge, model/lora.py):
the updated weight goes back into the layer's layout -- EXL2's groups, rows and permutation, GPTQ's bits, group size,
symmetry and checkpoint format -- keeping the layer's own grid where it fits better than fresh scales."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..errors import LoraError
from ..formats.packed import PackedWeight


# -- re-quantisation for merges -----------------------------------------------------------------
# Plain round-to-nearest derives each group's scale from the group's range, and the writers round that scale UP
# (gptq/exl2.quantize_rtn: no clipping) -- so it is not idempotent: values already on a grid whose extreme code is
# used (GPTQ's -2^(b-1) step, EXL2's group max) come back on a coarser grid (GPTQ 4-bit: 16/15 the step), and a
# checkpoint's own grid (GPTQ's or EXL2's converter: clipped, Hessian-chosen) is never re-derived at all.  So a merge
# quantizes the updated weight twice: onto the layer's own grid (its scales and zeros, codes re-rounded) and with
# fresh RTN scales, and keeps, per scale unit, whichever has the smaller squared error -- the own grid on a tie.  A
# weight still on its grid then keeps its exact codes, scales and zeros (idempotent); a small delta keeps the
# checkpoint's grid where it still fits; a large one takes fresh scales where they fit better; the merge error is
# never above plain RTN's.  The unit is a (group, column) for GPTQ, whose scale and zero are stored per group and
# column; a whole group for EXL2, whose column scales are 4-bit codes times one fp16 maximum a group (so the result
# stays writable in the layer's own format).


def _own_grid_of_uniform4(pw: PackedWeight) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(scale, zero) [G, N] in the file's layout (meta uniform4_groups) of a weight formats.uniform4.as_uniform4
    rewrote: main group g keeps the file's scale, and its zero for 2..4 bits; a 5..8-bit group's main row has zero 8
    and its zero z is in its extra group's (z - 8) / 16.  None where the layout is not as as_uniform4 writes it."""
    from ..formats.uniform4 import extra_group_pairs
    orig = pw.meta["uniform4_groups"]
    pairs = extra_group_pairs(pw)
    n = len(orig)
    if pairs is None or pw.scale.shape[0] < n:
        return None
    scale, zero = pw.scale[:n].clone(), pw.zero[:n].clone()
    for g, e in pairs:
        if not (torch.equal(pw.scale[e], pw.scale[g] * 16) and bool((pw.zero[g] == 8).all())):
            return None
        zero[g] = pw.zero[e] * 16 + 8
    return scale, zero


def _keep_own_grid(new: PackedWeight, old: PackedWeight, w: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor],
                   per_column: bool, name: str) -> PackedWeight:
    """`new` (fresh RTN of w [K, N] float64 CPU, in `old`'s groups) with every unit (see above) whose own-grid
    rounding (grid: `old`'s scale, zero [G, N]) is no worse taken from the own grid instead."""
    from ..formats.bitpack import pack_stream, unpack_stream
    K, N = new.in_features, new.out_features
    g_scale, g_zero = (t.detach().to("cpu", new.scale.dtype) for t in grid)
    if not torch.equal(new.groups, old.groups) or tuple(g_scale.shape) != tuple(new.scale.shape):
        return new
    p_new = new.perm.cpu() if new.perm is not None else torch.arange(K)
    p_old = old.perm.cpu()[:K] if old.perm is not None else torch.arange(K)
    groups = new.groups.tolist()
    for _b, k0, kl, _q in groups:        # the own grid's group g must cover the same input rows as the new one's
        if not torch.equal(p_new[k0:k0 + kl].sort().values, p_old[k0:k0 + kl].sort().values):
            return new
    w_perm = w[p_new]
    q_parts, scale, zero = [], new.scale.clone(), new.zero.clone()
    for gi, (bits, k0, kl, q0) in enumerate(groups):
        x = w_perm[k0:k0 + kl]
        maxq = 2 ** bits - 1
        qn = unpack_stream(new.qweight[q0:q0 + kl * bits // 32].cpu(), bits, kl).to(torch.float64)
        sn, zn = new.scale[gi].cpu().double(), new.zero[gi].cpu().double()
        so, zo = g_scale[gi].double(), g_zero[gi].double()
        # a zero scale decodes every code to 0: any code will do (the zero point's, as a writer would store it)
        qo = torch.where(so == 0, torch.round(zo).expand_as(x), torch.round(x / torch.where(so == 0, 1.0, so) + zo))
        qo = qo.clamp(0, maxq)
        err_o = ((qo - zo) * so - x).pow(2).sum(0)                    # (N,)
        err_n = ((qn - zn) * sn - x).pow(2).sum(0)
        keep = err_o <= err_n if per_column else (err_o.sum() <= err_n.sum()).expand(N)
        q_parts.append(pack_stream(torch.where(keep, qo, qn).to(torch.int64), bits))
        scale[gi] = torch.where(keep, g_scale[gi], scale[gi])
        zero[gi] = torch.where(keep, g_zero[gi], zero[gi])
    return dataclasses.replace(new, qweight=torch.cat(q_parts).contiguous(), scale=scale.contiguous(),
                               zero=zero.contiguous()).validate(name)


def requantize_like(pw: PackedWeight, w: torch.Tensor, name: str = "layer") -> PackedWeight:
    """W (in, out) float -> a PackedWeight with `pw`'s format, bit widths, groups and input
    order: round-to-nearest (EXL2 and GPTQ through their own writers/readers), keeping pw's own
    scales and zeros wherever they fit W at least as well (see the note above): W already on
    pw's grid gives pw's codes, scales and zeros back."""
    if "uniform4_groups" in pw.meta:
        # rewritten as uniform 4-bit rows at load (loader.as_uniform4_weights): quantized in the file's own layout
        # (its groups, widths, order and grid), then rewritten again
        from ..formats.uniform4 import as_uniform4, pad_rows
        K = pw.in_features
        meta = {k: v for k, v in pw.meta.items() if not k.startswith("uniform4_")}
        grid = _own_grid_of_uniform4(pw)
        src = dataclasses.replace(pw, groups=torch.tensor(pw.meta["uniform4_groups"], dtype=torch.int32),
                                  perm=None if pw.perm is None else pw.perm[:K], meta=meta, rows=None,
                                  **({} if grid is None else {"scale": grid[0], "zero": grid[1]}))
        new = _requantize(src, w, name, grid)
        u = as_uniform4(new, max_growth=float("inf")) or new
        return pad_rows(u, pw.rows) if pw.rows is not None and u.rows is not None and u.rows < pw.rows else u
    return _requantize(pw, w, name, (pw.scale, pw.zero))


def _requantize(pw: PackedWeight, w: torch.Tensor, name: str,
                grid: Optional[tuple[torch.Tensor, torch.Tensor]]) -> PackedWeight:
    """requantize_like in pw's file layout (pw's groups, perm, bias, meta; its qweight/scale/zero unused): fresh RTN,
    then the own grid `grid` (scale, zero [G, N]; None: not known) where it fits no worse."""
    from ..formats import exl2, gptq
    if pw.rows is not None:
        raise LoraError(f"{name}: a weight with extra rows from an unknown source cannot be re-quantized for a merge")
    K, N = pw.in_features, pw.out_features
    groups = [tuple(g) for g in pw.groups.tolist()]           # (bits, k_start, k_len, qrow)
    fmt = pw.meta.get("format")
    dev = pw.qweight.device
    w = w.detach().to("cpu", torch.float64)
    bias = pw.bias.cpu() if pw.bias is not None else None
    perm = pw.perm.cpu() if pw.perm is not None else None
    if fmt == "exl2":
        # one segment per stored group: every group keeps its width and its rows
        gsz = max(-(-k_len // 32) * 32 for _, _, k_len, _ in groups)
        tensors = exl2.quantize_rtn(w, bits=[(b, k_len) for b, _, k_len, _ in groups], group_size=gsz,
                                    perm=perm, bias=bias)
        new = exl2.read_layer(tensors, K, N, name)
    elif fmt == "gptq":
        bits = groups[0][0]
        gs = groups[0][2] if len(groups) > 1 else -1
        two = torch.tensor(2.0 ** (bits - 1))
        sym = bool(torch.all(pw.zero == two))
        ckpt = pw.meta.get("checkpoint_format", "gptq")
        tensors = gptq.quantize_rtn(w, bits=bits, group_size=gs, sym=sym, perm=perm, checkpoint_format=ckpt,
                                    bias=bias)
        new = gptq.read_layer(tensors, K, N, name, {"bits": bits, "checkpoint_format": ckpt})
    else:
        raise LoraError(f"{name}: cannot re-quantize a packed weight of unknown format {fmt!r} for a merge; "
                        "use the adapter on the fly instead")
    if grid is not None:
        new = _keep_own_grid(new, pw, w, grid, per_column=fmt == "gptq", name=name)
    # the layer's own bias (a merge does not change it; the writers above store it in fp16)
    new = dataclasses.replace(new, bias=bias)
    return new.to(dev) if dev.type != "cpu" else new
