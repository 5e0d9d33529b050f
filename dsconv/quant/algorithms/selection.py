"""Per-layer choice between GPTQ and round-to-nearest, made on held-out calibration prompts.

Why: GPTQ minimises the output error on the tokens whose Hessian it was given. With the small calibration sets in
use (about a hundred QA pairs) it can fit those tokens at the expense of others, and on a real model it then ends up
worse than plain rounding (W4A16 g64 with 36 calibration prompts: +59.7% vs +50.8% perplexity). Every fourth
calibration prompt is therefore held out of the Hessian; both candidates are scored by ||X_held (W_hat - W)^T|| and
the smaller one is written, so no layer is worse than round-to-nearest on text GPTQ did not see. The comparison is
recorded per linear (quant_report.json: `output_error.held_out_gptq/held_out_rtn`, `note`) and counted in the
summary.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dsconv.quant.algorithms.error_metrics import output_error
from dsconv.quant.algorithms.schemes import dequant_weight

HOLD_EVERY = 4          # prompt j is held out when j % HOLD_EVERY == HOLD_EVERY - 1
MIN_PROMPTS = 8         # below this, nothing is held out (GPTQ on everything, unchecked)


def held_out_prompts(n: int) -> torch.Tensor | None:
    """Boolean [n] of held-out prompts, or None when the set is too small to split."""
    if n < MIN_PROMPTS:
        return None
    return torch.tensor([j % HOLD_EVERY == HOLD_EVERY - 1 for j in range(n)])


def held_out_error(x: torch.Tensor, w: torch.Tensor, q: np.ndarray, scale: np.ndarray) -> float:
    """Relative output error ||x (W_hat - W)^T|| / ||x W^T|| on held-out rows."""
    return output_error(x, w.float(), torch.from_numpy(dequant_weight(q, scale)))


def choose(x_held: torch.Tensor, w: torch.Tensor, candidates: dict[str, tuple[np.ndarray, np.ndarray]]
           ) -> tuple[tuple[np.ndarray, np.ndarray], str, dict[str, Any]]:
    """The candidate with the smallest held-out error (the first listed on a tie), its name and every error
    (``held_out_<name>``). Listing plain round-to-nearest among them makes the choice never worse than it there."""
    errs = {name: held_out_error(x_held, w, *c) for name, c in candidates.items()}
    best = min(errs, key=lambda name: (errs[name], list(candidates).index(name)))
    return candidates[best], best, {f"held_out_{name}": e for name, e in errs.items()}
