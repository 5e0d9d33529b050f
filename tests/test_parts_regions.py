"""PartWriter.write_regions: a slot filled from byte regions of source files (kernel copies for contiguous ranges,
window gathers for column slices, zeros), checked byte for byte against numpy and by the part's digest."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
from blake3 import blake3

from dsconv.io import parts
from dsconv.io.parts import PartLayout, PartWriter, Region, Slot, coalesce

pytestmark = pytest.mark.unit


def _source(tmp_path, rows=300, cols=40):
    a = np.random.default_rng(0).integers(0, 256, size=(rows, cols), dtype=np.uint8)
    f = tmp_path / "src.bin"
    f.write_bytes(b"HEAD" * 5 + a.tobytes())  # 20 bytes before the tensor: offsets are not aligned
    return a, str(f), 20


def _part(tmp_path, sizes):
    header = 16
    path = tmp_path / "part.bin"
    slots, pos = [], header
    for i, n in enumerate(sizes):
        slots.append(Slot(f"t{i}", pos, n))
        pos += n
    with open(path, "wb") as f:
        f.write(b"h" * header)
        f.truncate(pos)
    return PartLayout(str(path), header, tuple(slots), pos)


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "pread-pwrite-fallback"])
def test_regions_copy_gather_and_zero_with_the_whole_part_hashed(tmp_path, monkeypatch, kernel):
    if not kernel:
        def refuse(*a):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(parts.os, "copy_file_range", refuse)
    a, f, base = _source(tmp_path)
    cols = a.shape[1]
    # slot 0: rows 10..59 whole (one range), then a permutation's runs (3 runs), then a zero pad row
    perm = [100, 101, 102, 7, 8, 250]
    r0 = [Region(f, base + 10 * cols, 50 * cols), *[Region(f, base + r * cols, cols) for r in perm],
          Region(None, 0, cols)]
    want0 = a[10:60].tobytes() + a[perm].tobytes() + bytes(cols)
    # slot 1: a column slice (cols 8..24 of every row), then the whole tensor
    r1 = [Region(f, base + 8, 16, rows=a.shape[0], stride=cols), Region(f, base, a.size)]
    want1 = a[:, 8:24].tobytes() + a.tobytes()
    part = _part(tmp_path, [len(want0), len(want1)])
    w = PartWriter(part)
    w.write_regions("t0", r0)
    w.write_regions("t1", r1)
    digest = w.close()
    data = open(part.path, "rb").read()
    assert data[part.header:] == want0 + want1
    assert digest == blake3(data).hexdigest()


def test_gather_in_windows_smaller_than_the_slice(tmp_path):
    """A column slice bigger than one window goes through the reused buffer window by window."""
    a, f, base = _source(tmp_path, rows=1000, cols=64)
    r = Region(f, base + 5, 50, rows=1000, stride=64)
    got = b"".join(bytes(np.ascontiguousarray(c)) for c in parts.region_chunks(r, block=4096))
    assert got == a[:, 5:55].tobytes()


def test_coalesce_merges_adjacent_ranges_of_one_file_only():
    rs = coalesce([Region("x", 0, 10), Region("x", 10, 5), Region("y", 15, 5), Region("y", 30, 5),
                   Region("x", 0, 4, rows=3, stride=4), Region(None, 0, 3), Region("x", 50, 0)])
    assert rs == [Region("x", 0, 15), Region("y", 15, 5), Region("y", 30, 5), Region("x", 0, 12),
                  Region(None, 0, 3)]


def test_more_or_fewer_bytes_than_planned_fail(tmp_path):
    a, f, base = _source(tmp_path)
    part = _part(tmp_path, [100])
    w = PartWriter(part)
    with pytest.raises(ValueError, match="more than its planned"):
        w.write_regions("t0", [Region(f, base, 101)])
    w.abort()
    w = PartWriter(part)
    with pytest.raises(ValueError, match="99 bytes written, 100 planned"):
        w.write_regions("t0", [Region(f, base, 99)])
    w.abort()
    os.unlink(part.path)


def test_a_failed_hash_fails_the_write_instead_of_recording_a_partial_digest(tmp_path, monkeypatch):
    """The hash runs on a thread beside the copy and the pwrite; its error must reach the writer's caller."""
    a, f, base = _source(tmp_path)

    def broken(*args):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(parts, "hash_ranges", broken)
    part = _part(tmp_path, [a.size])
    w = PartWriter(part)
    with pytest.raises(OSError, match="Cannot allocate memory"):
        w.write_regions("t0", [Region(f, base, a.size)])
    w.abort()

    class Refusing:
        def update(self, data):
            raise MemoryError("hash")

    part = _part(tmp_path, [2**20])
    w = PartWriter(part)
    w._hash = Refusing()
    with pytest.raises(MemoryError):
        w.write_chunks("t0", [bytes(2**20)])  # >= 1 MiB: hashed on the thread
    w.abort()


@pytest.mark.parametrize("strided", [False, True], ids=["copy", "gather"])
def test_a_source_shorter_than_its_regions_is_an_error_naming_the_file(tmp_path, strided):
    """A source that shrank after its header was read (changed during the run): an OSError naming the file, which the
    CLI prints as one line and exit 2, never a traceback from mmap."""
    a, f, base = _source(tmp_path)
    r = Region(f, base, 16, rows=a.shape[0] + 5, stride=a.shape[1]) if strided else Region(f, base, a.size + 100)
    part = _part(tmp_path, [r.nbytes])
    w = PartWriter(part)
    with pytest.raises(OSError, match="shorter than its safetensors header") as e:
        w.write_regions("t0", [r])
    assert e.value.filename == f
    w.abort()


def test_behind_hash_follows_runs_finished_out_of_order(tmp_path):
    """A part filled in three runs by separate writers; the driver reports the runs as they finish (the last first):
    the digest is the whole file's, and nothing is hashed past a slot not yet written."""
    sizes = [3000, 5, 70000, 1, 4096, 12345]
    part = _part(tmp_path, sizes)
    rng = np.random.default_rng(1)
    data = {s.name: rng.integers(0, 256, s.nbytes, dtype=np.uint8) for s in part.slots}
    runs = [{"t0", "t1"}, {"t2", "t3"}, {"t4", "t5"}]
    h = parts.BehindHash(part)
    try:
        for run in (runs[2], runs[0], runs[1]):
            w = PartWriter(part.subset(run))
            for s in part.slots:
                if s.name in run:
                    w.write(s.name, data[s.name])
            assert w.close() is None  # a subset: its writer cannot hash the part
            h.wrote(run)
            if run is runs[2]:
                assert h._pos == part.header and not h.complete  # the header only: t0 is not written yet
        assert h.complete
        assert h.hexdigest() == blake3(open(part.path, "rb").read()).hexdigest()
    finally:
        h.close()


def test_a_set_adopting_runs_hashes_them_behind_and_around_the_drivers_own_writes(tmp_path, monkeypatch):
    """TensorSetWriter.adopt with no digest: the part is hashed behind the runs (never read back whole at close),
    the driver's own writes into the same part - before the first run and between runs - included."""
    from dsconv.io import writer
    from dsconv.tensors import TensorSpec

    sizes = [4096, 7, 65536, 3, 5000]
    specs = [TensorSpec(f"t{i}", "U8", (n,)) for i, n in enumerate(sizes)]
    ts = writer.TensorSetWriter(tmp_path, specs, "model", 1 << 30)
    rng = np.random.default_rng(2)
    data = {s.name: rng.integers(0, 256, s.nbytes, dtype=np.uint8) for s in specs}
    read_back = []
    monkeypatch.setattr(writer, "file_digest", lambda p: read_back.append(p) or "0" * 64)
    part = ts.layout()[0]
    ts.write("t3", data["t3"])                      # the driver's, before any run
    for run in ({"t4"}, {"t0", "t1"}):              # tasks' runs, the later one first
        w = PartWriter(part.subset(run))
        for s in part.slots:
            if s.name in run:
                w.write(s.name, data[s.name])
        ts.adopt(0, sorted(run), w.close())
    ts.write("t2", data["t2"])                      # the driver's, between runs
    assert ts._behind[0].complete
    digest = ts.close()["model.safetensors"]["blake3"]
    assert not read_back
    assert digest == blake3((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    from safetensors.numpy import load_file

    loaded = load_file(tmp_path / "model.safetensors")
    assert all(np.array_equal(loaded[k], v) for k, v in data.items())
