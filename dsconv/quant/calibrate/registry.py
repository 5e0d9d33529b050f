"""The calibration algorithms, in the order a layer runs them (algorithm.py). Adding one is its module and a line
here: the layer's steps, the forward jobs and the statistics know them only through `Algorithm` and `Observer`.

The order is the data flow: smoothing folds first (the others see the smoothed layer), the KV-cache statistics ride
on whatever forward follows, AWQ rewrites the layer (and may propagate its outputs itself), the clip search reads
the statistics of the layer as folded, GPTQ propagates the quantized outputs last. Rotation is not here: it is a
whole-model change of basis before either path, the calibrated or the streamed one (quant/rotate.py, `--rotate`).
"""
from __future__ import annotations

from typing import Any

from dsconv.quant.calibrate.algorithm import Algorithm
from dsconv.quant.calibrate.awq import Awq
from dsconv.quant.calibrate.clip_search import ClipSearch
from dsconv.quant.calibrate.gptq_layer import Gptq
from dsconv.quant.calibrate.kv_cache import KvCacheScales
from dsconv.quant.calibrate.smooth_layer import SmoothQuant

ALGORITHMS: tuple[type[Algorithm], ...] = (SmoothQuant, KvCacheScales, Awq, ClipSearch, Gptq)


def active(run: Any) -> list[type[Algorithm]]:
    """The algorithms this run uses, in order."""
    return [a for a in ALGORITHMS if a.active(run)]
