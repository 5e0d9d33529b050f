"""MindSpore networks for the MindIR export: shared blocks (blocks.py) and one small module per architecture.

`build_net(ck, precision)` streams the checkpoint's tensors into MindSpore Parameters (one at a time) and returns
the `CausalLM` cell `(input_ids, attention_mask) -> logits`; no PyTorch model is involved.
"""
from __future__ import annotations

import os

os.environ.setdefault("GLOG_v", "3")

from typing import Callable  # noqa: E402

from dsconv.errors import UserError  # noqa: E402

# model_type -> architecture module (imported lazily: each imports mindspore)
ARCHITECTURES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "deepseek_v3": "deepseek_v3",
}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def check_supported(config: dict, where: str) -> None:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UserError(f"{where}: model_type {model_type!r} has no MindSpore network in dsconv",
                        hint=f"MindIR export supports {', '.join(supported_model_types())}")


def build_net(ck, precision, progress: Callable[[int], None] | None = None):
    """(CausalLM cell, WeightSource with the bookkeeping) for an open Checkpoint."""
    import importlib

    from dsconv.convert.ms_nets.config import hf_config
    from dsconv.convert.ms_nets.weights import WeightSource

    where = str(ck.root / "config.json")
    check_supported(ck.config, where)
    module = importlib.import_module(f"dsconv.convert.ms_nets.{ARCHITECTURES[ck.config['model_type']]}")
    cfg = hf_config(ck.root, ck.config)
    ws = WeightSource(ck, precision)
    net = module.build(ws, cfg, progress)
    unused = ws.unused()
    if unused:
        raise UserError(f"{len(unused)} tensor(s) of {ck.root} are not used by the MindSpore network, e.g. "
                        f"{unused[0]}", hint="the checkpoint has parts config.json does not describe; "
                                             "report it if the model loads in transformers")
    net.set_train(False)
    return net, ws
