"""`quantize --dtype bf16|fp16`: the checkpoint's float tensors cast to that dtype, into a scratch checkpoint that
quantize then reads (stage.py), so the output is byte for byte the two-step way's (`export --format safetensors
--dtype`, then `quantize`): MindIE runs bf16 and fp16 models only, and a float32 checkpoint needs no second command.

Streamed: one tensor at a time through the one writer. Float tensors (F32, BF16, F16) take the new dtype, rounded
to nearest even as torch casts; everything else (FP8 weights and their block scales, integers) is copied as stored,
for quantize to dequantize as it always does. config.json names the new dtype.
"""
from __future__ import annotations

from pathlib import Path

from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.io.writer import OutputDir
from dsconv.tensors import PRECISIONS, TensorSpec, config_with_dtype, torch_dtype

FLOATS = ("F32", "BF16", "F16")


def cast_checkpoint(model: Path, output: Path, dtype: str, progress: bool = True) -> Path:
    """`model` with every float tensor in `dtype` ("bf16" / "fp16") at `output` (a dsconv output, stage "cast")."""
    from tqdm import tqdm

    target = PRECISIONS[dtype]
    if target not in ("BF16", "F16"):
        raise UserError(f"--dtype {dtype}: quantize writes bf16 or fp16 models", hint="use --dtype bf16 or fp16")
    ck = Checkpoint.open(model)
    names = ck.names()
    out_dtype = {n: target if ck.info(n).dtype in FLOATS else ck.info(n).dtype for n in names}
    specs = [TensorSpec(n, out_dtype[n], tuple(ck.info(n).shape)) for n in names]
    with OutputDir(output, stage="cast", inputs=[model], force=True, input_identity=ck.identity(),
                   options={"dtype": dtype}) as out:
        ts = out.tensor_set(specs)
        for n in tqdm(names, desc=f"cast to {dtype}", unit="tensor", disable=not progress, leave=False):
            t = ck.load(n)
            ts.write(n, t.to(torch_dtype(target)) if out_dtype[n] != ck.info(n).dtype else t)
        # quantization_config stays: an FP8 checkpoint's block scales are copied for quantize to read
        out.write_json("config.json", config_with_dtype(ck.config, dtype))
        for f in ck.copy_files():
            if f.name != "config.json":
                out.copy_in(f)
    return output
