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


C8_RE = re.compile(r"^(model\.layers\.(\d+)\.self_attn)\.([kv])_proj\.kv_cache_(scale|offset)$")


def c8_tensors(route: dict) -> dict[int, dict[str, str]]:
    """layer -> {"k_scale": name, ...} of the C8 cache tensors on disk (`<attn>.k_proj.kv_cache_scale` etc.)."""
    return _by_layer(route, C8_RE, "_")


def _by_layer(route: dict, rx: re.Pattern, sep: str) -> dict[int, dict[str, str]]:
    """layer -> {"<group 3><sep><group 4>": name} of the tensors on disk whose name `rx` matches."""
    out: dict[int, dict[str, str]] = {}
    for name in route:
        m = rx.match(name)
        if m:
            out.setdefault(int(m.group(2)), {})[f"{m.group(3)}{sep}{m.group(4)}"] = name
    return out


def c8_problems(route: dict, layers: dict[int, dict[str, str]], widths: dict[str, int], model_dtype: str,
                rule: str, p: Problems) -> None:
    """What both engines need of a layer's four C8 tensors: all present, one value per cached channel (the k/v
    projection's rows), float, the scale exact in the model dtype (both hold it there), the offset zero (vLLM-Ascend
    adds it as a float; MindIE takes its float bits as an int8)."""
    for layer, got in sorted(layers.items()):
        for part in ("k_scale", "k_offset", "v_scale", "v_offset"):
            name = got.get(part)
            if name is None:
                p.add(rule, f"layer {layer}: no {part.replace('_', '_proj.kv_cache_')}")
                continue
            _, dtype, shape = route[name]
            width = widths.get(name.rsplit(".", 1)[0])
            if dtype not in FLOAT_DTYPES or shape != (width,):
                p.add(rule, f"{name}: {dtype}{list(shape)}, needs a float [{width}] (one per cached channel)")
                continue
            _value_problems(route, name, part.endswith("offset"), model_dtype, rule, p)


FA_RE = re.compile(r"^(model\.layers\.(\d+)\.self_attn)\.(fa_[qkv])\.(scale|offset)$")


def fa_tensors(route: dict) -> dict[int, dict[str, str]]:
    """layer -> {"fa_q.scale": name, ...} of the MLA FA-quant tensors on disk."""
    return _by_layer(route, FA_RE, ".")


def fa_problems(route: dict, layers: dict[int, dict[str, str]], heads: int, model_dtype: str, rule: str,
                p: Problems) -> None:
    """What both engines need of a layer's FA-quant tensors: fa_q one scale per attention head [H, 1], fa_k / fa_v
    one [1, 1], float scales exact in the model dtype and positive, int8 zero offsets."""
    for layer, got in sorted(layers.items()):
        for part, rows in (("fa_q", heads), ("fa_k", 1), ("fa_v", 1)):
            for param, dtypes in (("scale", FLOAT_DTYPES), ("offset", ("I8",))):
                name = got.get(f"{part}.{param}")
                if name is None:
                    p.add(rule, f"layer {layer}: no {part}.{param}")
                    continue
                _, dtype, shape = route[name]
                if dtype not in dtypes or shape != (rows, 1):
                    p.add(rule, f"{name}: {dtype}{list(shape)}, needs {'/'.join(dtypes)}[{rows}, 1]")
                    continue
                _value_problems(route, name, param == "offset", model_dtype, rule, p)


def _value_problems(route: dict, name: str, offset: bool, model_dtype: str, rule: str, p: Problems) -> None:
    """What both engines need of one int8-cache tensor's values: an offset zero (symmetric forms only), a scale
    positive and exact in the model dtype (both engines hold it there)."""
    import torch

    t = torch.from_numpy(tensor(route, name).astype(np.float32))
    if offset:
        if bool((t != 0).any()):
            p.add(rule, f"{name}: nonzero offsets (symmetric only)")
        return
    want = {"BF16": torch.bfloat16, "F16": torch.float16}.get(model_dtype)
    if bool((t <= 0).any()) or want is not None and not torch.equal(t.to(want).float(), t):
        p.add(rule, f"{name}: scales must be positive and exact in {model_dtype}")
