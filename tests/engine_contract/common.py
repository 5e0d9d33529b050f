"""What both engine readers share: opening a directory's safetensors the way the engines do (every *.safetensors,
one name -> file routing map, a duplicate name is an error) and the naming tables of the families under test.

Deliberately independent of dsconv's own profiles and family tables: a reader that imported them would agree with
dsconv by construction. Engine facts are restated here from the engines' source (docs/engine_rules.md)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

FLOAT_DTYPES = ("BF16", "F16", "F32")
LINEAR_RE = re.compile(r"^(model\.layers\.(\d+)\.(?:self_attn|mlp|block_sparse_moe)\..+)\.weight$")
EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)$")


class Problems(list):
    def add(self, rule: str, text: str) -> None:
        self.append(f"[{rule}] {text}")


def routing(directory: Path, problems: Problems, where: str) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """name -> (file, dtype, shape) over every non-hidden *.safetensors of `directory`.

    Mirrors MindIE-LLM atb/utils/hub.py::weight_files + atb/utils/weights.py::Weights.load_routing (a name in two
    files -> AssertionError "routing weight key error")."""
    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    files = sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("."))
    if not files:
        problems.add("weight_files", f"{where}: no *.safetensors (FileNotFoundError 'No local weights found')")
    for f in files:
        raw = f.read_bytes()[:8]
        n = int.from_bytes(raw, "little")
        with open(f, "rb") as fh:
            fh.seek(8)
            header = json.loads(fh.read(n))
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if name in out:
                problems.add("load_routing", f"{where}: {name} in {out[name][0].name} and {f.name}")
            out[name] = (f, e["dtype"], tuple(e["shape"]))
    return out


def tensor(route: dict, name: str) -> np.ndarray:
    import torch

    f = route[name][0]
    with safe_open(str(f), framework="pt") as h:
        t = h.get_tensor(name)
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def linear_modules(route: dict) -> dict[str, int]:
    """module prefix -> layer index for every decoder linear on disk (a `.weight` with 2 dims, or an int8 packed
    one), routers excluded (MindIE FastLinear / vLLM GateLinear are built without quant config)."""
    out = {}
    for name, (_, _, shape) in route.items():
        m = LINEAR_RE.match(name)
        if not m or len(shape) != 2:
            continue
        module = m.group(1)
        if module.endswith((".gate", ".shared_expert_gate")) or "layernorm" in module or module.endswith("norm"):
            continue
        out[module] = int(m.group(2))
    return out
