"""ONNX external data: the one writer of tensor bytes beside a model file, and the one reader of where they are.

Used by `export` (model.onnx_data, 4 KiB-aligned offsets so onnxruntime can map each tensor), its bf16 check twin,
and `atc --cast-fp16` (model_fp16.onnx.data). Bytes go out with pwrite straight from the caller's buffers (a tensor's
own memory, or one chunk of it), so no path ever holds a second copy of the weights. Cheap to import (no torch).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from onnx import ModelProto, TensorProto

#: like onnx.save_model's size_threshold: tensors under 1 KiB stay inside the model file
EMBED_BELOW = 1024


def opset_of(model: ModelProto) -> int:
    """The model's default-domain (ai.onnx) opset, 0 when it declares none; the one lookup convert and atc share."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def external_location(t: TensorProto) -> tuple[str | None, int, int | None] | None:
    """(location, offset, length) of an external tensor, else None; a key the file leaves out is None (offset 0)."""
    if t.data_location != TensorProto.EXTERNAL:
        return None
    e = {x.key: x.value for x in t.external_data}
    return e.get("location"), int(e.get("offset", 0)), int(e["length"]) if "length" in e else None


class ExternalDataWriter:
    """Appends tensors to one external data file and points each TensorProto at its bytes.

    `align`: every tensor starts at a multiple of it (zero padding between tensors; 1 packs them).
    """

    def __init__(self, path: Path, align: int = 1) -> None:
        self.path = Path(path)
        self.location = self.path.name
        self.align = align
        self.offset = 0
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, t: TensorProto, buffers: Iterable) -> None:
        """Write `buffers` (bytes-like, in order) as the data of `t`; `t` becomes an external tensor."""
        assert self._fd is not None, "writer is closed"
        pad = -self.offset % self.align
        if pad:
            os.pwrite(self._fd, b"\0" * pad, self.offset)
            self.offset += pad
        start = self.offset
        for buf in buffers:
            view = memoryview(buf).cast("B")
            done = 0
            while done < view.nbytes:
                done += os.pwrite(self._fd, view[done:], self.offset + done)
            self.offset += view.nbytes
            del view
        t.ClearField("raw_data")
        del t.external_data[:]
        for key, value in (("location", self.location), ("offset", str(start)), ("length", str(self.offset - start))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        t.data_location = TensorProto.EXTERNAL

    def close(self, fsync: bool = False) -> None:
        if self._fd is not None:
            try:
                if fsync:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "ExternalDataWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
