"""An evenly spread sample of a stream of rows, reproducible when the stream is cut into jobs."""
from __future__ import annotations

import math

import torch


class RowSampler:
    """Every stride-th row by global token index, at most `cap` of them: a sample spread over the whole calibration
    set, not its first prompt. A forward job's sampler starts at its first token (`start_at`) and the driver appends
    the jobs' samplers in batch order (`extend`), which gives the serial sample bit for bit."""

    def __init__(self, stride: int, cap: int) -> None:
        self.stride, self.cap = max(1, int(stride)), cap
        self.seen = self.kept = 0
        self.rows: list[torch.Tensor] = []
        self.picked: list[torch.Tensor] = []  # the kept rows' global indices (a caller that has their outputs)

    def update(self, x: torch.Tensor) -> None:
        t = x.shape[0]
        if self.kept < self.cap:
            first = (-self.seen) % self.stride
            idx = torch.arange(min(first, t), t, self.stride)[: self.cap - self.kept]  # none: batch < gap
            if idx.numel():
                self.rows.append(x[idx].detach().to(torch.float32).clone())
                self.picked.append(idx + self.seen)
                self.kept += int(idx.numel())
        self.seen += t

    def start_at(self, offset: int) -> None:
        """Placed after `offset` tokens: the multiples of stride below it are already taken (by earlier jobs)."""
        self.seen, self.kept = offset, min(self.cap, math.ceil(offset / self.stride))

    def extend(self, other: "RowSampler", offset: int, what: str) -> None:
        """Append the sampler of the job that started at token `offset`; a misplaced job is a bug, never merged."""
        if self.seen != offset:
            raise RuntimeError(f"forward jobs: {what} saw {self.seen} tokens before a job starting at {offset}")
        self.rows += other.rows
        self.picked += other.picked
        self.kept, self.seen = other.kept, other.seen

    @property
    def x(self) -> torch.Tensor | None:
        return torch.cat(self.rows) if self.rows else None
