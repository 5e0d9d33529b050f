"""GPTQ (Frantar et al., 2022): weight quantization that compensates each column's rounding error on the columns
not yet quantized, weighted by the inverse Hessian ``H = 2 X^T X / N`` of the layer's calibration inputs.

Output conventions are those of :mod:`dsconv.quant.algorithms.schemes` (symmetric, ``q int8 [n, k]``,
``scale``/``offset`` float32 ``[n, 1]`` or ``[n, k / group]``, offsets zeros), so the caller can swap RTN and GPTQ
per layer. The linear
algebra runs in torch float32 (a Cholesky and rank-1 updates, where torch is the faster library).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dsconv.errors import UserError
from dsconv.quant.algorithms.grid import search_scales
from dsconv.quant.algorithms.scale_grid import choose_scales
from dsconv.quant.algorithms.schemes import is_torch, check_group_size, qrange, to_float32


def _as_torch_f32(x: Any) -> torch.Tensor:
    """A float32 CPU tensor that owns its memory (GPTQ updates it in place: never alias the caller's array)."""
    if is_torch(x):
        return x.detach().to("cpu", torch.float32, copy=True)
    return torch.from_numpy(np.array(to_float32(x), dtype=np.float32, copy=True))


def _rtn_scale(w3: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Round-to-nearest's scales of ``w3 [n, groups, g]`` (``[n, groups]``): the engines' grid value next to
    max|w| / qmax with each group's smallest rounding error, as schemes.quantize_weight_per_group chooses them."""
    return torch.from_numpy(choose_scales(w3, qmin, qmax)[1][..., 0])


def _tri_inv_lower(M: torch.Tensor) -> torch.Tensor:
    """Inverse of a lower-triangular matrix by 2x2 blocks, inv([[A, 0], [C, D]]) = [[A^-1, 0], [-D^-1 C A^-1,
    D^-1]]: k^3/3 flops in matrix products (torch exposes no trtri; a triangular solve against I is 5x slower)."""
    n = M.shape[0]
    if n <= 512:
        return torch.linalg.solve_triangular(M, torch.eye(n, dtype=M.dtype), upper=False)
    h = n // 2
    a_inv, d_inv = _tri_inv_lower(M[:h, :h]), _tri_inv_lower(M[h:, h:])
    out = torch.zeros_like(M)
    out[:h, :h], out[h:, h:] = a_inv, d_inv
    out[h:, :h] = -(d_inv @ (M[h:, :h] @ a_inv))
    return out


def _inverse_cholesky(H: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 (U^T U = H^-1), retrying with 10x the damping
    if the dampened H is numerically not positive definite (few, nearly collinear calibration tokens).

    With J the exchange matrix and J H J = M M^T (M lower), U = J M^-1 J: one Cholesky and one triangular
    inverse, about half the time of the reference's Cholesky, cholesky_inverse, Cholesky, and as accurate."""
    k = H.shape[0]
    mean_diag = float(torch.diagonal(H).mean())
    eye = torch.eye(k, dtype=H.dtype)
    for attempt in range(4):
        M, info = torch.linalg.cholesky_ex((H + (damp * 10**attempt) * mean_diag * eye).flip(0, 1))
        if int(info) == 0:
            U = _tri_inv_lower(M).flip(0, 1).contiguous()  # row-major: the sweep reads rows of U
            if bool(torch.isfinite(U).all()):
                return U
    raise UserError(
        f"layer {name}: GPTQ Hessian is not positive definite even with damping {damp * 1000:g}",
        hint="calibrate with more tokens, raise the GPTQ damping, or use round-to-nearest for this layer",
    )


def gptq_quantize(
    w: Any,
    H: Any,
    bits: int = 4,
    group_size: int = 0,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    name: str = "weight",
    search: bool = False,
    static_groups: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``w [n, k]`` with GPTQ given the Hessian ``H [k, k]`` of its inputs.

    Returns ``(q int8 [n, k], scale float32, offset float32 zeros)`` shaped like
    :func:`dsconv.quant.algorithms.schemes.quantize_weight_per_group` (``[n, 1]`` when ``group_size`` is 0).

    * Per channel: scales come from the original weight, as in the reference implementation.
    * Groups: a group's scale is computed from the error-updated weight when the sweep enters the group; with
      ``act_order`` the columns are visited by decreasing Hessian diagonal, so groups are no longer visited as
      contiguous runs and their scales are fixed up front from the original weight ("static groups"), which keeps
      the contiguous-group layout the format needs (no g_idx); ``static_groups`` does the same without act order.
    * ``search``: every scale (per channel, static or on group entry) is the clip ratio of
      :mod:`dsconv.quant.algorithms.grid` that minimises the group's rounding error weighted by the Hessian diagonal,
      instead of max |w| / qmax.
    * Dead columns (``H[j, j] == 0``: the input channel was always zero in calibration) are not zeroed: they are
      rounded to nearest and, being decoupled in H, pass no error on. Weights stay usable for inputs calibration
      never produced (an expert that saw few tokens); an all-zero H is plain round-to-nearest.
    """
    W = _as_torch_f32(w)
    if W.dim() != 2:
        raise UserError(f"layer {name}: expected a 2-D weight, got shape {list(W.shape)}")
    n, k = W.shape
    check_group_size(k, group_size, name)
    qmin, qmax = qrange(bits)
    Hm = _as_torch_f32(H)
    if tuple(Hm.shape) != (k, k):
        raise UserError(f"layer {name}: Hessian shape {list(Hm.shape)} does not match input width {k}")
    if not bool(torch.isfinite(W).all()):
        raise UserError(f"tensor {name} contains NaN or Inf values", hint="check the checkpoint (dsconv inspect)")
    if not bool(torch.isfinite(Hm).all()):
        raise UserError(f"layer {name}: GPTQ Hessian contains NaN or Inf", hint="check the calibration activations")

    g = group_size if 0 < group_size < k else 0
    groups = k // g if g else 1
    dead = torch.diagonal(Hm) <= 0
    Hm[dead, :] = 0
    Hm[:, dead] = 0
    Hm[dead, dead] = 1.0

    # scale[:, j] is the scale of original column j's group; static scales are filled now, dynamic ones on entry
    dynamic = bool(g) and not (act_order or static_groups)
    diag = torch.diagonal(Hm).clone()
    if not dynamic:
        gs = g or k
        scale = (search_scales(W.reshape(n, groups, gs), qmin, qmax, diag.reshape(groups, gs)) if search
                 else _rtn_scale(W.reshape(n, groups, gs), qmin, qmax))
    else:
        scale = torch.empty(n, groups, dtype=torch.float32)
    col_group = torch.arange(k) // g if g else torch.zeros(k, dtype=torch.long)

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(Hm), descending=True, stable=True)
        W, Hm, col_group = W[:, perm], Hm[perm][:, perm], col_group[perm]
    Hinv = _inverse_cholesky(Hm, damp, name)
    del Hm

    if dynamic:  # blocks hold whole groups, so a group's scale always sees its block's in-block updates
        block_size = max(g, block_size // g * g)
    Q = torch.empty(n, k, dtype=torch.float32)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if dynamic and col % g == 0:
                scale[:, col // g] = (search_scales(W1[:, None, i:i + g], qmin, qmax, diag[None, col:col + g])[:, 0]
                                      if search else _rtn_scale(W1[:, None, i:i + g], qmin, qmax)[:, 0])
            sc = scale[:, col_group[col]]
            wcol = W1[:, i]
            q = torch.round(wcol / sc).clamp_(qmin, qmax)
            Q[:, col] = q
            err = (wcol - q * sc) / Hinv1[i, i]
            W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1.0)
            Err1[:, i] = err
        if i2 < k:
            W[:, i2:].addmm_(Err1, Hinv[i1:i2, i2:], alpha=-1.0)

    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    scale_np = scale.numpy().astype(np.float32, copy=False)
    return Q.to(torch.int8).numpy(), scale_np, np.zeros_like(scale_np)


class HessianAccumulator:
    """Streaming ``H = 2 X^T X / N`` over calibration batches of a layer's input ``x [..., k]``.

    Each batch's ``X^T X`` is a float32 matmul (fast) added into a float64 (default) or float32 running sum; the
    division by the total token count happens once at the end, so batches of any sizes are weighted by their
    token counts exactly. Memory is one ``[k, k]`` matrix (float64: 8 k^2 bytes; pass ``dtype=torch.float32`` to
    halve it for very wide layers).
    """

    def __init__(self, k: int, dtype: torch.dtype = torch.float64) -> None:
        self.k = int(k)
        self.sum = torch.zeros(self.k, self.k, dtype=dtype)
        self.tokens = 0

    def update(self, x: Any) -> None:
        t = x.detach().to("cpu", torch.float32) if is_torch(x) else torch.from_numpy(to_float32(x))
        if t.shape[-1] != self.k:
            raise UserError(f"Hessian update: input width {t.shape[-1]} does not match the layer's {self.k}")
        t = t.reshape(-1, self.k)
        if t.shape[0] == 0:
            return
        self.sum += (t.T @ t).to(self.sum.dtype)
        self.tokens += int(t.shape[0])

    def hessian(self) -> np.ndarray:
        """float32 ``[k, k]``; all zeros when no token was seen (GPTQ then rounds to nearest)."""
        if self.tokens == 0:
            return np.zeros((self.k, self.k), np.float32)
        return (self.sum * (2.0 / self.tokens)).to(torch.float32).numpy()
