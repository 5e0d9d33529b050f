"""The MindIR export's MindSpore side: `build_net` (the network from dsconv.model.ms: shared blocks, one generic
builder driven by the family table, a block per op no other family has) and worker.py (export and run, in-process
or in a child process).

`build_net(ck, precision)` streams the checkpoint's tensors into MindSpore Parameters (one at a time) and returns
the `CausalLM` cell `(input_ids, attention_mask) -> logits`; no PyTorch model is involved.
"""
from __future__ import annotations

import os

os.environ.setdefault("GLOG_v", "3")

from typing import Callable  # noqa: E402

from dsconv.errors import UserError  # noqa: E402


def build_net(ck, precision, progress: Callable[[int], None] | None = None):
    """(CausalLM cell, WeightSource with the bookkeeping) for an open Checkpoint."""
    from dsconv.model.ms.build import build
    from dsconv.model.ms.weights import WeightSource

    ws = WeightSource(ck, precision)
    net = build(ws, ck.family, ck.facts, progress)
    unused = ws.unused()
    if unused:
        raise UserError(f"{len(unused)} tensor(s) of {ck.root} are not used by the MindSpore network, e.g. "
                        f"{unused[0]}", hint="the checkpoint has parts config.json does not describe; "
                                             "report it if the model loads in transformers")
    net.set_train(False)
    return net, ws
