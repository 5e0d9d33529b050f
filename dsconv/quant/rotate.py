"""`dsconv rotate`: the residual stream rotated by an orthogonal matrix, folded into the weights (QuaRot).

Why: a few residual channels carry activations 100x the others (outliers), and one int8 scale per token or per
tensor must cover them, so every other channel is quantized coarsely. With the residual stream multiplied by an
orthogonal Q (h' = h Q), each channel becomes an even mix of all of them (a Hadamard Q spreads one outlier channel
at 1/sqrt(n) over every channel), and the model computes the same function:
- each RMSNorm that feeds linears has its scale folded into their input columns (W diag(g)) and becomes all-ones
  (stored as 1 - norm_offset): an RMSNorm without a scale commutes with Q (||h Q|| = ||h||);
- the embedding and every linear that reads the residual take Q on their input side (E Q, W diag(g) Q);
- every linear that writes the residual (o_proj, down_proj, experts' down, out_proj) takes Q^T on its output side
  (Q^T W);
- each attention head's v rows take a rotation R of the head width and o_proj's columns of that head R (o_proj
  reads a weighted sum of v rows per head), where v and o are rows of their own and no gate sits between;
- everything else inside a block (q/k biases, per-head norms, latent projections, the DeltaNet mixer) is unchanged.
The engines load the result as any float checkpoint; a tied LM head becomes untied (E Q vs E diag(g_final) Q).

The rules are one table (families/residual.py: READS, WRITES, INSIDE) keyed by the family tables' row keys: a
family with a row the table does not name is refused, as are families whose blocks normalise their output before the residual add (Gemma 3:
`Family.rotation_refused`) and MTP layers (not yet). The output streams one tensor at a time through the one writer;
its manifest records the rotation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.families.residual import FOLDED, INSIDE, KNOWN, READER_NORM, WRITES
from dsconv.families.roles import Category
from dsconv.io.writer import OutputDir
from dsconv.quant.algorithms.hadamard import Rotation
from dsconv.tensors import TensorSpec, torch_dtype



def refusal(ck: Any) -> str | None:
    """Why this checkpoint cannot be rotated offline, or None."""
    fam = ck.family
    if fam.rotation_refused:
        return fam.rotation_refused
    if fam.quantize_refused:  # rotation serves quantization; its output is written per expert as quantize writes
        return f"it is not quantized for an engine ({fam.quantize_refused})"
    if ck.facts.num_mtp_layers or any(r.category is Category.MTP for r in ck.roles.values()):
        return ("its MTP layers read two streams through eh_proj / fc (the embedding's and the hidden state's, each "
                "behind its own norm); dsconv does not rotate MTP layers yet")
    rows = {fam.template_of(n)[0] for n, r in ck.roles.items() if not r.is_aux}
    for row in fam.table:
        if row.module in rows and row.key not in KNOWN:
            return f"its {row.key} tensors ({row.name}) have no rotation rule (dsconv/families/residual.py)"
    if fam.tower_prefixes and any(n.startswith(fam.tower_prefixes) for n in ck.tensors):
        return "its vision tower writes into the text model's embedding stream; dsconv does not rotate it yet"
    return None


@dataclass
class RotateRequest:
    model: Path
    output: Path
    seed: int = 0
    force: bool = False
    progress: bool = True


@dataclass
class RotateResult:
    summary: dict[str, Any]

    def render(self) -> str:
        s = self.summary
        return (f"rotated {s['family']} -> {s['output']}: residual width {s['hidden_size']}, {s['rotation']} "
                f"(seed {s['seed']}); {s['read']} reading and {s['written']} writing linears, {s['folded']} norms "
                f"folded{', LM head untied' if s['untied'] else ''}; {s['seconds']:.1f} s")


class Rotator:
    """The transform of one tensor, given its row key and the scales of the norms of its layer."""

    def __init__(self, ck: Any, seed: int) -> None:
        self.ck, self.family, self.facts = ck, ck.family, ck.facts
        self.q = Rotation(self.facts.hidden_size, seed)
        self.offset = float(self.family.norm_offset)
        self.counts = {"read": 0, "written": 0, "folded": 0, "heads": 0}
        self._scales: dict[str, torch.Tensor] = {}
        f = self.facts
        # per head between v_proj and o_proj (o_proj's input is a weighted sum of v rows per head, so a rotation of
        # each head's v rows comes out of the attention unchanged and folds into o_proj's columns): where v and o are
        # their own rows (not MLA's kv_b) and no elementwise gate sits between (Qwen3-Next's gated attention)
        per_head = self.family.has("attn.v") and self.family.has("attn.o") and not f.is_mla and \
            not f.attn_output_gate and f.v_head_dim == f.head_dim
        self.head = Rotation(f.head_dim, seed) if per_head else None

    def key(self, name: str) -> str:
        """The table row of `name`, by its module and its parameter (a bias is a row of its own)."""
        return self.family.row_key(name)

    def norm_scale(self, name: str) -> torch.Tensor:
        """A norm's effective scale, read once: every reader of that norm (all of a layer's experts) folds it."""
        if name not in self._scales:
            self._scales[name] = self.ck.load(name, dequantize=True).float() + self.offset
        return self._scales[name]

    def norm_names(self, names: list[str]) -> dict[str, str]:
        """norm key -> tensor name, for the folded norms among `names` (one layer's, or the final one)."""
        return {key: n for n in names if (key := self.key(n)) in FOLDED}

    def transform(self, name: str, norms: dict[str, str]) -> torch.Tensor:
        """The rotated tensor `name` (its dtype kept); `norms`: norm key -> tensor name in the same layer."""
        t = self.ck.load(name, dequantize=True)
        dtype = t.dtype if t.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch_dtype(self.facts.dtype)
        key, param = self.key(name), name.rsplit(".", 1)[1]
        if key in FOLDED:
            self.counts["folded"] += 1
            return torch.full_like(t, 1.0 - self.offset, dtype=dtype)
        if self.head is not None and key == "attn.v_bias":  # b_h R per head
            return self._per_head_columns(t.float()[None, :])[0].to(dtype)
        if param != "weight" or key in INSIDE:
            return t.to(dtype)
        if key == "embed":
            return self.q.right(t).to(dtype)
        if key in READER_NORM:
            self.counts["read"] += 1
            g = self.norm_scale(norms[READER_NORM[key]])
            w = self.q.right(t.float() * g[None, :])
            if self.head is not None and key == "attn.v":  # each head's rows: R^T W_h
                self.counts["heads"] += 1
                w = self._per_head_columns(w.T).T
            return w.contiguous().to(dtype)
        if key in WRITES:
            self.counts["written"] += 1
            w = self.q.right(t.float().T).T
            if self.head is not None and key == "attn.o":  # each head's columns: W_h R
                w = self._per_head_columns(w)
            return w.contiguous().to(dtype)
        raise AssertionError(f"{name}: row {key} has no rotation rule")  # refusal() names these first

    def _per_head_columns(self, w: torch.Tensor) -> torch.Tensor:
        """w [rows, heads x head_dim] with each head's block of columns times R."""
        rows, cols = w.shape
        d = self.facts.head_dim
        return self.head.right(w.reshape(rows * (cols // d), d)).reshape(rows, cols)


def run(req: RotateRequest) -> RotateResult:
    """Run `dsconv rotate`: every tensor of the model, rotated, into a float checkpoint."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    ck = Checkpoint.open(req.model)
    if ck.is_quantized:
        raise UserError(f"{req.model} is already quantized", hint="rotate the original float checkpoint")
    why = refusal(ck)
    if why:
        raise UserError(f"{req.model}: {ck.family.name} cannot be rotated: {why}",
                        hint="quantize it without --rotate")
    rot = Rotator(ck, req.seed)
    dtype = ck.facts.dtype
    names = [n for n in ck.names() if not ck.role(n).is_aux]  # FP8 block scales go: the weights come out dequantized
    head, embed = ck.family.tensor("lm_head"), ck.family.tensor("embed")
    untie = head not in ck.tensors
    shapes = {n: ck.info(n).shape for n in names}
    out_dtype = {n: (ck.info(n).dtype if ck.info(n).dtype in ("BF16", "F16", "F32") else dtype) for n in names}
    specs = [TensorSpec(n, out_dtype[n], shapes[n]) for n in names]
    if untie:
        specs.append(TensorSpec(head, out_dtype[embed], shapes[embed]))
    final_norm = ck.family.tensor("norm.final")
    with OutputDir(req.output, stage="rotate", inputs=[req.model], force=req.force, input_identity=ck.identity(),
                   options={"seed": req.seed, "rotation": rot.q.kind, "hidden_size": ck.facts.hidden_size}) as out:
        ts = out.tensor_set(specs)
        layers = ck.layers()
        bar = tqdm(total=len(specs), desc="rotate", unit="tensor", disable=not req.progress)
        for layer, layer_names in layers.items():
            norms = rot.norm_names(layer_names) if layer is not None else {"norm.final": final_norm}
            for n in layer_names:
                if n in shapes:
                    ts.write(n, rot.transform(n, norms))
                    bar.update()
        if untie:  # the head reads the final norm's output: E diag(g) Q, no longer the embedding's E Q
            g = rot.norm_scale(final_norm)
            ts.write(head, rot.q.right(ck.load(embed, dequantize=True).float() * g[None, :]).to(
                torch_dtype(out_dtype[embed])))
            rot.counts["read"] += 1
            bar.update()
        bar.close()
        config = {k: v for k, v in ck.config.items() if k != "quantization_config"}
        config["tie_word_embeddings"] = False
        section = config.get(ck.family.config_section or "")
        if isinstance(section, dict) and "tie_word_embeddings" in section:
            config[ck.family.config_section] = {**section, "tie_word_embeddings": False}
        out.write_json("config.json", config)
        for f in ck.copy_files():
            if f.name != "config.json":
                out.copy_in(f)
    summary = {"family": ck.family.name, "output": str(req.output), "hidden_size": ck.facts.hidden_size,
               "rotation": rot.q.kind, "seed": req.seed, "head_rotation": rot.head.kind if rot.head else None,
               "untied": untie, "tensors": len(specs), **rot.counts, "seconds": round(time.perf_counter() - t0, 2)}
    return RotateResult(summary)
