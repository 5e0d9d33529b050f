"""Everything MindSpore does for one export: build the network, export it, load the file back, run the check inputs.

Both steps run in-process for small models (MindSpore's import is most of their time) or each in its own child
process (`python -m dsconv.convert.ms_nets.worker export|run REQUEST.json`) for larger ones: MindSpore keeps a
network's parameters alive after `export` (its graph cache holds them), so only a process exit gives that memory
back; separate processes keep the peak at one copy of the model (plus MindSpore's overhead), prove the file loads
with no state from the export, and confine MindSpore's global context and working directory.
The caller compares the outputs with PyTorch; this module never imports a PyTorch model.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from dsconv.errors import DsconvError

RESULT = "result.json"
OUTPUTS = "outputs.npz"


def check_inputs(vocab: int, pad_id: int, max_len: int, seed: int = 1234) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The three check shapes (name, input_ids int64, attention_mask int64): batch 2 with row 1 left-padded,
    a single token, and a longer sequence (64 tokens, or max_position_embeddings if smaller)."""
    rng = np.random.default_rng(seed)
    out = []
    ids = rng.integers(0, vocab, (2, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # row 1: 7 tokens, left-padded to 12
    ids[1, :5] = pad_id
    out.append(("batch 2, left-padded", ids, mask))
    ids = rng.integers(0, vocab, (1, 1), dtype=np.int64)
    out.append(("single token", ids, np.ones_like(ids)))
    n = max(2, min(64, max_len))
    ids = rng.integers(0, vocab, (1, n), dtype=np.int64)
    out.append((f"{n} tokens", ids, np.ones_like(ids)))
    return out


def cases_for(config: dict[str, Any], vocab: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    pad_id = config.get("pad_token_id")
    pad_id = pad_id if isinstance(pad_id, int) and 0 <= pad_id < vocab else 0
    return check_inputs(vocab, pad_id, int(config.get("max_position_embeddings") or 64))


def mindir_files(directory: Path, stem: str = "model") -> tuple[Path, list[Path]]:
    """(the file to load, every path that belongs to the export): `stem.mindir`, or above ~1 GiB
    `stem_graph.mindir` plus the `stem_variables/` folder MindSpore writes next to it."""
    graph = directory / f"{stem}_graph.mindir"
    if graph.is_file():
        variables = directory / f"{stem}_variables"
        return graph, [graph] + ([variables] if variables.is_dir() else [])
    single = directory / f"{stem}.mindir"
    if single.is_file():
        return single, [single]
    raise FileNotFoundError(f"MindSpore wrote no {stem}.mindir in {directory}")


def require_mindspore() -> None:
    """A one-line UserError when MindSpore is not installed, without importing it (~0.4 GB and ~3 s)."""
    import importlib.util

    from dsconv.errors import UserError

    if importlib.util.find_spec("mindspore") is None:
        raise UserError("MindIR export needs MindSpore, which is not installed",
                        hint="pip install 'dsconv[mindir]' (mindspore>=2.6,<3 with numpy<2)")


def import_mindspore():
    """mindspore, imported quietly (GLOG_v=3 before the first import), or a one-line UserError."""
    from dsconv.errors import UserError

    os.environ.setdefault("GLOG_v", "3")
    try:
        import mindspore
    except ImportError:
        raise UserError("MindIR export needs MindSpore, which is not installed",
                        hint="pip install 'dsconv[mindir]' (mindspore>=2.6,<3 with numpy<2)") from None
    return mindspore


class graph_mode:
    """MindSpore's GRAPH_MODE for a block, the previous mode restored after."""

    def __init__(self, ms) -> None:
        self.ms = ms

    def __enter__(self) -> None:
        self.old = self.ms.get_context("mode")
        self.ms.set_context(mode=self.ms.GRAPH_MODE)

    def __exit__(self, *exc) -> None:
        self.ms.set_context(mode=self.old)


def build_and_export(model_dir: Path, dtype: str, export_dir: Path, allow_pickle: bool = False) -> dict[str, Any]:
    """Build the network from the checkpoint (one tensor at a time) and `mindspore.export` it into `export_dir`
    with dynamic batch and sequence. Returns figures (parameter bytes, linear weight kinds, seconds)."""
    from tqdm import tqdm

    from dsconv.checkpoint import Checkpoint

    ck = Checkpoint.open(model_dir, allow_pickle=allow_pickle)  # bad input fails before MindSpore's slow import
    ms = import_mindspore()
    from mindspore import Tensor

    from dsconv.convert.ms_nets import build_net
    from dsconv.model.ms.weights import Precision

    t = time.perf_counter()
    bar = tqdm(total=ck.facts.num_layers, desc="mindir: layers", unit="layer", disable=None, leave=False)
    try:
        net, ws = build_net(ck, Precision(dtype), progress=lambda i: bar.update(1))
    finally:
        bar.close()
    build_s = time.perf_counter() - t
    figures: dict[str, Any] = {"parameter_bytes": ws.param_bytes, "linear_weights": dict(ws.linear_kinds),
                               "mtp_tensors_skipped": ws.skipped_mtp()}
    ck.close()
    t = time.perf_counter()
    ids = Tensor(shape=[None, None], dtype=ms.int64)
    mask = Tensor(shape=[None, None], dtype=ms.int64)
    with graph_mode(ms):
        ms.export(net, ids, mask, file_name=str(export_dir / "model"), file_format="MINDIR")
    export_s = time.perf_counter() - t
    del net, ws
    gc.collect()
    graph_file, written = mindir_files(export_dir)
    figures.update({"graph_file": graph_file.name, "written": [p.name for p in written],
                    "seconds": {"build": round(build_s, 3), "export": round(export_s, 3)},
                    "peak_rss_bytes": peak_rss_bytes()})
    return figures


def load_and_run(graph_file: Path, cases: list[tuple[str, np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """`mindspore.load` + `nn.GraphCell` on the exported file, run on every check case: the logits and seconds."""
    from mindspore import Tensor, nn

    ms = import_mindspore()
    t = time.perf_counter()
    outputs, run_s = [], []
    with graph_mode(ms):
        cell = nn.GraphCell(ms.load(str(graph_file)))
        load_s = time.perf_counter() - t
        for _, ids, mask in cases:
            t1 = time.perf_counter()
            outputs.append(cell(Tensor(ids), Tensor(mask)).asnumpy())
            run_s.append(round(time.perf_counter() - t1, 4))
    del cell
    gc.collect()
    return {"outputs": outputs, "load_s": round(load_s, 3), "mindspore_run_s": run_s,
            "peak_rss_bytes": peak_rss_bytes()}


from dsconv.runtime.process import peak_rss_bytes  # noqa: E402,F401


def main(argv: list[str]) -> int:
    """Child entry: `export REQUEST.json` or `run REQUEST.json`. The request names model_dir, dtype, export_dir,
    allow_pickle, graph_file and out_dir; result.json (figures, or the DsconvError to re-raise) and, for `run`,
    outputs.npz are written into out_dir."""
    step, request = argv[0], json.loads(Path(argv[1]).read_text())
    out_dir = Path(request["out_dir"])
    try:
        if step == "export":
            figures = build_and_export(Path(request["model_dir"]), request["dtype"], Path(request["export_dir"]),
                                       bool(request["allow_pickle"]))
        else:
            from dsconv.checkpoint import read_config

            config = read_config(Path(request["model_dir"]))
            figures = load_and_run(Path(request["graph_file"]), cases_for(config, int(request["vocab"])))
            np.savez(out_dir / OUTPUTS, *figures.pop("outputs"))
    except DsconvError as e:
        (out_dir / RESULT).write_text(json.dumps({"error": {"kind": type(e).__name__, "message": e.message,
                                                           "hint": e.hint, "details": e.details}}))
        return 2
    (out_dir / RESULT).write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
