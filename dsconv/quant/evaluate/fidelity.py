"""`dsconv eval`: fidelity of a quantized output against its original, read back from the written layout.

The quantized model is rebuilt from the output directory alone: weights dequantized from int8/int4 + scales, and
activations quantized the way the engine does - W8A8 static layers compute `(x_q @ w_q^T + quant_bias) * deq_scale`
from the stored input_scale/input_offset/deq_scale/quant_bias (so a wrong auxiliary shows up here), W8A8_DYNAMIC
layers quantize each token to int8, W4A8_DYNAMIC layers run the A8W4 kernel's arithmetic with the stored scale_bias
(`EngineLinear._w4a8`). Both models then run on the same text: perplexity of each, the change in percent,
mean/max logits error, KL divergence and top-1 agreement.

Evaluation holds both models in memory (float32): it is a tool for small models and for checking the pipeline, not
for a 671B checkpoint (quantize itself never holds a model).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.quant.algorithms.fake_quant import fake_quant_int8_rows, int8_rows
from dsconv.quant.algorithms.schemes import quantize_activation
from dsconv.quant.calibrate.data import load_tokenizer, read_texts, read_utf8
from dsconv.quant.calibrate.layers import ExpertLoop, install_forward, load_full_model
from dsconv.quant.evaluate import int8_cache as int8_cache_sim
from dsconv.quant.formats.msmodelslim import QuantLinear, quantized_modules, read_linear

DEFAULT_SEQ_LEN = 512


# ------------------------------------------------------------------------------------------------ text
def eval_texts(path: Path | None, tokenizer: Any = None) -> tuple[list[str], str]:
    """The evaluation text: --text FILE (.jsonl/.json as for calibration, anything else plain text split at blank
    lines), or by default the answers of the bundled calibration set."""
    if path is None:
        import json

        from dsconv.bundled import bundled_calib_path

        src = bundled_calib_path()
        texts = [json.loads(line)["answer"] for line in src.read_text(encoding="utf-8").splitlines() if line.strip()]
        return texts, f"bundled {src.name} (answers)"
    path = Path(path)
    if path.suffix in (".jsonl", ".json"):
        return read_texts(path, tokenizer), str(path)
    raw = read_utf8(path, "text file", "pass a plain text, .jsonl or .json file with --text")
    texts = [p.strip() for p in raw.split("\n\n") if p.strip()]
    if not texts:
        raise UserError(f"{path} is empty", hint="give the evaluation some text")
    return texts, str(path)


def token_chunks(texts: list[str], tokenizer: Any, seq_len: int, samples: int | None) -> list[list[int]]:
    """Each text tokenized and cut into chunks of at most seq_len tokens (at least 2: one prediction)."""
    out: list[list[int]] = []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        for s in range(0, len(ids), seq_len):
            chunk = ids[s:s + seq_len]
            if len(chunk) >= 2:
                out.append([int(i) for i in chunk])
    if samples is not None:
        out = out[:samples]
    if not out:
        raise UserError("the evaluation text tokenizes to nothing usable", hint="give longer text with --text")
    return out


# ------------------------------------------------------------------------------------------------ quantized model
class EngineLinear:
    """A linear computed as the engine computes its stored type (activations included)."""

    def __init__(self, ql: QuantLinear) -> None:
        self.ql = ql
        self.qtype = ql.qtype
        self.w = torch.from_numpy(ql.dequantized())
        self.bias = None if ql.bias is None else torch.from_numpy(ql.bias)
        if ql.qtype == "W8A8":
            self.wq = torch.from_numpy(ql.q.astype(np.float32))
            self.deq = torch.from_numpy(ql.deq_scale.astype(np.float32))
            self.qb = torch.from_numpy(ql.quant_bias.astype(np.float32))
        if ql.qtype == "W4A8_DYNAMIC":
            self.wq = torch.from_numpy(ql.q.astype(np.float32))
            self.s = torch.from_numpy(ql.weight_scale.astype(np.float32).reshape(-1))
            self.sb = torch.from_numpy(ql.scale_bias.astype(np.float64).sum(-1).astype(np.float32))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.qtype == "W8A8":
            xq = quantize_activation(x, self.ql.input_scale, self.ql.input_offset).float()
            return ((xq @ self.wq.T) + self.qb) * self.deq  # quant_bias already holds the bias
        if self.qtype == "W4A8_DYNAMIC":
            return self._w4a8(x)
        if self.qtype == "W8A8_DYNAMIC":
            x = fake_quant_int8_rows(x)
        y = x @ self.w.T
        return y if self.bias is None else y + self.bias


    def _w4a8(self, x: torch.Tensor) -> torch.Tensor:
        """The engines' A8W4 kernel (grouped_matmul a8w4 "MSD"): per-token int8 x split as 16*hi + lo + 8 (hi, lo
        int4), two int4 x int4 products scaled per channel, plus the stored scale_bias for the +8 term, times the
        token's scale. Equals a8 x w4 exactly when scale_bias is right; a wrong one shows here."""
        xq, a = int8_rows(x.float())
        hi = torch.floor(xq / 16)
        lo = xq - 16 * hi - 8
        y = ((16 * hi) @ self.wq.T + lo @ self.wq.T) * self.s + self.sb
        y = y * a
        return y if self.bias is None else y + self.bias


def load_quantized_model(qck: Checkpoint, int8_cache: bool = True) -> tuple[nn.Module, dict[str, str]]:
    """The model of a quantized output dir: dequantized weights, engine-style activations, and (with `int8_cache`)
    its KV cache through int8 where the output has cache scales. Returns (model, types)."""
    types = quantized_modules(qck.quant_description)
    linears = {P: EngineLinear(read_linear(qck, P, t)) for P, t in types.items()}

    def load(name: str) -> torch.Tensor:
        module, _, param = name.rpartition(".")
        if module in linears and param == "weight":
            return linears[module].w
        return qck.load(name, dequantize=True).float()

    model, sk = load_full_model(qck, load=load)
    for mod in list(model.modules()):
        if isinstance(mod, nn.Linear):
            P = sk.ck_name(sk.module_names.get(mod, ""))
            el = linears.get(P)
            if el is not None and el.qtype in ("W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC"):
                install_forward(mod, el)
    for i in range(sk.num_layers):
        experts = sk.experts_module(i)
        if experts is None:
            continue
        E = int(experts.gate_up_proj.shape[0])
        per = [{s: linears.get(n) for s, n in sk.expert_module_names(i, e).items()} for e in range(E)]

        def weights(e: int, experts=experts) -> dict[str, torch.Tensor]:
            I = experts.down_proj.shape[-1]
            gu = experts.gate_up_proj[e]
            return {"gate": gu[:I], "up": gu[I:], "down": experts.down_proj[e]}

        def linear(e: int, slot: str, x: torch.Tensor, w: torch.Tensor, per=per) -> torch.Tensor:
            el = per[e][slot]
            return el(x) if el is not None else x @ w.T

        install_forward(experts, ExpertLoop(experts, E, weights, linear=linear))
    form = int8_cache_sim.cache_form(qck.quant_description)
    if form is not None and int8_cache:  # --kv-cache int8: what the cache holds through int8
        int8_cache_sim.install(model, sk, form, int8_cache_sim.cache_scales(qck))
    return model, types


def load_original_model(ck: Checkpoint) -> nn.Module:
    model, sk = load_full_model(ck)
    for i in range(sk.num_layers):  # the same explicit expert loop as the quantized model: differences are quantization
        experts = sk.experts_module(i)
        if experts is not None:
            E = int(experts.gate_up_proj.shape[0])

            def weights(e: int, experts=experts) -> dict[str, torch.Tensor]:
                I = experts.down_proj.shape[-1]
                gu = experts.gate_up_proj[e]
                return {"gate": gu[:I], "up": gu[I:], "down": experts.down_proj[e]}

            install_forward(experts, ExpertLoop(experts, E, weights))
    return model


# ------------------------------------------------------------------------------------------------ metrics
LOGITS_BUDGET = 256 * 2**20


def _batches(chunks: list[list[int]], batch_tokens: int) -> list[list[int]]:
    order = sorted(range(len(chunks)), key=lambda j: (-len(chunks[j]), j))
    out = []
    while order:
        per = max(1, batch_tokens // len(chunks[order[0]]))
        out.append(order[:per])
        order = order[per:]
    return out


def compare(original: nn.Module, quantized: nn.Module, chunks: list[list[int]], batch_tokens: int = 4096,
            progress: bool = True) -> dict[str, Any]:
    """Perplexity of both models, logits error, KL(original || quantized) and top-1 agreement over real tokens.

    A batch holds at most LOGITS_BUDGET bytes of float32 logits per model (about eight such tensors live at once):
    4096 tokens of Gemma 3's 262k vocabulary would be 4.3 GB each."""
    from tqdm import tqdm

    batch_tokens = min(batch_tokens, max(1, LOGITS_BUDGET // (4 * int(original.config.vocab_size))))

    nll = {"original": 0.0, "quantized": 0.0}
    predicted = 0
    abs_sum = ref_abs_sum = 0.0
    abs_max = 0.0
    kl_sum = 0.0
    agree = positions = 0
    batches = _batches(chunks, batch_tokens)
    with torch.no_grad():
        for batch in tqdm(batches, desc="eval", unit="batch", disable=None if progress else True, leave=False):
            L = max(len(chunks[j]) for j in batch)
            ids = torch.zeros(len(batch), L, dtype=torch.long)
            mask = torch.zeros(len(batch), L, dtype=torch.bool)
            for r, j in enumerate(batch):
                ids[r, : len(chunks[j])] = torch.tensor(chunks[j])
                mask[r, : len(chunks[j])] = True
            lo = original(ids).logits.float()[mask]
            lq = quantized(ids).logits.float()[mask]
            diff = (lq - lo).abs()
            abs_sum += float(diff.sum(dtype=torch.float64))
            ref_abs_sum += float(lo.abs().sum(dtype=torch.float64))
            abs_max = max(abs_max, float(diff.max()))
            lpo, lpq = torch.log_softmax(lo, -1), torch.log_softmax(lq, -1)
            kl_sum += float((lpo.exp() * (lpo - lpq)).sum(dtype=torch.float64))
            agree += int((lo.argmax(-1) == lq.argmax(-1)).sum())
            positions += lo.shape[0]
            # next-token NLL: position t predicts token t+1 within the same chunk
            nxt = torch.zeros_like(mask)
            nxt[:, :-1] = mask[:, 1:]
            target = ids[:, 1:][nxt[:, :-1]]
            for key, model_logits in (("original", lpo), ("quantized", lpq)):
                flat = model_logits[nxt[mask]]
                nll[key] -= float(flat.gather(1, target[:, None]).sum(dtype=torch.float64))
            predicted += int(target.numel())
    ppl_o = math.exp(nll["original"] / predicted)
    ppl_q = math.exp(nll["quantized"] / predicted)
    return {"tokens": positions, "predicted_tokens": predicted, "ppl_original": round(ppl_o, 4),
            "ppl_quantized": round(ppl_q, 4), "ppl_change_pct": round((ppl_q / ppl_o - 1.0) * 100.0, 4),
            "logits_mean_abs_error": round(abs_sum / (positions * lo.shape[-1]), 6),
            "logits_relative_error": round(abs_sum / ref_abs_sum, 6) if ref_abs_sum else 0.0,
            "logits_max_abs_error": round(abs_max, 6), "kl_divergence": round(kl_sum / positions, 6),
            "top1_agreement": round(agree / positions, 6)}


def evaluate(model_dir: Path, quant_dir: Path, text: Path | None = None, seq_len: int = DEFAULT_SEQ_LEN,
             samples: int | None = None, progress: bool = True) -> dict[str, Any]:
    from dsconv.quant.evaluate.onnx_lm import OnnxLM, fakequant_path

    ck = Checkpoint.open(model_dir)
    onnx_path = fakequant_path(quant_dir)
    if onnx_path is not None:
        return _evaluate_onnx(ck, model_dir, onnx_path, OnnxLM(onnx_path), text, seq_len, samples, progress)
    qck = Checkpoint.open(quant_dir)
    if not qck.is_quantized:
        raise UserError(f"{quant_dir} has no quant_model_description*.json", hint="pass the output of dsconv quantize")
    if ck.is_quantized:
        raise UserError(f"{model_dir} is itself quantized", hint="--model is the original float checkpoint")
    if ck.config.get("model_type") != qck.config.get("model_type") or ck.facts.num_layers != qck.facts.num_layers:
        raise UserError(f"{quant_dir} is not a quantization of {model_dir} (model_type / layers differ)",
                        hint="pass the original model the quantized output was made from")
    chunks, source = _eval_chunks(ck, text, seq_len, samples)
    original = load_original_model(ck)
    quantized, types = load_quantized_model(qck)
    metrics = compare(original, quantized, chunks, progress=progress)
    desc = qck.quant_description
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    return {"model": str(model_dir), "quantized": str(quant_dir), "model_quant_type": desc.get("model_quant_type"),
            "linears": dict(sorted(counts.items())), "text": source, "samples": len(chunks), "seq_len": seq_len,
            **({"kv_cache": form} if (form := int8_cache_sim.cache_form(desc)) else {}), **metrics}


def _evaluate_onnx(ck: Checkpoint, model_dir: Path, onnx_path: Path, lm: Any, text: Path | None, seq_len: int,
                   samples: int | None, progress: bool) -> dict[str, Any]:
    """The fake-quant ONNX (onnxruntime) against the float model, on the same text and metrics."""
    if ck.is_quantized:
        raise UserError(f"{model_dir} is itself quantized", hint="--model is the original float checkpoint")
    chunks, source = _eval_chunks(ck, text, seq_len, samples)
    original = load_original_model(ck)
    metrics = compare(original, lm, chunks, progress=progress)
    mqt, linears = lm.describe()
    return {"model": str(model_dir), "quantized": str(onnx_path), "model_quant_type": mqt or "ONNX",
            "linears": linears, "runtime": "onnxruntime (fake-quant ONNX)", "text": source, "samples": len(chunks),
            "seq_len": seq_len, **metrics}


def _eval_chunks(ck: Checkpoint, text: Path | None, seq_len: int,
                 samples: int | None) -> tuple[list[list[int]], str]:
    """The token chunks both evaluations score (the float model's tokenizer) and the text's source name."""
    if seq_len < 2:
        raise UserError(f"--seq-len {seq_len} is too short", hint="use 128-2048")
    tokenizer = load_tokenizer(ck.root)
    texts, source = eval_texts(text, tokenizer)
    return token_chunks(texts, tokenizer, seq_len, samples), source


def render(r: dict[str, Any]) -> str:
    return "\n".join([
        f"{r['quantized']} ({r['model_quant_type']}: {', '.join(f'{n} {t}' for t, n in r['linears'].items())}) vs "
        f"{r['model']}" + (f", the KV cache through int8 ({r['kv_cache']})" if r.get("kv_cache") else ""),
        f"text: {r['text']}: {r['samples']} samples, {r['tokens']} tokens",
        f"perplexity: original {r['ppl_original']:.4f}, quantized {r['ppl_quantized']:.4f} "
        f"({r['ppl_change_pct']:+.3f}%)",
        f"logits: mean |error| {r['logits_mean_abs_error']:.5f} ({r['logits_relative_error'] * 100:.2f}% of mean "
        f"|logit|), max |error| {r['logits_max_abs_error']:.4f}, KL {r['kl_divergence']:.6f}",
        f"top-1 agreement: {r['top1_agreement'] * 100:.2f}%",
    ])
