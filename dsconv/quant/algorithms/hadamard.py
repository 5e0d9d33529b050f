"""Orthogonal matrices for rotating a model's residual stream (QuaRot, SpinQuant): a randomised Hadamard matrix where
the width allows one, else a seeded random orthogonal matrix.

Why Hadamard: every entry is +-1/sqrt(n), so a rotated channel is an even mix of all the original channels and one
outlier channel is spread over all of them (its share of any channel is 1/sqrt(n)); a random orthogonal matrix does
the same only on average. Sylvester's construction gives the orders 2^k; real hidden sizes are 2^k times a small
factor (Qwen2.5-0.5B: 896 = 32 x 28, Gemma-3-270M: 640 = 32 x 20), which Paley's constructions cover: q + 1 for a
prime q = 3 (mod 4) and 2(q + 1) for a prime q = 1 (mod 4). The Kronecker product of two Hadamard matrices is one.
Each construction is checked (H H^T = n I) before it is used.
"""
from __future__ import annotations

import math

import torch


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _legendre(a: int, q: int) -> int:
    a %= q
    if a == 0:
        return 0
    return 1 if pow(a, (q - 1) // 2, q) == 1 else -1


def _jacobsthal(q: int) -> torch.Tensor:
    return torch.tensor([[_legendre(j - i, q) for j in range(q)] for i in range(q)], dtype=torch.float64)


def _paley(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order m by Paley I (m = q + 1) or Paley II (m = 2(q + 1)), or None."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: H = I + S, S = [[0, 1^T], [-1, Q]] (skew)
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(m, dtype=torch.float64) + s
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II from the symmetric conference matrix C
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
        a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)
    return None


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(n: int) -> torch.Tensor | None:
    """An (unnormalised, +-1) Hadamard matrix of order n, as 2^k x (1, 2 or a Paley order), or None."""
    try:
        p, m = _split(n)  # the largest power of two whose cofactor has a construction
    except ValueError:
        return None
    h = torch.kron(_sylvester(p), torch.ones(1, 1, dtype=torch.float64) if m == 1 else _paley(m))
    if not torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)):  # a construction's own check
        raise AssertionError(f"Hadamard construction of order {n} is not orthogonal")
    return h


def _checked_base(m: int) -> torch.Tensor:
    """The small factor H_m (1 or a Paley matrix), checked (H H^T = m I): Sylvester's factor is one by construction,
    and the Kronecker product of two Hadamard matrices is one, so Q never has to be formed to be trusted."""
    h = torch.ones(1, 1, dtype=torch.float64) if m == 1 else _paley(m)
    if h is None or not torch.equal(h @ h.T, m * torch.eye(m, dtype=torch.float64)):
        raise AssertionError(f"Hadamard construction of order {m} is not orthogonal")
    return h


class Rotation:
    """Q = (H_2^a kron H_m) diag(s) / sqrt(n) (or a dense random orthogonal Q), applied to the rows of a matrix
    without forming Q: the Sylvester factor as a fast Walsh-Hadamard transform (n log n), the small Paley factor
    as a matmul. `right(x)` is x @ Q; for Q^T W, use right(W^T)^T."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed
        g = torch.Generator().manual_seed(seed)
        try:  # the factors alone: the dense n x n Hadamard (7168^2 in float64, an n^3 check) is never built here
            self.pow2, self.base = _split(n)
        except ValueError:
            self.pow2 = self.base = 0
        self.kind = "hadamard" if self.base else "random orthogonal"
        if self.base:
            self.signs = (torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1).float()
            self.base_matrix = _checked_base(self.base).float()
            self.dense = None
        else:
            q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
            self.dense = (q * torch.sign(torch.diagonal(r))[None, :]).float()

    def matrix(self) -> torch.Tensor:
        """Q itself (float32), for tests and small widths."""
        return self.right(torch.eye(self.n))

    def right(self, x: torch.Tensor) -> torch.Tensor:
        """x @ Q in float32, for x of shape [rows, n]."""
        x = x.float()
        if self.dense is not None:
            return x @ self.dense
        rows = x.shape[0]
        y = x.reshape(rows, self.pow2, self.base)
        if self.base > 1:
            y = y @ self.base_matrix
        h = 1
        while h < self.pow2:  # butterflies along the 2^a axis: (u, v) -> (u + v, u - v)
            y = y.reshape(rows, self.pow2 // (2 * h), 2, h, self.base)
            u, v = y[:, :, 0], y[:, :, 1]
            y = torch.stack((u + v, u - v), dim=2)
            h *= 2
        return y.reshape(rows, self.n) * (self.signs / math.sqrt(self.n))[None, :]


def _split(n: int) -> tuple[int, int]:
    """(2^a, m) with n = 2^a m, the largest 2^a whose cofactor m has a construction (as `hadamard` picks it)."""
    k = 0
    while n % (2 ** (k + 1)) == 0:
        k += 1
    for a in range(k, -1, -1):
        m = n // 2 ** a
        if m == 1 or _paley(m) is not None:
            return 2 ** a, m
    raise ValueError(f"no Hadamard matrix of order {n}")
