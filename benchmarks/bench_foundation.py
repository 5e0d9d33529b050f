"""Foundation figures: header listing of the full DeepSeek-V3 layout (163 sparse files, 91,991 tensors, 688 GB
announced), and `Checkpoint.load()` throughput against plain reads of the same bytes (ratio), with peak RSS."""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from benchmarks.common import CHILD_PEAK, run_measured, save, scratch

CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "deepseek_v3_config.json"


def write_sparse_deepseek(root: Path, parts: int = 163) -> int:
    """The real tensor list (from the family's synthesis) in `parts` files whose data regions are sparse holes."""
    from dsconv.families import family_for

    cfg = json.loads(CONFIG.read_text())
    specs = family_for(cfg).synthesize(cfg)
    per = math.ceil(len(specs) / parts)
    weight_map = {}
    for i in range(parts):
        chunk = specs[i * per:(i + 1) * per]
        name = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for s in chunk:
            header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
            off += s.nbytes
            weight_map[s.name] = name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / name, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + off)  # sparse: no data blocks on disk
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(CONFIG, root / "config.json")
    return len(specs)


def bench_listing() -> dict:
    root = scratch("dsconv-ds-sparse-")
    try:
        n = write_sparse_deepseek(root)
        code = CHILD_PEAK + """
import sys, time
t = time.perf_counter()
from dsconv.checkpoint import Checkpoint
t_import = time.perf_counter() - t
t = time.perf_counter()
ck = Checkpoint.open(sys.argv[1])
t_open = time.perf_counter() - t
print(json.dumps({"tensors": len(ck), "files": len(ck.files), "bytes": sum(i.nbytes for i in ck.tensors.values()),
                  "open_s": t_open, "import_s": t_import, "peak_rss_bytes": peak_rss_bytes()}))
"""
        runs = [run_measured(code, str(root)) for _ in range(3)]
        best = min(runs, key=lambda r: r["open_s"])
        return {"tensors": n, "files": best["files"], "announced_bytes": best["bytes"],
                "open_s_best_of_3": round(best["open_s"], 3), "open_s_runs": [round(r["open_s"], 3) for r in runs],
                "peak_rss_mib": round(best["peak_rss_bytes"] / 2**20, 1)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bench_load(total_gb: float = 2.0, tensor_mb: int = 64) -> dict:
    """load() of every tensor vs os.pread of the same byte ranges, both from the page cache (warm), same process."""
    import numpy as np
    from safetensors.numpy import save_file

    root = scratch("dsconv-load-")
    try:
        n = int(total_gb * 1024 / tensor_mb)
        rows = tensor_mb * 2**20 // (4096 * 2)
        cfg = {"model_type": "llama", "num_hidden_layers": n, "hidden_size": 4096, "vocab_size": 8,
               "num_attention_heads": 32, "intermediate_size": rows}
        (root / "config.json").write_text(json.dumps(cfg))
        rng = np.random.default_rng(0)
        block = rng.standard_normal((rows, 4096), dtype=np.float32).astype(np.float16)
        per_file = 8
        for f in range(math.ceil(n / per_file)):
            save_file({f"model.layers.{i}.mlp.up_proj.weight": block for i in range(f * per_file,
                                                                                      min(n, (f + 1) * per_file))},
                      str(root / f"part-{f:03d}.safetensors"))
        code = CHILD_PEAK + """
import os, sys, time
from dsconv.checkpoint import Checkpoint
ck = Checkpoint.open(sys.argv[1])
infos = list(ck.tensors.values())
def plain():
    total = 0
    for info in infos:
        fd = os.open(info.file, os.O_RDONLY)
        buf = bytearray(info.nbytes)
        os.preadv(fd, [buf], info.start)
        os.close(fd)
        total += len(buf)
    return total
def via_load():
    total = 0
    for info in infos:
        t = ck.load(info.name)
        total += t.numel() * t.element_size()
    return total
plain(); via_load()  # warm the page cache
res = {}
for label, fn in (("plain", plain), ("load", via_load)):
    best = 1e9
    for _ in range(3):
        t = time.perf_counter(); nbytes = fn(); best = min(best, time.perf_counter() - t)
    res[label + "_gbps"] = nbytes / best / 1e9
res["bytes"] = nbytes
res["peak_rss_bytes"] = peak_rss_bytes()
print(json.dumps(res))
"""
        r = run_measured(code, str(root))
        return {"checkpoint_gb": round(r["bytes"] / 1e9, 2), "tensor_mib": tensor_mb,
                "plain_read_gbps": round(r["plain_gbps"], 2), "load_gbps": round(r["load_gbps"], 2),
                "ratio_load_vs_plain": round(r["load_gbps"] / r["plain_gbps"], 2),
                "peak_rss_mib": round(r["peak_rss_bytes"] / 2**20, 1)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    save("foundation", {"header_listing_deepseek_v3": bench_listing(), "load_throughput": bench_load()})


if __name__ == "__main__":
    main()
