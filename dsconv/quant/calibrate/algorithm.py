"""The calibrated path's algorithms as plug-ins: one object per algorithm, which declares what it observes, what it
computes per layer and what it folds; the layer's steps (steps.calibrate_layer) run every active algorithm through
the same phases, in registry order (registry.py), and name none of them.

A layer's phases, per algorithm in registry order:
1. `before(st)` - work of its own before the statistics forward: a probe forward and its folds (SmoothQuant where
   its statistics cannot follow a fold), a rewrite of the layer with its own forward (AWQ, which may then propagate
   the layer's outputs itself: `st.written`);
2. `observers(st)` - `Observer`s that ride on the statistics forward (smoothing probes, the KV-cache statistics).
   Each is installed the same way in the driver and, rebuilt from its `spec()`, in a forward job (forward_jobs.py
   knows them only through this class and finds each by its key, its module and name): its hooks, its
   `partial()` sent back, `merge()`d in batch order;
3. the statistics forward (the driver's own hooks: each linear input's `InputStats`, the routed tokens);
4. `after(st)` - what it computes from what it observed, folded into the layer (`st.modified`: float tensors to
   write; `st.col_scale`: a scale folded into the routed experts' gate/up columns; the statistics of an input a
   fold divided follow it, `InputStats.rescale`) or written (cache scales);
5. the linear jobs; `on_linear(st, module, result)` per quantized linear as it returns;
6. `after_linears(st)` - e.g. GPTQ's propagation of the quantized layer's outputs.

What the statistics themselves gather is declared too: `needs_hessian` (X^T X per linear input) and `holds_out`
(the held-out prompts a per-linear method choice is judged on).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

#: Observer key -> class, for forward jobs to rebuild an observer from its spec (observer_class)
OBSERVERS: dict[str, type["Observer"]] = {}


def observer_class(key: str) -> type["Observer"]:
    """The Observer class of `key` ("module:QualName"), importing its module where this process has not (a forward
    job's process imports only what its own code needs)."""
    if key not in OBSERVERS:
        module, _, name = key.partition(":")
        cls: Any = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        OBSERVERS[key] = cls
    return OBSERVERS[key]


@dataclass
class JobEnv:
    """What a forward job hands an observer it rebuilds: the job's copy of the layer and the job's place in the
    batches (its first batch's index, its first token's)."""

    sk: Any
    layer: nn.Module
    modules: dict[str, nn.Module]   # the layer's modules by in-memory name
    rows: Any                       # the job's RowMask
    first: int                      # index of the job among the pass's jobs (0: it holds batch 0)
    offset: int                     # real tokens in the batches before the job's
    tokens: int                     # real tokens of the whole calibration set


class Observer:
    """What an algorithm gathers during a layer's forward (hooks on the layer's modules, or a stand-in cache the
    decoder layer is given). A forward job finds the class by its `key`, its module and name."""

    key: ClassVar[str] = ""
    #: a stand-in for transformers' cache the decoder layer is given during the forward (at most one per forward)
    cache: Any = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.key = f"{cls.__module__}:{cls.__qualname__}"
        OBSERVERS[cls.key] = cls

    def spec(self, names: dict[nn.Module, str]) -> Any:
        """What a forward job needs to install the same observer: picklable, modules by in-memory name."""
        raise NotImplementedError

    @classmethod
    def install(cls, spec: Any, env: JobEnv) -> "Observer":
        """The observer a job installs on its own copy of the layer from `spec`."""
        raise NotImplementedError

    def end_batch(self) -> None:
        """A batch went through the layer."""

    def remove(self) -> None:
        """Its hooks off the layer."""

    def partial(self, names: dict[nn.Module, str]) -> Any:
        """In a job: what it gathered, picklable (modules by name)."""
        raise NotImplementedError

    def merge(self, part: Any, offset: int, by_name: dict[str, nn.Module]) -> None:
        """In the driver: a job's `partial()` (its batches start at token `offset`), in batch order."""
        raise NotImplementedError


@dataclass
class LayerState:
    """One layer's calibration as the algorithms see and change it."""

    i: int
    layer: nn.Module
    lps: dict[str, Any]                    # module name -> LinearPlan of the layer's quantized linears
    targets: dict[nn.Module, Any]          # nn.Linear -> LinearPlan
    experts: nn.Module | None              # the fused routed experts (None: a dense layer)
    modified: dict[str, torch.Tensor] = field(default_factory=dict)  # float tensors to write (not the checkpoint's)
    col_scale: torch.Tensor | None = None  # folded into the routed experts' gate/up columns
    written: bool = False                  # an algorithm's own forward propagated the outputs already
    write_outputs: bool = True             # the statistics forward writes the next layer's input
    layer_input: torch.Tensor | None = None  # the input rows, kept where a forward must see them again
    observed: list[Observer] = field(default_factory=list)  # the statistics forward's observers so far
    choices: dict[str, Any] = field(default_factory=dict)   # weights an algorithm chose, by module name
    hooks: Any = None                      # the statistics hooks (hooks.LinearHooks), once the forward ran
    recorder: Any = None                   # the routed tokens (hooks.ExpertRecorder)


class Algorithm:
    """One calibration algorithm (module docstring). An instance lives for one layer."""

    name: ClassVar[str] = ""
    step: ClassVar[str] = ""             # the StepClock step its work counts under (steps.STEPS)
    needs_hessian: ClassVar[bool] = False
    holds_out: ClassVar[bool] = False

    def __init__(self, cal: Any) -> None:
        self.cal = cal
        self.run = cal.ctx

    @classmethod
    def active(cls, run: Any) -> bool:
        """Whether this run uses it (run: context.CalibContext)."""
        raise NotImplementedError

    def folds_into_experts(self) -> bool:
        """Whether what it decides after the forward reaches the routed experts (they then start after it)."""
        return False

    def before(self, st: LayerState) -> None:
        pass

    def observers(self, st: LayerState) -> list[Observer]:
        return []

    def after(self, st: LayerState) -> None:
        pass

    def on_linear(self, st: LayerState, module: nn.Module, result: Any) -> None:
        pass

    def after_linears(self, st: LayerState) -> None:
        pass
