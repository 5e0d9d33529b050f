"""DeepSeek's MTP layer under MindIE: when its loader builds one, and which of its tensors it runs from the main model.

Runs inside the MindIE engine-check environment (see mindie_loader.py); imports nothing from dsconv."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def speculative_tokens(directory: Path) -> int:
    """1 where the checkpoint carries an MTP layer (a tensor of layer num_hidden_layers, in any rank folder): MindIE
    builds DeepSeek's MTP layer only with num_speculative_tokens > 0, as a deployment with the MTP plugin sets it
    (atb/models/deepseekv2/modeling_deepseekv2.py: `if self.num_speculative_tokens:` ... mtp_layer); else 0, as
    text_generator/generator.py sets it without the plugin."""
    from safetensors import safe_open

    cfg = json.loads((directory / "config.json").read_text())
    if not cfg.get("num_nextn_predict_layers"):
        return 0
    prefix = f"model.layers.{int(cfg['num_hidden_layers'])}."
    for f in sorted(directory.rglob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if any(k.startswith(prefix) for k in st.keys()):
                return 1
    return 0


def mtp_shared_copies(written: dict[str, Any], d: Path) -> set[str]:
    """The MTP layer's own embed_tokens / shared_head.head where they hold exactly the main model's embedding / LM
    head, in the written tensors (or in the source's, for an offline-sharded output that leaves the copies out).
    DeepSeek's MTP module shares both with the main model and its checkpoint stores copies; MindIE builds no MTP
    embedding or head and runs the main ones (atb/models/deepseekv2/modeling_deepseekv2.py, the MTP branch of
    DeepseekV2Model.__init__), which is the same computation only when the copies are exact."""
    cfg = json.loads((d / "config.json").read_text())
    n = int(cfg["num_hidden_layers"])
    out = set()
    for own, main in ((f"model.layers.{n}.embed_tokens.weight", "model.embed_tokens.weight"),
                      (f"model.layers.{n}.shared_head.head.weight", "lm_head.weight")):
        a, b = written.get(own), written.get(main)  # torch tensors as written, or the source's float64 arrays
        if a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all()):
            out.add(own)
    return out
