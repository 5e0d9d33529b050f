"""What the calibrated path's parts share, passed explicitly rather than read off the layer runner: the run's
read-only inputs (`CalibContext`), the activations a layer is calibrated on (`LayerActivations`), and how a linear
input's statistics are made (`StatsSpec`, small and picklable: jobs build the same statistics as the driver)."""
from __future__ import annotations

import platform
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dsconv.checkpoint import Checkpoint
from dsconv.families.roles import Role
from dsconv.errors import UserError
from dsconv.executor import Executor
from dsconv.quant.algorithms import clipping, selection
from dsconv.quant.calibrate.data import CalibSet
from dsconv.quant.calibrate.hooks import ExpertRecorder, RowMask
from dsconv.runner.layers import Skeleton
from dsconv.quant.calibrate.stats import InputStats
from dsconv.quant.plan.options import QuantOptions
from dsconv.qformat import STATIC_TYPES
from dsconv.quant.plan.plan import QuantPlan


@contextmanager
def forward_matmuls(opts: QuantOptions, sk: Skeleton | None = None,
                    layer: nn.Module | None = None) -> Iterator[None]:
    """Where the calibration forward runs its matmuls: float32 by default; with --calib-precision bf16 (torch's CPU
    autocast) linear, matmul and attention take bf16 inputs and accumulate in float32 - AMX runs them 5-6x faster
    than float32 on a Sapphire Rapids core, and an Ascend engine computes these layers in bf16 too. The layer's
    routers stay float32 (a top-k choice is discrete: bf16 logits would move near-tied tokens to other experts, and
    DeepSeek's engines score in float32); norms, softmax and the residual stream stay float32 as autocast leaves
    them; the statistics hooks take each linear's input as float32; every search and fallback check runs after the
    forward, in float32.
    With fp32-onednn the float32 linears go through oneDNN where torch has it (`onednn_linears`); an "auto" the
    stage left unresolved means here what it means to the stage (`auto_precision`)."""
    precision = auto_precision() if opts.calib_precision == "auto" else opts.calib_precision
    if precision != "bf16":
        with onednn_linears() if precision == "fp32-onednn" else nullcontext():
            yield
        return
    routers = [] if layer is None else [m for m, (_, role) in sk.own_weights(layer).items() if role == Role.ROUTER]
    own = [m.__dict__.get("forward") for m in routers]  # an instance forward (install_forward's), else None
    for m in routers:
        m.forward = _float32_call(m.forward)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    finally:
        for m, fn in zip(routers, own):
            if fn is None:
                del m.forward
            else:
                m.forward = fn


class _OneDNNLinear(TorchFunctionMode):
    """`F.linear` on float32 inputs through oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`), the rest as it is.

    Why: torch's float32 linear calls MKL's sgemm, which on a non-Intel CPU takes a generic path. On a 2-core AMD
    EPYC (AVX-512) it ran 98 GFLOP/s per core where oneDNN ran 211 at DeepSeek-V3's expert widths, and the
    calibration forward is mostly these matmuls. oneDNN's results do not depend on the thread count (checked at
    1-8 threads), so a forward job on one thread writes the driver's bits. The sums differ from MKL's in the last
    bits; what that does to a real model's perplexity is measured against the spread of calibration subsets
    (benchmarks/bench_calib_noise.py, docs/accuracy.md): over 8 sets each, -0.02 +- 0.14 points from MKL on
    Gemma-3-270M and +0.10 +- 0.09 on Qwen2.5-Coder-0.5B, inside what dropping a few pairs moves either. So `auto`,
    the default, takes it where MKL is slow (`auto_precision`); `fp32` keeps MKL everywhere."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and not kwargs:
            x, w, b = args[0], args[1], args[2] if len(args) > 2 else None
            if x.dtype == w.dtype == torch.float32 and (b is None or b.dtype == torch.float32) and x.dim() >= 2 \
                    and w.dim() == 2 and not torch.is_grad_enabled():
                return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return func(*args, **kwargs)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def mkl_generic_path(vendor: str | None = None, machine: str | None = None) -> bool:
    """Whether torch's float32 matmul runs MKL's generic code on this CPU: MKL picks its AVX2/AVX-512 kernels for
    Intel's vendor string only, so an x86 CPU of another vendor (AMD EPYC, Hygon) gets the slow path."""
    from dsconv.runtime.process import cpu_vendor

    vendor = cpu_vendor() if vendor is None else vendor
    machine = platform.machine() if machine is None else machine
    return machine.lower() in ("x86_64", "amd64") and torch.backends.mkl.is_available() \
        and vendor not in (None, "", "GenuineIntel")


def auto_precision(vendor: str | None = None, machine: str | None = None) -> str:
    """What `--calib-precision auto` means here: float32 through oneDNN where MKL would take its
    generic path (`mkl_generic_path`) and torch has oneDNN, float32 through MKL everywhere else. Both are float32;
    only the order of the sums differs, and bench_calib_noise measures that against a user's choice of calibration
    pairs (docs/accuracy.md)."""
    return "fp32-onednn" if mkl_generic_path(vendor, machine) and onednn_available() else "fp32"


@contextmanager
def onednn_linears() -> Iterator[None]:
    """Float32 `F.linear` calls in this block through oneDNN (`_OneDNNLinear`), where torch was built with it."""
    if not onednn_available():
        yield
        return
    with _OneDNNLinear():
        yield


def _float32_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    return call


@dataclass(frozen=True)
class CalibContext:
    """The run's read-only inputs: the checkpoint and its model skeleton, the plan, the options, where jobs keep
    their files, whether the writer stages (a static unit that cannot be written then falls back instead of failing)
    and the executor."""

    ck: Checkpoint
    sk: Skeleton
    plan: QuantPlan
    opts: QuantOptions
    workspace: Path | None = None
    staged: bool = False
    executor: Executor | None = None

    @property
    def static(self) -> bool:
        return self.plan.scheme in STATIC_TYPES

    @property
    def observer_method(self) -> str:
        return clipping.observer_method(self.opts.act_method)


@dataclass(frozen=True)
class StatsSpec:
    """How every linear input's InputStats is made in this run (driver and jobs alike)."""

    observer: str | None   # the activation observer (static W8A8), else None
    hessian: bool          # GPTQ's X^T X
    sample_tokens: int     # rows kept to measure output errors
    stride: int            # every stride-th token is sampled: the sample spreads over the whole calibration set
    held_out: bool         # held-out prompts are kept apart (GPTQ's choice against rounding)

    def new(self, k: int, name: str) -> InputStats:
        return InputStats(k, name, self.observer, hessian=self.hessian, sample_tokens=self.sample_tokens,
                          stride=self.stride, held_out=self.held_out)


def forward_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """The forward's batches of sample indices: longest first, as many samples as fit `batch_tokens` padded tokens
    at the batch's first (longest) length - so padding stays small (benchmarks/projection.py counts it too)."""
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    batches: list[list[int]] = []
    while order:
        per = max(1, batch_tokens // lengths[order[0]])
        batches.append(order[:per])
        order = order[per:]
    return batches


@dataclass
class LayerActivations:
    """The calibration activations: the current layer's input rows `h` [tokens, hidden] float32 (every sample's
    tokens, concatenated), replaced by the layer's output rows as the layers advance; the samples' lengths and first
    rows; the forward batches (sample indices, longest first, about `batch_tokens` padded tokens each); per token,
    whether it belongs to a held-out prompt; and the real rows of the batch being run, which the hooks read."""

    h: torch.Tensor
    lengths: list[int]
    starts: np.ndarray
    batches: list[list[int]]
    held_tokens: torch.Tensor | None
    rows: RowMask = field(default_factory=RowMask)

    @classmethod
    def embedded(cls, sk: Skeleton, calib: CalibSet, vocab_size: int, batch_tokens: int,
                 hold_out: bool) -> "LayerActivations":
        """The calibration tokens embedded: the first layer's input."""
        lengths = [len(s) for s in calib.samples]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        ids = torch.tensor([t for s in calib.samples for t in s], dtype=torch.long)
        if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
            raise UserError(f"calibration token id {int(ids.max())} is outside the model's vocabulary "
                            f"({vocab_size})", hint="the tokenizer does not belong to this model")
        h = sk.embed(ids)
        held = selection.held_out_prompts(len(lengths)) if hold_out else None
        held_tokens = None if held is None else torch.repeat_interleave(held, torch.tensor(lengths))
        return cls(h, lengths, starts, forward_batches(lengths, batch_tokens), held_tokens)

    @property
    def tokens(self) -> int:
        return int(self.h.shape[0])

    def batch(self, samples: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The samples as one zero-padded batch: (x, token index with -1 on padding, mask)."""
        return padded_batch(self.h, samples, self.lengths, self.starts)

    def stats_spec(self, plan: QuantPlan, opts: QuantOptions, hessian: bool) -> StatsSpec:
        """What each linear input's statistics keep; `hessian`: X^T X, which an algorithm asked for
        (Algorithm.needs_hessian)."""
        observer = clipping.observer_method(opts.act_method) if plan.scheme in STATIC_TYPES else None
        return StatsSpec(observer, hessian, opts.sample_tokens,
                         self.tokens // max(1, opts.sample_tokens), self.held_tokens is not None)


def forward_batch(sk: Skeleton, acts: LayerActivations, layer: nn.Module, samples: list[int], write: bool,
                  recorder: ExpertRecorder | None = None, cache: Any = None) -> None:
    """One batch through the layer in this process, its real rows set for the hooks; with `write`, its outputs
    replace its rows of `acts.h` (the next layer's input); `cache` (kv_cache.KVCacheStats) sees what the
    attention would cache."""
    x, idx, mask = acts.batch(samples)
    acts.rows.set(mask)
    acts.rows.held = None if acts.held_tokens is None else acts.held_tokens[idx[mask]]
    if recorder is not None:
        recorder.flat_index = idx.reshape(-1)
    y = layer(x, **sk.layer_inputs(x, layer, cache))
    y = y[0] if isinstance(y, tuple) else y
    if write:
        acts.h[idx[mask]] = y[mask]


def padded_batch(h: torch.Tensor | np.ndarray, samples: list[int], lengths: Any, starts: Any,
                 length: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Calibration samples `samples` as one zero-padded batch of rows of `h` (the driver's activations, or the layer
    input a job reads from its file): (x [b, L, hidden], token index [b, L] with -1 on padding, mask). One function
    for the driver and the jobs, so both push the same rows with the same padding. `length`: L, for part of a batch
    padded as its whole batch is (forward_jobs' sub-batches); default the longest sample's."""
    L = max(int(lengths[j]) for j in samples) if length is None else int(length)
    idx = torch.full((len(samples), L), -1, dtype=torch.long)
    for r, j in enumerate(samples):
        idx[r, : int(lengths[j])] = torch.arange(int(starts[j]), int(starts[j]) + int(lengths[j]))
    mask = idx >= 0
    if isinstance(h, torch.Tensor):
        x = h[idx.clamp(min=0)]
    else:
        x = torch.from_numpy(np.ascontiguousarray(h[idx.clamp(min=0).numpy()]))
    x[~mask] = 0.0
    return x, idx, mask
