"""The static activation ranges' clip search as a calibration plug-in (algorithm.py): after the statistics forward,
each static input's clip ratio is chosen by its consumers' output error (algorithms/clipping.py has the search)."""
from __future__ import annotations

from typing import Any

from dsconv.quant.algorithms import clipping
from dsconv.quant.algorithms.methods import ACT_SEARCH
from dsconv.quant.calibrate.algorithm import Algorithm, LayerState


class ClipSearch(Algorithm):
    name = "clip_search"
    step = "clip_search"

    @classmethod
    def active(cls, run: Any) -> bool:
        return bool(run.static) and run.opts.act_method == ACT_SEARCH

    def after(self, st: LayerState) -> None:
        with self.cal.clock(self.step):
            clipping.choose_clips(st.hooks.group, st.targets, self.cal.decisions.setdefault("clipping", {}))
