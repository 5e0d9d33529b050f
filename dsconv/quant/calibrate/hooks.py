"""Forward hooks of the calibration pass: which rows of a padded batch are real, the statistics of each distinct
linear input (shared by every linear that reads it), the routed tokens of a MoE layer, and which modules consume
each norm's output (for SmoothQuant). Inputs are recognised by data identity, never by module names."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dsconv.quant.algorithms.observers import MinMaxObserver
from dsconv.quant.calibrate.stats import InputStats
from dsconv.quant.plan.plan import LinearPlan


def storage_key(x: torch.Tensor) -> tuple[int, int, int]:
    """Identity of a tensor's data (views of one tensor share it): how consumers of one input are recognised."""
    return (x.untyped_storage().data_ptr(), x.storage_offset(), x.numel())


class RowMask:
    """The real (non-padding) rows of the current batch, flattened [B * L]; None when there is no padding.

    Every hook of a forward reads its tensors' real rows here, and each tensor is gathered (and its per-channel
    min/max taken) once per batch whatever number of hooks read it - the statistics hooks, the smoothing probes,
    the cache statistics: a norm's output is read by three of them."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.index: torch.Tensor | None = None  # the real rows' positions (None: all)
        self.count = 0
        self.held: torch.Tensor | None = None  # per real row: from a held-out prompt (selection.py)
        self._seen: dict[tuple, list] = {}      # this batch's tensors: key -> [tensor, real rows, (min, max)]

    def set(self, mask: torch.Tensor) -> None:
        flat = mask.reshape(-1)
        self.count = flat.numel()
        self.rows = None if bool(flat.all()) else flat
        self.index = None if self.rows is None else flat.nonzero().squeeze(1)
        self._seen = {}

    def forget(self) -> None:
        """Drop the batch's gathered rows (end of a pass: they hold the layer's activations)."""
        self._seen = {}

    def _entry(self, x: torch.Tensor, what: str) -> list:
        key = storage_key(x) + tuple(x.shape)
        hit = self._seen.get(key)
        if hit is None:
            x2 = x.reshape(-1, x.shape[-1])
            if x2.shape[0] != self.count:
                raise RuntimeError(f"{what}: {x2.shape[0]} input rows do not match the batch's {self.count} tokens")
            # holding x keeps its storage from being reused (and mistaken for it) within the batch
            hit = self._seen[key] = [x, x2 if self.index is None else x2.index_select(0, self.index), None]
        return hit

    def apply(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x's real rows [tokens, channels] (gathered once per batch)."""
        return self._entry(x, what)[1]

    def channel_range(self, x: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(real rows, per-channel min, per-channel max) of x, each computed once per batch."""
        e = self._entry(x, what)
        if e[2] is None:
            e[2] = (e[1].amin(dim=0), e[1].amax(dim=0)) if e[1].shape[0] else (None, None)  # 5x torch.aminmax
        return e[1], e[2][0], e[2][1]


class LinearHooks:
    """Forward pre-hooks on the layer's quantized nn.Linear modules: statistics of each distinct input, shared by
    every linear that reads it."""

    def __init__(self, targets: dict[nn.Module, LinearPlan], make_stats: Callable[[LinearPlan], InputStats],
                 rows: RowMask) -> None:
        self.targets = targets
        self.make_stats = make_stats
        self.rows = rows
        self.group: dict[nn.Module, InputStats] = {}
        self._batch: dict[tuple, tuple[torch.Tensor, InputStats]] = {}
        self.handles = [m.register_forward_pre_hook(self._pre) for m in targets]

    def _pre(self, mod: nn.Module, args: tuple) -> None:
        x = args[0]
        key = storage_key(x) + (x.shape[-1],)
        hit = self._batch.get(key)
        if hit is not None:  # same input as an earlier linear of this batch: already counted
            self.group.setdefault(mod, hit[1])
            return
        st = self.group.get(mod)
        if st is None:
            st = self.group[mod] = self.make_stats(self.targets[mod])
        if type(getattr(st, "observer", None)) is MinMaxObserver:  # its min/max shared with the other hooks
            rows, lo, hi = self.rows.channel_range(x.detach(), self.targets[mod].module)
            st.update(rows.float(), held=self.rows.held, channel_range=(lo, hi))
        else:
            st.update(self.rows.apply(x.detach(), self.targets[mod].module).float(), held=self.rows.held)
        self._batch[key] = (x, st)  # holding x keeps its storage from being reused within the batch

    def end_batch(self) -> None:
        self._batch = {}
        self.rows.forget()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self._batch = {}


class ExpertRecorder:
    """Stands in for the experts during the layer's forward: keeps the routed tokens (real ones only) and their
    routing, returns zeros; the experts run afterwards on all calibration tokens at once (then their outputs are
    added to the residual stream - the MoE output enters it linearly in every supported family)."""

    def __init__(self, rows: RowMask) -> None:
        self.rows = rows
        self.flat_index: torch.Tensor | None = None
        self.parts: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        keep = self.rows.index
        # the real rows, copied once (a gather copies; without padding, clone: the layer's tensors are its own)
        sel = (lambda t: t.detach().clone()) if keep is None else (lambda t: t.detach().index_select(0, keep))
        self.parts.append((sel(hidden), sel(top_k_index), sel(top_k_weights), sel(self.flat_index)))
        return torch.zeros_like(hidden)

    def rescale(self, s: torch.Tensor) -> None:
        """The routed tokens as the smoothed layer hands them to the experts: divided by s per channel (a fold into
        the norm they read, decided after the forward; the experts' gate/up columns take s: calibrate/steps.py)."""
        self.parts = [(h / s, *rest) for h, *rest in self.parts]

    def take(self) -> tuple[torch.Tensor, ...]:
        """(hidden, index, weights, token positions) of every routed token, in batch order (one batch: no copy)."""
        out = tuple(p[0] if len(p) == 1 else torch.cat(p) for p in zip(*self.parts))
        self.parts = []
        return out


class FlowProbe:
    """Which modules consume each norm's output (by data identity, not by name), and each norm's per-channel
    max |output| over real tokens: what SmoothQuant needs before the statistics pass."""

    def __init__(self, norms: list[nn.Module], consumers: list[nn.Module], rows: RowMask) -> None:
        self.rows = rows
        self.record = True
        self.absmax: dict[nn.Module, torch.Tensor] = {}
        self.consumers: dict[nn.Module, list[nn.Module]] = {n: [] for n in norms}
        self._out: dict[tuple, tuple[torch.Tensor, nn.Module]] = {}
        self.handles = [n.register_forward_hook(self._norm) for n in norms]
        self.handles += [c.register_forward_pre_hook(self._consumer) for c in consumers]

    def _norm(self, mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if out.numel() != self.rows.count * out.shape[-1]:  # per-head norms (q_norm/k_norm): no linear reads them
            return
        rows, lo, hi = self.rows.channel_range(out.detach(), "norm")
        if lo is None:
            return
        a = torch.maximum(-lo, hi).float()  # max |x|, exactly
        prev = self.absmax.get(mod)
        self.absmax[mod] = a if prev is None else torch.maximum(prev, a)
        if self.record:
            self._out[storage_key(out)] = (out, mod)

    def _consumer(self, mod: nn.Module, args: tuple) -> None:
        if not self.record or not args:
            return
        hit = self._out.get(storage_key(args[0]))
        if hit is not None and mod not in self.consumers[hit[1]]:
            self.consumers[hit[1]].append(mod)

    def end_batch(self) -> None:
        self.record = False
        self._out = {}
        self.rows.forget()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
