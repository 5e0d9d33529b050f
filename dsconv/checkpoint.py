"""The one streaming reader: a model directory's tensors from headers, and one tensor at a time from mmap
(the byte level - headers, byte ranges, mmap reads - is tensorfile.py; this adds the directory and the family).

`Checkpoint.open(dir)` reads config.json and the safetensors headers only (name, dtype, shape, file, byte range),
validates all of it, normalises transformers' fused MoE layout into per-expert tensors (each a contiguous byte range of
the fused tensor), and classifies every tensor through its family. `load(name)` copies one tensor out of a read-only
mmap and tells the kernel to drop those pages from this process, so resident memory stays near one tensor however
large the checkpoint; FP8 block-scaled weights are dequantized on read when asked.

Everything it reads is untrusted: headers are bounded and checked, byte ranges must lie in the file and not overlap,
index entries must stay inside the model directory, and pickled weights are refused unless explicitly allowed.
"""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import replace
from itertools import repeat
from pathlib import Path
from typing import Any

from dsconv import schemas
from dsconv.errors import UserError
from dsconv.families import NOT_YET, Family, family_for, supported_model_types
from dsconv.families.base import REGISTRY, ModelFacts
from dsconv.families.roles import TensorRole
from dsconv.io.tensorfile import TensorInfo, TensorReader, dequant_fp8_block, read_header
from dsconv.runtime.process import gc_paused
from dsconv.tensors import DTYPE_SIZES, FP8_DTYPES, is_within, safetensors_dtype

COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
              "chat_template.jinja", "chat_template.json")
QUANT_DESCRIPTIONS = ("quant_model_description.json", "quant_model_description_w8a8.json",
                      "quant_model_description_w8a8_dynamic.json", "quant_model_description_w8a16.json",
                      "quant_model_description_w4a16.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


class Checkpoint:
    """A model directory: config, family, tensor metadata from headers, and one-tensor-at-a-time loading."""

    def __init__(self, root: Path, config: dict[str, Any], family: Family, tensors: dict[str, TensorInfo],
                 files: list[Path], quant_description: dict[str, Any] | None = None,
                 pickled: dict[str, Any] | None = None) -> None:
        self.root = root
        self.config = config
        self.family = family
        self.facts: ModelFacts = family.facts(config)
        self.tensors = tensors
        self.files = files
        self.quant_description = quant_description
        self._pickled = pickled
        self._reader = TensorReader()
        self.roles: dict[str, TensorRole] = {name: family.classify(name, self.facts) for name in tensors}
        self._facts_from_disk()
        self._check_inventory()
        self.fp8_scales = self._pair_fp8_scales()

    def _facts_from_disk(self) -> None:
        """A config may announce MTP layers the weights do not carry (transformers never saves them): trust disk."""
        f = self.facts
        present = {r.layer for r in self.roles.values() if r.layer is not None and r.layer >= f.num_layers}
        for prefix in self.family.mtp_prefixes:  # an MTP block stored apart: its decoder layers mtp.layers.K.*
            layers = prefix + "layers."
            numbers = {n[len(layers):].split(".", 1)[0] for n in self.tensors if n.startswith(layers)}
            present |= {f.num_layers + int(k) for k in numbers if k.isdigit()}
        f.num_mtp_layers = len(present)
        if self.family.mtp_prefixes and f.num_layers - 1 in f.moe_layers:  # a stored-apart MTP layer has the MLP of
            f.moe_layers = tuple(sorted({*f.moe_layers, *present}))  # the last decoder layer (vLLM qwen3_next_mtp.py)
        f.moe_layers = tuple(i for i in f.moe_layers if i < f.num_layers or i in present)

    def _check_inventory(self) -> None:
        """The weights are the model config.json describes: no layer beyond it, every tensor it implies present
        with its shape. Runs on every path (weight-only quantize included), so no stage writes an unloadable model."""
        f = self.facts
        allowed = f.num_layers + (self.config.get("num_nextn_predict_layers") or 0)
        extra = sorted({r.layer for r in self.roles.values() if r.layer is not None and r.layer >= allowed})
        if extra:
            raise UserError(f"{self.root}: the weights have layer {extra[-1]} but config.json says "
                            f"num_hidden_layers {f.num_layers}", hint="fix num_hidden_layers in config.json or use "
                            "the weights it belongs to")
        actual = {n: (i.dtype, i.shape) for n, i in self.tensors.items()}
        schemas.inventory(str(self.root), ((name, shape) for _, name, shape in self.family.iter_shapes(f)), actual)

    # ---- opening ----------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, root: Path | str, allow_pickle: bool = False) -> "Checkpoint":
        with gc_paused():  # the listing is ~0.3 M small acyclic objects for DeepSeek-V3: no collection walks them
            return cls._open(Path(root), allow_pickle)

    @classmethod
    def _open(cls, root: Path, allow_pickle: bool) -> "Checkpoint":
        if not root.is_dir():
            raise UserError(f"{root} is not a directory", hint="pass the HF model directory with --model")
        config = read_config(root)
        family = family_for(config, where=str(root / "config.json"))
        quant_description = _read_quant_description(root)
        files, entries = _list_safetensors(root)
        pickled = None
        if not files:
            bins = sorted(p for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if not bins:
                raise UserError(f"{root} has no *.safetensors weights", hint="point --model at a directory with weights")
            if not allow_pickle:
                raise UserError(f"{bins[0].name} is a pickled checkpoint; dsconv does not unpickle by default",
                                hint="convert it to safetensors, or pass --allow-pickle if you trust its source")
            pickled = _load_pickled(bins)
            entries = {name: TensorInfo(name, safetensors_dtype(t), tuple(t.shape), bins[0], 0, t.numel() *
                                        t.element_size(), name) for name, t in pickled.items()}
            files = bins
        tensors = _normalise_fused(entries, family, config)
        return cls(root, config, family, tensors, files, quant_description, pickled)

    # ---- metadata ---------------------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise UserError(f"tensor {name} is not in {self.root}", hint="check the name with `dsconv inspect`") from None

    def role(self, name: str) -> TensorRole:
        return self.roles[name]

    def names(self) -> list[str]:
        return list(self.tensors)

    def layers(self) -> dict[int | None, list[str]]:
        """Tensor names grouped by decoder layer (None: outside the layers), in file order within a layer."""
        out: dict[int | None, list[str]] = {}
        for name, r in self.roles.items():
            out.setdefault(r.layer, []).append(name)
        return out

    def copy_files(self) -> list[Path]:
        """Config, tokenizer and generation files a derived checkpoint carries along."""
        return [self.root / n for n in COPY_FILES if (self.root / n).is_file()]

    @property
    def readable_by_path(self) -> bool:
        """Every tensor is a byte range of a safetensors file, so a task elsewhere can read it (not pickled)."""
        return self._pickled is None

    @property
    def is_quantized(self) -> bool:
        return self.quant_description is not None

    def identity(self) -> dict[str, Any]:
        """A cheap fingerprint of the input for manifests: config hash and the size of every weight file."""
        import hashlib

        return {"path": str(self.root.resolve()),
                "config_sha256": hashlib.sha256((self.root / "config.json").read_bytes()).hexdigest(),
                "files": {p.name: p.stat().st_size for p in self.files}}

    # ---- data -------------------------------------------------------------------------------------------------
    def load(self, name: str, dequantize: bool = False):
        """One tensor as a fresh torch tensor (a copy: the caller may modify it).

        dequantize=True turns an FP8 weight into BF16 using its `weight_scale_inv` (wherever that lives).
        """
        info = self.info(name)
        if self._pickled is not None:
            t = self._pickled[info.source].clone()
        else:
            t = self._read(info)
        if dequantize and info.dtype in FP8_DTYPES:
            scale_name = self.fp8_scales.get(name)
            if scale_name is None:
                raise UserError(f"FP8 weight {name} has no weight_scale_inv",
                                hint="the checkpoint is incomplete; a weight without its scale cannot be used")
            t = dequant_fp8_block(t, self._read(self.info(scale_name)), self.facts.fp8_block or (128, 128))
        return t

    def _read(self, info: TensorInfo):
        return self._reader.read(info)

    VIEWABLE = ("BF16", "F16", "F32")

    def view(self, name: str):
        """Read-only zero-copy view when the tensor lies as-is in a file (not FP8, not pickled), else `load()`.

        Never modify the result; call `release(name)` after use so its pages leave this process."""
        info = self.info(name)
        if self._pickled is not None or info.dtype not in self.VIEWABLE or info.numel == 0:
            return self.load(name, dequantize=True)
        return self._reader.view(info)

    def stored_view(self, name: str):
        """Read-only zero-copy view in the stored dtype, FP8 included (needs `readable_by_path`): a stripe-wise
        consumer (the FP8 cast) reads row blocks of it and calls `release_rows` after each, so the tensor is never
        whole in this process."""
        return self._reader.view(self.info(name))

    def iter_bytes(self, name: str, chunk: int | None = None):
        """The tensor's stored bytes in consecutive chunks (see `TensorReader.iter_bytes`; needs `readable_by_path`):
        a pass-through copy never holds more than one chunk, whatever the tensor's size."""
        if self._pickled is not None:
            raise RuntimeError("pickled checkpoints have no byte ranges to stream")
        return self._reader.iter_bytes(self.info(name), chunk)

    def release_rows(self, name: str, lo: int, hi: int) -> None:
        """Drop the pages of rows [lo, hi) of a viewed tensor from this process (a row-block consumer of `view`)."""
        if self._pickled is None:
            info = self.info(name)
            row = info.nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
            self._reader.release_range(info, lo * row, hi * row)

    def map_rows(self, name: str, lo: int, hi: int) -> None:
        """Map the pages of rows [lo, hi) of a viewed tensor in one call, before a row-block consumer reads them."""
        if self._pickled is None:
            info = self.info(name)
            row = info.nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
            self._reader.populate_range(info, lo * row, hi * row)

    def prefetch(self, name: str) -> None:
        """Ask the kernel to read a tensor ahead (the next one in a stream)."""
        if self._pickled is None:
            self._reader.advise(self.info(name), getattr(mmap, "MADV_WILLNEED", 3))

    def release(self, name: str) -> None:
        """Drop a viewed tensor's pages from this process (they stay in the page cache)."""
        if self._pickled is None:
            self._reader.advise(self.info(name), getattr(mmap, "MADV_DONTNEED", 4))

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- FP8 --------------------------------------------------------------------------------------------------
    def _pair_fp8_scales(self) -> dict[str, str]:
        """Every FP8 weight must have its `weight_scale_inv` of the block-grid shape; anything else is an error."""
        out = {}
        block = self.facts.fp8_block or (128, 128)
        for name, info in self.tensors.items():
            if info.dtype not in FP8_DTYPES:
                continue
            if self.quant_description is not None:
                continue  # an int8-style layout stores FP8 differently; not a block-scaled HF checkpoint
            scale = name + "_scale_inv" if name.endswith(".weight") else None
            if scale is None or scale not in self.tensors:
                raise UserError(f"FP8 weight {name} ({info.file.name}) has no {name}_scale_inv in {self.root}",
                                hint="the checkpoint is incomplete; copy every part listed in the index")
            shape = info.shape
            want = ((math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])) if len(shape) == 2 else
                    tuple(math.ceil(d / b) for d, b in zip(shape, block)))
            if self.tensors[scale].shape != want:
                raise UserError(f"{scale} has shape {list(self.tensors[scale].shape)}, expected {list(want)} for "
                                f"{list(info.shape)} in {block[0]}x{block[1]} blocks",
                                hint="the scale does not belong to this weight; the checkpoint is damaged")
            out[name] = scale
        return out


def read_config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        raise UserError(f"{root} has no config.json", hint="point --model at a HuggingFace model directory")
    return _read_json(path, hint="fix or re-download config.json")


def _read_quant_description(root: Path) -> dict[str, Any] | None:
    for name in QUANT_DESCRIPTIONS:
        path = root / name
        if path.is_file():
            return schemas.quant_description(path)
    return None


def _list_safetensors(root: Path) -> tuple[list[Path], dict[str, TensorInfo]]:
    """All tensors of a directory: through its index when there is one, else every *.safetensors file in it."""
    indexes = sorted(root.glob("*.safetensors.index.json"))
    entries: dict[str, TensorInfo] = {}
    headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def header(part: Path) -> tuple[int, dict[str, Any]]:
        if part not in headers:
            headers[part] = read_header(part)
        return headers[part]

    if indexes:
        index_path = indexes[0]
        weight_map = schemas.safetensors_index(
            schemas.read_json(index_path, "index", "fix or re-download the index"), index_path.name)
        parts: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for fname in set(weight_map.values()):
            if os.path.isabs(fname) or not is_within(root / fname, root):
                bad = next(k for k, v in weight_map.items() if v == fname)
                raise UserError(f"{index_path.name}: {bad} points to {weight_map[bad]!r}, outside the model directory",
                                hint="the index is damaged or crafted; dsconv only reads files inside the model dir")
            part = root / fname
            if not part.is_file():
                bad = next(k for k, v in weight_map.items() if v == fname)
                raise UserError(f"{index_path.name}: {bad} is in {fname}, which is missing",
                                hint="copy every part the index lists")
            parts[fname] = (part, *header(part))
        for name, fname in weight_map.items():
            part, start, h = parts[fname]
            e = h.get(name)
            if e is None:
                raise UserError(f"{index_path.name} lists {name} in {fname}, but that file does not hold it",
                                hint="the index and the parts disagree; re-download them")
            a, b = e["data_offsets"]
            entries[name] = TensorInfo(name, e["dtype"], tuple(e["shape"]), part, start + a, start + b, name)
        return sorted(headers), entries
    files = sorted(p for p in root.glob("*.safetensors") if is_within(p, root))
    for part in files:
        start, h = header(part)
        for name, e in h.items():
            if name in entries:
                raise UserError(f"tensor {name} is in both {entries[name].file.name} and {part.name}",
                                hint="remove the stray file or add an index")
            entries[name] = TensorInfo(name, e["dtype"], tuple(e["shape"]), part, start + e["data_offsets"][0],
                                       start + e["data_offsets"][1], name)
    return files, entries


def _normalise_fused(entries: dict[str, TensorInfo], family: Family, config: dict[str, Any]) -> dict[str, TensorInfo]:
    """Present 3-D fused experts (transformers' `fused_params`, gate+up [E, 2I, H] and down [E, H, I], or the family's
    own `disk_fused_params`) as the per-expert tensors of its table; each is a contiguous byte range of the fused
    tensor, so no copy."""
    params = family.disk_fused  # {"mlp.experts.gate_up_proj": ("gate", "up"), "mlp.experts.down_proj": ("down",)}
    ends = tuple("." + p for p in params)
    if not any(map(str.endswith, entries, repeat(ends))):
        return entries
    out: dict[str, TensorInfo] = {}
    for name, info in entries.items():
        param = next((p for p in params if name.endswith("." + p)), None)
        if param is not None:
            layer_prefix = name[: -len(param)]
            if len(info.shape) != 3:
                raise UserError(f"{name} has shape {list(info.shape)}; fused experts are 3-D [experts, out, in]",
                                hint="the checkpoint is damaged")
            n_exp, rows, cols = info.shape
            item = DTYPE_SIZES[info.dtype]
            per_expert = rows * cols * item
            part = rows // len(params[param])
            slots = [(slot, k * part, (k + 1) * part) for k, slot in enumerate(params[param])]
            for e in range(n_exp):
                for slot, r0, r1 in slots:
                    new = layer_prefix + family.expert_modules[slot].replace("{E}", str(e)) + ".weight"
                    start = info.start + e * per_expert + r0 * cols * item
                    out[new] = replace(info, name=new, shape=(r1 - r0, cols), start=start,
                                       end=start + (r1 - r0) * cols * item)
            continue
        for old, new in family.fused_renames.items():
            if f".{old}." in name and f".{new}." not in name:
                name = name.replace(f".{old}.", f".{new}.")
                info = replace(info, name=name)
        out[name] = info
    return out


def _load_pickled(files: list[Path]) -> dict[str, Any]:
    """Only with --allow-pickle, and even then through torch's weights-only unpickler (no code execution)."""
    import torch

    out: dict[str, Any] = {}
    for f in files:
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises many types for a bad/unsafe pickle
            raise UserError(f"{f.name} could not be loaded safely ({type(e).__name__})",
                            hint="convert it to safetensors with a trusted tool") from None
        if not isinstance(sd, dict):
            raise UserError(f"{f.name} does not hold a state dict", hint="convert it to safetensors")
        out.update(sd)
    return out


def open_input(path: Path | str | None = None, config: Path | str | None = None, allow_pickle: bool = False):
    """A Checkpoint, or a headers-only view synthesised from config.json alone (`--config`)."""
    if config is not None:
        return ConfigOnly.open(Path(config))
    return Checkpoint.open(Path(path), allow_pickle=allow_pickle)


class ConfigOnly:
    """The tensor list a config implies, without weights: inspect and shard plans work from it."""

    def __init__(self, path: Path, config: dict[str, Any], family: Family) -> None:
        self.root = path.parent
        self.config = config
        self.family = family
        self.facts = family.facts(config)
        self.quant_description = None
        specs = family.synthesize(config)
        self.tensors = {s.name: TensorInfo(s.name, s.dtype, s.shape, path, 0, s.nbytes, s.name) for s in specs}
        self.roles = {s.name: family.classify(s.name, self.facts) for s in specs}
        self.files: list[Path] = []
        self.fp8_scales = {n: n + "_scale_inv" for n in self.tensors if n + "_scale_inv" in self.tensors}

    @classmethod
    def open(cls, path: Path) -> "ConfigOnly":
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UserError(f"{path} does not exist", hint="pass the model's config.json with --config")
        config = read_config(path.parent) if path.name == "config.json" else _read_json(path)
        with gc_paused():
            return cls(path, config, family_for(config, where=str(path)))

    def names(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def role(self, name: str) -> TensorRole:
        return self.roles[name]

    readable_by_path = False  # no weights to read
    is_quantized = property(lambda self: self.quant_description is not None)

    def quantized_view(self, specs: list[Any], description: dict[str, Any]) -> "ConfigOnly":
        """The same model as a quantize output would store it: `specs` (TensorSpec, the output's tensors) and its
        description, for plans of an output not yet written (`shard --config --scheme`)."""
        import copy

        view = copy.copy(self)
        path = next(iter(self.tensors.values())).file
        view.tensors = {s.name: TensorInfo(s.name, s.dtype, s.shape, path, 0, s.nbytes, s.name) for s in specs}
        view.roles = {s.name: self.family.classify(s.name, self.facts) for s in specs}
        view.quant_description = description
        view.fp8_scales = {}
        return view


def _read_json(path: Path, hint: str = "pass a HF config.json") -> dict[str, Any]:
    """config.json (or a config given by --config): bounded parse, then every field a family reads checked."""
    data = schemas.read_json(path, "config", hint)
    model_type = data.get("model_type") if isinstance(data, dict) else None
    family = REGISTRY.get(model_type) if isinstance(model_type, str) else None
    flat = family.flat_config(data) if family is not None else data  # a VL config's text_config at the top
    schemas.config(flat, str(path), supported_model_types(), NOT_YET)
    schemas.model.config_fields(flat, str(path), family_for(data, where=str(path)).config_keys)
    return data
