"""Which source row a held row that failed its comparison in place looks like: a diagnostic that names where a row
went (up where gate belongs, another expert, another head), never a verdict. Runs in the MindIE environment."""
from __future__ import annotations

import re
from typing import Any

import numpy as np

LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def nearest(row: np.ndarray, weights: dict[str, np.ndarray], layer: int | None, gains: Any) -> str | None:
    """The source row chunk of the same layer and width most similar to `row` (cosine of the products with their
    norms, so that SmoothQuant's moved scale does not hide the match), as "name[j] (column chunk c, cosine x)"."""
    K = row.shape[0]
    best: tuple[float, str] | None = None
    for name, a in weights.items():
        m = LAYER_RE.search(name)
        if a.ndim != 2 or a.shape[1] % K or (int(m.group(1)) if m else None) != layer:
            continue
        for c in range(a.shape[1] // K):
            gw, gs = gains(name, c, K)
            S = a[:, c * K:(c + 1) * K] * gs
            e = row * gw
            cos = S @ e / np.maximum(np.linalg.norm(S, axis=1) * np.linalg.norm(e), 1e-300)
            j = int(np.argmax(cos))
            if best is None or cos[j] > best[0]:
                best = (float(cos[j]), f"{name}[{j}] (column chunk {c}, cosine {cos[j]:.4f})")
    return best[1] if best else None
