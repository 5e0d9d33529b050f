"""The one writer: size-capped safetensors parts, their index, and a manifest, committed atomically.

Why it plans first: a safetensors header lists every tensor's byte range before the data, so a streaming writer must
know the names, dtypes and shapes of a part before its first byte. Stages know them from headers (plan from headers,
then stream), hand them to `OutputDir.tensor_set(specs)`, then `write(name, tensor)` one tensor at a time; nothing
holds more than the tensor being written.

Why a temporary sibling: everything is written to `.NAME.dsconv-tmp` next to the destination and renamed into place
only when complete, so a crash never leaves a half-written output that a rerun could trust; a rerun removes the stale
temporary directory.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from dsconv import __version__, schemas
from dsconv.errors import UserError, raise_if_interrupted
from dsconv.io.digest import entry, file_digest, new_hash, recorded
from dsconv.io.parts import DURABLE, BehindHash, Known, PartLayout, Slot, put_chunks
from dsconv.runtime.threads import ordered_map
from dsconv.tensors import TensorSpec, is_within, safetensors_dtype

MANIFEST = "dsconv_manifest.json"
DEFAULT_MAX_SHARD_SIZE = 4 * 1000**3  # the official tools' "4GB"


def _as_bytes(tensor: Any) -> memoryview:
    """A zero-copy byte view of a contiguous torch tensor or numpy array."""
    if isinstance(tensor, np.ndarray):
        return memoryview(np.ascontiguousarray(tensor)).cast("B")
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def _header_bytes(entries: dict[str, Any]) -> bytes:
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte alignment of the data, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


class TensorSetWriter:
    """One set of size-capped safetensors parts (`PREFIX-0000i-of-0000N.safetensors` + index, or one file).

    Parts are laid out when the set is created, so every part's header is known and written up front; `write()`
    then puts each tensor's bytes at its offset (any order), hashing on the fly while tensors arrive in order.
    """

    def __init__(self, root: Path, specs: Sequence[TensorSpec], prefix: str, max_shard_size: int,
                 metadata: dict[str, str] | None = None, index_name: str | None = None) -> None:
        self.root = root
        self.prefix = prefix
        self.specs = {s.name: s for s in specs}
        if len(self.specs) != len(specs):
            dup = next(s.name for s in specs if sum(t.name == s.name for t in specs) > 1)
            raise ValueError(f"tensor {dup} planned twice")
        parts: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            if parts[-1] and size + spec.nbytes > max_shard_size:
                parts.append([])
                size = 0
            parts[-1].append(spec)
            size += spec.nbytes
        n = len(parts)
        self.files: list[str] = (
            [f"{prefix}.safetensors"] if n == 1 else [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.index_name = index_name or f"{prefix}.safetensors.index.json"
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (part, absolute offset, nbytes)
        self._fds: list[int] = []
        self._hash: list[Any] = []
        self._cursor: list[int] = []  # next in-order offset per part (for incremental hashing)
        self._sizes: list[int] = []
        self._written: set[str] = set()
        self._behind: dict[int, BehindHash] = {}  # parts tasks fill in runs, hashed behind them (see `adopt`)
        self._slots: list[tuple[Slot, ...]] = []  # per part, in file order
        for i, part in enumerate(parts):
            entries: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
            offset = 0
            for spec in part:
                entries[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                                      "data_offsets": [offset, offset + spec.nbytes]}
                offset += spec.nbytes
            header = _header_bytes(entries)
            path = root / self.files[i]
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, header)
            os.ftruncate(fd, len(header) + offset)
            for spec in part:
                start = len(header) + entries[spec.name]["data_offsets"][0]
                self._where[spec.name] = (i, start, spec.nbytes)
            self._slots.append(tuple(Slot(spec.name, self._where[spec.name][1], spec.nbytes) for spec in part))
            self._fds.append(fd)
            h = new_hash()
            h.update(header)
            self._hash.append(h)
            self._cursor.append(len(header))
            self._sizes.append(len(header) + offset)

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for s in self.specs.values())

    def write(self, name: str, tensor: Any) -> None:
        """Write one planned tensor; its dtype and shape must be the planned ones."""
        self.write_chunks(name, (_as_bytes(tensor),), safetensors_dtype(tensor), tuple(tensor.shape))

    def write_chunks(self, name: str, chunks: Iterable[Any], dtype: str | None = None,
                     shape: tuple[int, ...] | None = None) -> None:
        """Write one planned tensor from consecutive byte chunks (any buffer: memoryview, numpy, bytes), so that
        no caller has to hold a whole tensor: a pass-through embedding streams from the input's mmap, a quantized
        linear one row block at a time. Chunks arriving in file order are hashed on the fly. `dtype` and `shape`,
        when given, must be the planned ones; the byte count always must."""
        spec = self.specs.get(name)
        if spec is None:
            raise ValueError(f"tensor {name} was not planned for {self.prefix}")
        if name in self._written:
            raise ValueError(f"tensor {name} written twice")
        dtype = spec.dtype if dtype is None else dtype
        shape = spec.shape if shape is None else shape
        if dtype != spec.dtype or tuple(shape) != spec.shape:
            raise ValueError(f"tensor {name}: planned {spec.dtype}{list(spec.shape)}, got {dtype}{list(shape)}")
        part, offset, nbytes = self._where[name]
        fd = self._fds[part]
        in_order = self._cursor[part] == offset and self._hash[part] is not None
        # the hash and pwrite both release the GIL: a big chunk is hashed and half-written on helper threads while
        # it is written (io.parts.put), so the lot costs the slowest of them instead of their sum
        pos = put_chunks(fd, chunks, offset, nbytes, name, self._hash[part].update if in_order else None)
        if pos != offset + nbytes:
            raise ValueError(f"tensor {name}: {pos - offset} bytes written, {nbytes} planned")
        if in_order:
            self._cursor[part] += nbytes
        else:
            self._hash[part] = None  # out of order: hash by reading back at close
        self._written.add(name)
        if part in self._behind:
            self._behind[part].wrote((name,))

    def layout(self) -> list["PartLayout"]:
        """Each part as a task may write it on its own (another process or host): path, header length, slots."""
        return [self._layout(i) for i in range(len(self.files))]

    def _layout(self, i: int) -> "PartLayout":
        return PartLayout(str(self.root / self.files[i]), self._cursor[i] if self._hash[i] is not None else 0,
                          self._slots[i], self._sizes[i])

    def adopt(self, part: int, names: Sequence[str], digest: str | None) -> None:
        """Tensors a task wrote into part `part` (see `layout`); `digest` of the whole part when the task wrote all
        of it in order, else None. A part filled in runs (several tasks, or tasks and the driver's own `write`) is
        hashed behind them by a helper thread (io.parts.BehindHash) as far as its slots are written in order, so
        close() is left the last run's bytes to hash, not the part's: 2.5 s on one core for a 3.3 GB part."""
        for name in names:
            if name in self._written or self._where[name][0] != part:
                raise ValueError(f"tensor {name} adopted twice or into the wrong part")
        if digest:
            self._written.update(names)
            self._hash[part] = Known(digest)
            return
        h = self._behind.get(part)
        if h is None:
            h = self._behind[part] = BehindHash(self._layout(part))
            self._hash[part] = None  # the driver's later writes stop hashing in order: the helper has the part
            # slots the driver wrote before: on disk already, hashed from the file like the tasks'
            h.wrote(sl.name for sl in self._slots[part] if sl.name in self._written)
        self._written.update(names)
        h.wrote(names)

    def close(self) -> dict[str, dict[str, Any]]:
        """Check completeness, close the parts, write the index; return {relative file: io.digest.entry}."""
        missing = [n for n in self.specs if n not in self._written]
        if missing:
            raise RuntimeError(f"{len(missing)} planned tensors never written, e.g. {missing[0]}")
        out: dict[str, dict[str, Any]] = {}
        for i, fd in enumerate(self._fds):
            if DURABLE:
                os.fsync(fd)
            os.close(fd)
            path = self.root / self.files[i]
            behind = self._behind.pop(i, None)
            if behind is not None:
                digest = behind.hexdigest()  # complete: every planned tensor was written (checked above)
                behind.close()
            else:
                digest = self._hash[i].hexdigest() if self._hash[i] is not None else file_digest(path)
            out[self.files[i]] = entry(digest, self._sizes[i])
        self._fds = []
        if len(self.files) > 1:
            weight_map = {name: self.files[part] for name, (part, _, _) in self._where.items()}
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (self.root / self.index_name).write_text(json.dumps(index, indent=2) + "\n")
        return out

    def abort(self) -> None:
        for h in self._behind.values():
            h.close()
        self._behind = {}
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def versions() -> dict[str, str]:
    """Versions of the libraries that shaped an output (recorded in every manifest)."""
    import importlib.metadata as md

    out = {"dsconv": __version__, "python": platform.python_version()}
    for pkg in ("torch", "numpy", "safetensors", "transformers", "onnx", "onnxruntime", "mindspore"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


class OutputDir:
    """A stage's output directory as one transaction: temp sibling -> files -> manifest -> rename.

    Refuses to write into (or inside) the input directory, and over an existing directory that is not a dsconv
    output (`force` replaces a previous dsconv output). Use as a context manager; an exception discards everything.
    """

    def __init__(self, final: Path | str, *, stage: str, inputs: Iterable[Path | str] = (), force: bool = False,
                 options: dict[str, Any] | None = None, input_identity: dict[str, Any] | None = None) -> None:
        self.final = Path(final).absolute()
        self.stage = stage
        self.inputs = [Path(p).absolute() for p in inputs]
        self.force = force
        self.options = options or {}
        self.input_identity = input_identity or {}
        self._sets: list[tuple[str, TensorSetWriter]] = []
        self._hashes: dict[str, dict[str, Any]] = {}
        self._planned = 0
        self.tmp = self.final.parent / f".{self.final.name}.dsconv-tmp"
        self.old = self.final.parent / f".{self.final.name}.dsconv-old"
        try:
            self._recover()
        except OSError as e:
            raise output_error(e, self.final) from None
        for inp in self.inputs:
            if is_within(self.final, inp) or is_within(inp, self.final):
                raise UserError(f"output {self.final} overlaps input {inp}",
                                hint="choose an output directory outside the input (inputs are never modified)")
        if self.final.exists():
            if not self.final.is_dir() or not (self.final / MANIFEST).is_file():
                if self.final.is_dir() and not any(self.final.iterdir()):
                    pass  # an empty directory is fine to replace
                else:
                    raise UserError(f"{self.final} exists and is not a dsconv output",
                                    hint="choose another --output; dsconv only replaces what it wrote")
            elif not force:
                raise UserError(f"{self.final} already holds a dsconv output", hint="pass --force to replace it")

    def _recover(self) -> None:
        """Leftovers of a run killed mid-commit: an old output set aside comes back if nothing replaced it, else
        goes. (A half-written temporary directory goes when the next transaction opens.)"""
        if self.old.is_dir() and (self.old / MANIFEST).is_file() and not self.final.exists():
            self.old.rename(self.final)
        if self.old.exists():
            shutil.rmtree(self.old)

    def __enter__(self) -> "OutputDir":
        try:
            if self.final.parent.exists() and not self.final.parent.is_dir():
                raise UserError(f"cannot write {self.final}: {self.final.parent} is a file, not a directory",
                                hint="choose an --output whose parent is a directory")
            self.final.parent.mkdir(parents=True, exist_ok=True)
            if self.tmp.exists():  # a previous run crashed: never trust what it left
                shutil.rmtree(self.tmp)
            self.tmp.mkdir()
        except OSError as e:
            raise output_error(e, self.final) from None
        except BaseException:  # Ctrl-C right after the mkdir: __exit__ will not run, so discard here
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
                return
            except BaseException as e:  # a full disk at the manifest, Ctrl-C during the hashes: nothing was written
                exc = e
        self._discard()
        if isinstance(exc, OSError):
            raise output_error(exc, self.final) from None
        if exc_type is None:
            raise exc

    def _discard(self) -> None:
        for _, ts in self._sets:
            ts.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def path(self) -> Path:
        """Where files go while the transaction is open."""
        return self.tmp

    def tensor_set(self, specs: Sequence[TensorSpec], prefix: str = "model", subdir: str = "",
                   max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, metadata: dict[str, str] | None = None,
                   index_name: str | None = None) -> TensorSetWriter:
        self._planned += sum(s.nbytes for s in specs)
        check_free_space(self.tmp, self._planned, self.final)
        ts = TensorSetWriter(self.tmp / subdir if subdir else self.tmp, specs, prefix, max_shard_size, metadata,
                             index_name)
        self._sets.append((subdir, ts))
        return ts

    def write_json(self, relpath: str, obj: Any) -> Path:
        path = self.tmp / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        return path

    def write_text(self, relpath: str, text: str) -> Path:
        path = self.tmp / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def copy_in(self, src: Path, relpath: str | None = None) -> Path:
        dst = self.tmp / (relpath or src.name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        return dst

    def commit(self) -> None:
        raise_if_interrupted()  # a Ctrl-C that reached no `except` (swallowed in a callback) still discards
        for subdir, ts in self._sets:
            for rel, info in ts.close().items():
                self._hashes[str(Path(subdir) / rel) if subdir else rel] = info
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(self.tmp.rglob("*")):
            if path.is_file() and path.name != MANIFEST:
                rel = path.relative_to(self.tmp).as_posix()
                files[rel] = self._hashes.get(rel) or entry(file_digest(path), path.stat().st_size)
        manifest = {
            "tool": "dsconv", "stage": self.stage, "command": sys.argv, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                               time.gmtime()),
            "inputs": [str(p) for p in self.inputs], "input_identity": self.input_identity,
            "options": self.options, "versions": versions(), "files": files,
        }
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        if not self.final.exists():
            self.tmp.rename(self.final)
        elif exchange(self.tmp, self.final):  # one atomic step: the old output is at tmp now
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:  # no RENAME_EXCHANGE here: set the old aside; a crash in between is undone by the next run
            self.final.rename(self.old)
            self.tmp.rename(self.final)
            shutil.rmtree(self.old, ignore_errors=True)


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE) (Linux >= 3.15, glibc >= 2.28); False where the
    call or the file system does not support it."""
    import ctypes
    import errno

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


MARGIN = 2**20  # headers, indexes, manifests and copied tokenizer files on top of the tensors


def check_free_space(where: Path, planned: int, final: Path) -> None:
    """Refuse to start writing what cannot fit: pre-sized parts would otherwise fail with ENOSPC half-way."""
    free = free_bytes(where)
    if planned + MARGIN > free:
        raise UserError(f"not enough space for {final}: the output needs {planned + MARGIN:,} bytes, "
                        f"{free:,} are free on its file system", hint="free space or choose another --output")


def output_error(e: OSError, final: Path) -> UserError:
    """An OS error while writing an output, as one line: the path, the OS's reason, and what to do."""
    reason = (e.strerror or type(e).__name__).lower()
    path = e.filename or final
    hint = {28: "free space or choose another --output", 122: "free space or choose another --output",
            13: "choose an --output you may write to", 1: "choose an --output you may write to",
            30: "choose an --output on a writable file system"}.get(e.errno or 0, "check the --output path")
    return UserError(f"cannot write {final}: {path}: {reason}", hint=hint)


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise UserError(f"{directory} has no {MANIFEST}", hint="verify only works on directories dsconv wrote")
    return schemas.manifest(path)


def verify_files(directory: Path) -> list[str]:
    """Re-check every digest and size in a manifest; return the problems (empty when intact)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    problems = []
    listed = set(manifest["files"])
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST and not path.is_dir() and rel not in listed:
            problems.append(f"{rel}: not in the manifest (added after the stage wrote the directory)")
    found: dict[str, str | None] = {}  # in the manifest's order
    to_hash = []
    for rel, info in manifest["files"].items():
        path = directory / rel
        found[rel] = None
        if not is_within(path, directory):
            found[rel] = f"{rel}: path escapes the directory"
        elif not path.is_file():
            found[rel] = f"{rel}: missing"
        elif (size := path.stat().st_size) != info["size"]:
            found[rel] = f"{rel}: size {size}, manifest says {info['size']}"
        else:
            to_hash.append((rel, path, *recorded(info)))
    # one file per thread (the hash releases the GIL): DeepSeek-R1's 163 parts on every core, not one after another
    digests = ordered_map(lambda job: file_digest(job[1], job[2]), to_hash, min(len(to_hash), os.cpu_count() or 1))
    for (rel, _, algorithm, expected), got in zip(to_hash, digests):
        if got != expected:
            found[rel] = f"{rel}: {algorithm} differs from the manifest"
    return problems + [p for p in found.values() if p is not None]
