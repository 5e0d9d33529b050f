"""`dsconv eval`: fidelity of a quantized output against its original, read back from the written layout.

The quantized model is rebuilt from the output directory alone and computed as the engine computes it
(`engine_linear.EngineLinear`: static and dynamic W8A8 activations, the W4A8 kernel's arithmetic, weight-only types
dequantized), with its int8 KV cache where it has one (`int8_cache`). Both models run on the same tokens a decoder
layer at a time (`streamed`), so eval takes any checkpoint the other stages take: perplexity of each and the change,
the logits error, KL and top-1 agreement on text, and with `--qa` the answers (`qa`).

The in-memory models (`load_original_model`, `load_quantized_model`) remain for what needs a whole model: greedy
answers with a KV cache (small models), the fake-quant ONNX comparison, and tests that check the streamed pass.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dsconv.checkpoint import Checkpoint
from dsconv.errors import UserError
from dsconv.executor import ExecOptions, make_executor
from dsconv.qformat import W8A8_MIX, cache_tensors
from dsconv.quant.evaluate import int8_cache as int8_cache_sim
from dsconv.quant.evaluate.engine_linear import ACT_TYPES, MIX_PATHS, EngineLinear
from dsconv.quant.evaluate.qa import (DEFAULT_MAX_NEW_TOKENS, QAItem, bundled_qa_path, check_lengths, greedy,
                                      prompt_ids, read_questions, stop_ids)
from dsconv.quant.evaluate.qa import render as qa_render
from dsconv.quant.evaluate.qa import score as qa_score
from dsconv.quant.evaluate.streamed import EvalJob, StreamedModel, batch_tokens, eval_job, run_passes, split
from dsconv.quant.formats.msmodelslim import quantized_modules, read_linear
from dsconv.runner.layers import ExpertLoop, install_forward, load_full_model
from dsconv.runner.metrics import HeadStats, Positions, Rows, padded_batches, text_metrics, vocab_block
from dsconv.runner.texts import load_tokenizer, read_texts, read_utf8

DEFAULT_SEQ_LEN = 512
# who runs each W8A8_MIX path (docs/formats/w8a8_mix.md)
MIX_ROLE = {"static": "decode instance, kv_consumer", "dynamic": "prefill or PD-colocated instance"}


# ------------------------------------------------------------------------------------------------ text
DEFAULT_TEXT = "bundled eval_data (English: Python reference topics; Chinese: dsconv's own)"


def eval_texts(path: Path | None, tokenizer: Any = None) -> tuple[list[str], str]:
    """The evaluation text: --text FILE (.jsonl/.json as for calibration, anything else plain text split at blank
    lines), or by default the bundled evaluation text, English and Chinese, which no calibration default uses (a
    figure on the calibration text would flatter the schemes that calibrate most)."""
    if path is None:
        from dsconv.bundled import eval_texts as bundled

        return bundled(), DEFAULT_TEXT
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
            if el is not None and el.qtype in ACT_TYPES:
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


def compare(original: nn.Module, quantized: nn.Module, chunks: list[list[int]], batch_tokens: int = 4096,
            progress: bool = True) -> dict[str, Any]:
    """Perplexity of both models, logits error, KL(original || quantized) and top-1 agreement over real tokens: the
    streamed path's figures (dsconv.runner.metrics), from whole models' logits.

    A batch holds at most LOGITS_BUDGET bytes of float32 logits per model: 4096 tokens of Gemma 3's 262k vocabulary
    would be 4.3 GB each; the accumulator takes them a block of vocabulary ids at a time."""
    from tqdm import tqdm

    batch_tokens = min(batch_tokens, max(1, LOGITS_BUDGET // (4 * int(original.config.vocab_size))))
    parts = []
    with torch.no_grad():
        for group, ids, mask in tqdm(list(padded_batches(chunks, batch_tokens)), desc="eval", unit="batch",
                                     disable=None if progress else True, leave=False):
            lo = original(ids).logits.float()[mask]
            lq = quantized(ids).logits.float()[mask]
            rows = Rows.of(group, ids, mask)
            st = HeadStats(lo.shape[0])
            st.add_blocks(lo, lq, rows.targets, vocab_block(lo.shape[0], LOGITS_BUDGET))
            parts.append(Positions.of(st, rows, lo.shape[-1]))
    return text_metrics(Positions.concat(parts, [0] * len(parts)))


@dataclass
class QAOptions:
    """`--qa`: the questions (None: the bundled held-out set), the answer length, free-running decoding."""

    path: Path | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    generate: bool = False
    answers: list[list[int]] | None = None  # the float model's answers, when a caller has them (one model, many outputs)


def evaluate(model_dir: Path, quant_dir: Path, text: Path | None = None, seq_len: int = DEFAULT_SEQ_LEN,
             samples: int | None = None, progress: bool = True, qa: QAOptions | None = None,
             execution: ExecOptions | None = None, mix_paths: tuple[str, ...] | None = None,
             windows: tuple[list[list[int]], str] | None = None) -> dict[str, Any]:
    """Fidelity of `quant_dir` against `model_dir`; a W8A8_MIX output on each of `mix_paths` (default both, the first
    one the headline). `windows`: the text's token windows and source name where the plan has them already."""
    from dsconv.quant.evaluate.onnx_lm import OnnxLM, fakequant_path

    ck = Checkpoint.open(model_dir)
    onnx_path = fakequant_path(quant_dir)
    if onnx_path is not None:
        if qa is not None:
            raise UserError("--qa compares answers of a quantize output; a fake-quant ONNX is scored on text only",
                            hint="drop --qa, or pass the quantize output directory")
        return _evaluate_onnx(ck, model_dir, onnx_path, OnnxLM(onnx_path), text, seq_len, samples, progress)
    qck = Checkpoint.open(quant_dir)
    check_pair(ck, qck, model_dir, quant_dir)
    chunks, source = windows or eval_chunks(ck, text, seq_len, samples)
    items, qa_meta = (None, None) if qa is None else qa_items(ck, qck, qa, seq_len, progress)
    seqs = chunks + ([it.prompt + it.answer for it in items] if items else [])
    started = time.perf_counter()
    desc = qck.quant_description
    counts: dict[str, int] = {}
    for t in quantized_modules(desc).values():
        counts[t] = counts.get(t, 0) + 1
    # W8A8_MIX: both of its paths, beside one float pass; the decode (static) one first, as it is the headline: it
    # computes every generated token of a PD-split deployment
    paths = (mix_paths or tuple(MIX_PATHS)) if W8A8_MIX in counts else (None,)
    by_path = {}
    for path, pos_p in zip(paths, streamed_positions(ck, qck, seqs, execution, progress, paths)):
        by_path[path] = (pos_p, text_metrics(pos_p, set(range(len(chunks)))))
    pos, metrics = by_path[paths[0]]
    per_layer = pos.layer_seconds
    out = {"model": str(model_dir), "quantized": str(quant_dir), "model_quant_type": desc.get("model_quant_type"),
           "linears": dict(sorted(counts.items())), "text": source, "samples": len(chunks), "seq_len": seq_len,
           **({"kv_cache": form} if (form := int8_cache_sim.cache_form(desc)) else {}), **metrics,
           "seconds": round(time.perf_counter() - started, 2),
           "seconds_per_layer": round(sum(per_layer) / max(1, len(per_layer)), 3),
           "layer_seconds": [round(x, 3) for x in per_layer],
           "expert_seconds": round(pos.expert_seconds, 3), "expert_runs": pos.expert_runs}
    if paths[0] is not None:
        out["path"] = paths[0]
        out["paths"] = {p: m for p, (_, m) in by_path.items()}
    overlap = calibration_overlap(quant_dir, text, None if qa is None else (qa.path or bundled_qa_path()))
    if overlap:
        out["calibration_overlap"] = overlap
    if items:
        for k, it in enumerate(items):
            it.forced_q, it.forced_o = pos.answer(len(chunks) + k, len(it.prompt) - 1, len(it.answer))
        out["qa"] = qa_score(items, qa_meta["tokenizer"], qa_meta["answers"], qa_meta["templated"],
                             qa_meta["source"], qa.max_new_tokens)
    return out


def calibration_overlap(quant_dir: Path, text: Path | None, qa: Path | None) -> list[str]:
    """What of this evaluation is the calibration set the output was fitted on (its quant_report.json), by content:
    perplexity on the text the ranges and searches were fitted to flatters the schemes that calibrate most."""
    import hashlib

    from dsconv.bundled import bundled_calib_path

    try:
        source = json.loads((Path(quant_dir) / "quant_report.json").read_text())["calibration"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    calib = bundled_calib_path() if str(source).startswith("bundled ") else Path(source)
    if not calib.is_file():
        return []
    digest = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()  # noqa: E731
    want = digest(calib)
    return [f"{flag} {p} is the calibration set this output was fitted on ({source}, quant_report.json): its "
            "figures flatter the schemes that calibrate most" for flag, p in (("--text", text), ("--qa", qa))
            if p is not None and Path(p).is_file() and digest(p) == want]


def streamed_positions(ck: Checkpoint, qck: Checkpoint, seqs: list[list[int]], execution: ExecOptions | None,
                       progress: bool, paths: tuple[str | None, ...] = (None,)) -> list[Positions]:
    """The streamed pass (one per W8A8_MIX path, sharing the float side) in this process, or split into runs of
    sequences over `--workers` / Ray (each job streams both checkpoints itself: more workers buy compute, not fewer
    weight reads)."""
    workers = 1 if execution is None else execution.resolved_workers()
    if workers <= 1 or len(seqs) < 2:
        orig = StreamedModel(ck, quantized=False)
        return run_passes(orig, [StreamedModel(qck, quantized=True, path=p) for p in paths], seqs,
                          batch_tokens(orig.sk.config), progress=progress)
    starts = split(seqs, workers)
    ends = starts[1:] + [len(seqs)]
    jobs = [EvalJob(str(ck.root), str(qck.root), seqs[a:b], paths) for a, b in zip(starts, ends)]
    with make_executor(execution) as ex:
        parts = list(ex.map(eval_job, jobs))
    return [Positions.concat([part[k] for part in parts], starts) for k in range(len(paths))]


def check_pair(ck: Checkpoint, qck: Checkpoint, model_dir: Path, quant_dir: Path) -> None:
    """The quantize output must be made from `--model`: same architecture, every tensor it holds named in the source
    with the same shape (an int8 weight: as many values, or twice for packed int4). Checked before any work."""
    if not qck.is_quantized:
        raise UserError(f"{quant_dir} has no quant_model_description*.json", hint="pass the output of dsconv quantize")
    if ck.is_quantized:
        raise UserError(f"{model_dir} is itself quantized", hint="--model is the original float checkpoint")
    hint = "pass the original model the quantized output was made from"
    a, b = ck.family.flat_config(ck.config), qck.family.flat_config(qck.config)  # a VL config's text_config too
    for key in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers"):
        if a.get(key) != b.get(key):
            raise UserError(f"{quant_dir} is not a quantization of {model_dir} ({key}: {b.get(key)} vs "
                            f"{a.get(key)})", hint=hint)
    kv_cache = set(cache_tensors(qck.quant_description))
    for name in qck.names():
        r = qck.role(name)
        if r.param != "weight" or name in kv_cache:
            continue
        if name not in ck and name == ck.family.tensor("lm_head") and ck.facts.tie_word_embeddings:
            name_in_source = ck.family.tensor("embed")  # a rotated output unties the head (quant/rotate.py)
        elif name not in ck:
            raise UserError(f"{quant_dir}: {name} is not in {model_dir}", hint=hint)
        else:
            name_in_source = name
        qi, fi = qck.info(name), ck.info(name_in_source)
        same = tuple(qi.shape) == tuple(fi.shape) or (qi.dtype in ("I8", "U8") and qi.numel in (fi.numel,
                                                                                                fi.numel // 2))
        if not same:
            raise UserError(f"{quant_dir}: {name} has shape {list(qi.shape)}, {model_dir} has {list(fi.shape)}",
                            hint=hint)


def fits_in_memory(ck: Checkpoint, models: int) -> bool:
    """Whether `models` float32 copies of the checkpoint's parameters fit in half the memory available now."""
    import psutil

    need = 4 * sum(ck.info(n).numel for n in ck.names()) * models
    return need < psutil.virtual_memory().available // 2


def qa_items(ck: Checkpoint, qck: Checkpoint, qa: QAOptions, seq_len: int, progress: bool) -> tuple[list, dict]:
    """The questions' prompts and reference answers: the float model's greedy answers where it fits in memory, else
    the file's answers; with `qa.generate`, the quantized model's own greedy answers."""
    from tqdm import tqdm

    tokenizer = load_tokenizer(ck.root)
    questions, source = read_questions(qa.path)
    prompts, templated = [], False
    for q in questions:
        ids, templated = prompt_ids(tokenizer, q.text)
        prompts.append(ids)
    check_lengths(questions, prompts, qa.max_new_tokens, seq_len,
                  ck.family.flat_config(ck.config).get("max_position_embeddings"))
    stop = stop_ids(tokenizer, ck.family.flat_config(ck.config))
    if qa.generate and not fits_in_memory(ck, 2):
        raise UserError(f"--generate holds both models in memory, and {ck.root} does not fit",
                        hint="drop --generate: the teacher-forced comparison streams the models layer by layer")
    bar = dict(disable=None if progress else True, leave=False, unit="question")
    if qa.answers is not None:
        answers, how = qa.answers, "float"
    elif fits_in_memory(ck, 1):
        model = load_original_model(ck)
        answers = [greedy(model, p, qa.max_new_tokens, stop, int8_cache_sim.new_cache(model.config, None, {}))
                   for p in tqdm(prompts, desc="float answers", **bar)]
        del model
        how = "float"
    else:
        missing = next((q for q in questions if q.reference is None), None)
        if missing is not None:
            raise UserError(f"{missing.where}: no reference answer, and {ck.root} is too large to generate the float "
                            f"model's answers in memory", hint="give every question an \"answer\"")
        answers = [[int(i) for i in tokenizer(q.reference, add_special_tokens=False)["input_ids"]][: qa.max_new_tokens]
                   for q in questions]
        how = "reference"
    items = [QAItem(q, p, a) for q, p, a in zip(questions, prompts, answers)]
    if qa.generate:
        model, _ = load_quantized_model(qck)
        form = int8_cache_sim.cache_form(qck.quant_description)
        scales = int8_cache_sim.cache_scales(qck) if form else {}
        for it in tqdm(items, desc="quantized answers", **bar):
            it.free_q = greedy(model, it.prompt, qa.max_new_tokens, stop,
                               int8_cache_sim.new_cache(model.config, form, scales))
        del model
    return items, {"tokenizer": tokenizer, "answers": how, "templated": templated, "source": source}


def _evaluate_onnx(ck: Checkpoint, model_dir: Path, onnx_path: Path, lm: Any, text: Path | None, seq_len: int,
                   samples: int | None, progress: bool) -> dict[str, Any]:
    """The fake-quant ONNX (onnxruntime) against the float model, on the same text and metrics (in memory)."""
    if ck.is_quantized:
        raise UserError(f"{model_dir} is itself quantized", hint="--model is the original float checkpoint")
    chunks, source = eval_chunks(ck, text, seq_len, samples)
    original = load_original_model(ck)
    metrics = compare(original, lm, chunks, progress=progress)
    mqt, linears = lm.describe()
    return {"model": str(model_dir), "quantized": str(onnx_path), "model_quant_type": mqt or "ONNX",
            "linears": linears, "runtime": "onnxruntime (fake-quant ONNX)", "text": source, "samples": len(chunks),
            "seq_len": seq_len, **metrics}


def eval_chunks(ck: Checkpoint, text: Path | None, seq_len: int,
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
        *([f"W8A8_MIX {p} path ({MIX_ROLE[p]}): perplexity {m['ppl_quantized']:.4f} ({m['ppl_change_pct']:+.3f}%), "
           f"KL {m['kl_divergence']:.6f}, top-1 {m['top1_agreement'] * 100:.2f}%" for p, m in r["paths"].items()]
          if "paths" in r else []),
        *(qa_render(r["qa"]) if "qa" in r else []),
        *(f"note: {line}" for line in r.get("calibration_overlap", ())),
    ])
