"""Engine contract of `dsconv quantize`, in `make test`. Both engines' own loaders run in `make engine-check`
(tests/engine_check/), whose committed results.json the README's "loads in" table is generated from; here:
- what dsconv writes or refuses for every family x scheme x engine is what results.json recorded (else rerun
  `make engine-check`);
- every refusal (exit 2, before any work) names the layer kind or option, the engine's rule with its source, and the
  way out;
- vLLM-Ascend's outputs are also read by a mirror of its loader (tests/engine_contract/vllm_ascend.py: files, keys,
  dtypes, shapes, packing, fused-layer types), which runs in seconds where the real loader needs its own environment;
  MindIE has no mirror: its real loader runs on a CPU host (make engine-check), so a reading of its code would only
  duplicate it.
The format facts both engines read (int64 deq_scale for fp16, the int4 nibble order, the DeepSeek recipe's keys) are
checked by the formats' own rules."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from tests.engine_check.cases import LABELS, quantize
from tests.engine_contract import vllm_ascend
from tests.engine_contract.common import Problems, routing, tensor
from tests.engine_contract.conftest import ENGINES, FAMILIES, SCHEMES

pytestmark = [pytest.mark.cli]
README = Path(__file__).resolve().parents[2] / "README.md"
CASES = [(f, s) for f in FAMILIES for s in SCHEMES]


def _read(out: Path, src: Path) -> Problems:
    """vLLM-Ascend's loader, mirrored (tests/engine_contract/vllm_ascend.py)."""
    from dsconv.checkpoint import Checkpoint

    ck = Checkpoint.open(src)
    shapes = {n: tuple(i.shape) for n, i in ck.tensors.items()}
    return vllm_ascend.read(out, shapes, ck.facts.dtype, ck.facts.model_type)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("family,scheme", CASES)
def test_output_loads_or_refusal_is_justified(family, scheme, engine, produce):
    r = produce(family, scheme, engine)
    if r.out is not None:
        if engine == "vllm-ascend":
            problems = _read(r.out, r.src)
            assert problems == [], f"{family} {scheme} for {engine}:\n" + "\n".join(problems)
        return
    source = {"mindie": "MindIE-LLM ", "vllm-ascend": "vllm-ascend "}[engine]
    assert f"--engine {engine}" in r.refusal and source in r.refusal and " (hint: " not in r.refusal, r.refusal
    if engine == "vllm-ascend":  # the refusal is real: what MindIE takes does not load in vLLM-Ascend
        o = produce(family, scheme, "mindie")
        if o.out is not None:
            assert _read(o.out, o.src) != [], f"vLLM-Ascend refused {family} {scheme}, but its reader accepts it"


def test_fp16_deq_scale_per_engine(contract_models, tmp_path):
    """deq_scale: float32 for bf16 models, the int64 word for fp16 models, for both engines (vLLM-Ascend's fp16
    parameter dtype, va/quantization/methods/w8a8_static.py::get_perchannel_param; MindIE's fp16 W8A8 kernel input,
    atb/utils/quantize/w8a8.py::W8A8LinearStatic)."""
    src = contract_models("deepseek_v3_fp16")
    for engine in ENGINES:
        out = tmp_path / engine
        code, last = quantize(src, out, engine, SCHEMES["bits8"])
        assert code == 0, last
        route = routing(out, Problems(), "ds16")
        assert route["model.layers.0.self_attn.o_proj.deq_scale"][1] == "I64"
        if engine == "vllm-ascend":
            assert _read(out, src) == []


@pytest.mark.parametrize("scheme", ["bits8_c8", "w4a8_c8"])
def test_deepseek_fa_quant_on_fp16_per_engine(scheme, contract_models, tmp_path):
    """DeepSeek's int8 latent cache (FA quant) on a float16 model: MindIE takes it with static W8A8 MLA (the `--bits
    8` recipe, and the W4A8C8 recipe's attention; its real loader in make engine-check), vLLM-Ascend with
    W8A8_DYNAMIC attention (the W4A8 recipe) and refuses `--bits 8`'s static attention - and what it refuses, its
    reader rejects in MindIE's output."""
    src = contract_models("deepseek_v3_fp16")
    outs = {}
    for engine in ENGINES:
        out = tmp_path / engine
        code, last = quantize(src, out, engine, SCHEMES[scheme])
        if code == 0:
            outs[engine] = out
        else:
            assert code == 2 and engine == "vllm-ascend" and scheme == "bits8_c8" and "W8A8_DYNAMIC attention" in last
    for engine, out in outs.items():
        desc = json.loads((out / "quant_model_description.json").read_text())
        assert desc["fa_quant_type"] == "FAKQuant" and desc["model.layers.1.self_attn.fa_q.scale"] == "FAQuant"
    if "vllm-ascend" in outs:
        assert _read(outs["vllm-ascend"], src) == []
    else:
        assert _read(outs["mindie"], src) != []


def test_deepseek_recipe_and_config_keys(produce):
    """--bits 8 on DeepSeek: attention static W8A8, kv_b_proj FLOAT, dense MLP / shared / routed experts
    W8A8_DYNAMIC (Ascend's recipe, MindIE-LLM examples/models/deepseek-v3/README.md); MindIE's config carries
    quantize=w8a8_dynamic + mla_quantize=w8a8 (modeling_deepseekv2.py::FlashDeepseekV2Attention.__init__);
    vLLM-Ascend's carries neither key nor quantization_config."""
    for engine in ENGINES:
        r = produce("deepseek_v3", "bits8", engine)
        desc = json.loads((r.out / "quant_model_description.json").read_text())
        cfg = json.loads((r.out / "config.json").read_text())
        assert desc["model.layers.1.self_attn.q_b_proj.weight"] == "W8A8"
        assert desc["model.layers.1.self_attn.kv_b_proj.weight"] == "FLOAT"
        assert desc["model.layers.0.mlp.gate_proj.weight"] == "W8A8_DYNAMIC"
        assert desc["model.layers.1.mlp.shared_experts.up_proj.weight"] == "W8A8_DYNAMIC"
        assert {desc[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(16)} == {"W8A8_DYNAMIC"}
        assert "quantization_config" not in cfg
        if engine == "mindie":
            assert (cfg["quantize"], cfg["mla_quantize"]) == ("w8a8_dynamic", "w8a8") and "moe_quantize" not in cfg
            assert desc["model_quant_type"] == "W8A8_DYNAMIC"
        else:
            assert not {"quantize", "mla_quantize", "moe_quantize"} & set(cfg)


def int4_nibbles_match(route: dict, module: str, w: np.ndarray, tol: float = 0.25) -> bool:
    """Unpack the pre-packed int4 weight by the format's rule (even element in the low nibble, along k for per-channel
    [n, k/2], along n for per-group [n/2, k]) and compare the dequantized weight to the float one: a swapped order or
    axis gives an error near 1.4."""
    packed = tensor(route, module + ".weight").astype(np.int8)
    scale = tensor(route, module + ".weight_scale").astype(np.float32)
    low = ((packed.view(np.uint8) & 0x0F) ^ 8).astype(np.int16) - 8
    high = ((packed.view(np.uint8) >> 4) ^ 8).astype(np.int16) - 8
    n, k = w.shape
    q = np.empty((n, k), np.float32)
    if scale.shape[1] == 1:
        q[:, 0::2], q[:, 1::2] = low, high
    else:
        q[0::2], q[1::2] = low, high
    g = k // scale.shape[1]
    deq = (q.reshape(n, scale.shape[1], g) * scale[..., None]).reshape(n, k)
    return float(np.linalg.norm(deq - w) / max(np.linalg.norm(w), 1e-12)) < tol


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_pc"])
def test_w4a16_nibble_order(scheme, produce):
    """Per channel packs along k [n, k/2], per group along n [n/2, k], even element in the low nibble (MindIE-LLM
    atb/utils/quantize/w4a16.py::W4A16LinearStatic.__init__, low_bit_utils.py::int42int8): unpacked by that rule,
    the weights dequantize to the float ones."""
    from dsconv.checkpoint import Checkpoint

    r = produce("llama", scheme, "mindie")
    route = routing(r.out, Problems(), "w4")
    ck = Checkpoint.open(r.src)
    P = "model.layers.0.mlp.down_proj"
    w = ck.load(P + ".weight").float().numpy()
    n, k = w.shape
    assert route[P + ".weight"][2] == ((n, k // 2) if scheme == "w4a16_pc" else (n // 2, k))
    assert int4_nibbles_match(route, P, w)


def test_refusals_name_kind_and_alternative(produce):
    """The exit-2 message names the layer kind, an example layer, the engine rule's source and the way out."""
    r = produce("qwen3_moe", "w8a16", "vllm-ascend")
    assert r.out is None and "routed_experts layers" in r.refusal and "--moe-scheme w4a8_dynamic | w8a8_dynamic" in r.refusal
    r = produce("llama", "w4a16", "vllm-ascend")
    assert r.out is None and "attention layers" in r.refusal and "registry.py" in r.refusal
    r = produce("mixtral", "w8a8", "vllm-ascend")
    assert r.out is None and "cannot be W8A8" in r.refusal and "create_scheme_for_layer" in r.refusal


ENGINE_CHECK = Path(__file__).resolve().parents[1] / "engine_check" / "results.json"
ENGINE_LABEL = {"mindie": "MindIE", "vllm-ascend": "vLLM"}


def loaded_cell(results: list[dict], engine: str, family: str, scheme: str) -> str | None:
    """The README's word for (engine, family, scheme) from `make engine-check`'s results: the engine's label when its
    own loader loaded every variant dsconv wrote (dtypes, expert layouts, tp degrees, offline-sharded folders) with
    everything in place; "(fp16)" when dsconv writes it for float16 models only; None when nothing was written or any
    written variant failed."""
    rows = [c for c in results if c.get("engine", "vllm-ascend") == engine and c["family"] == family
            and c["scheme"] == scheme]
    written = [c for c in rows if c["dsconv"] == "wrote"]
    if not written or any(c.get("load") != "ok" for c in written):
        return None
    dtypes = {c["dtype"] for c in written}
    return ENGINE_LABEL[engine] + ("" if "bf16" in dtypes else f" ({'/'.join(sorted(dtypes))})")


def test_engine_check_results_are_current(produce):
    """The committed real-loader results describe what dsconv does now: every (family, scheme, engine) it writes on
    the bf16 per-expert model was written there too, and every refusal is one there (rerun `make engine-check`
    after a change)."""
    results = json.loads(ENGINE_CHECK.read_text())
    for engine in ENGINES:
        wrote = {(c["family"], c["scheme"]) for c in results if c.get("engine", "vllm-ascend") == engine
                 and c["dsconv"] == "wrote" and c["dtype"] == "bf16" and c["layout"] == "per-expert"}
        for f, s in CASES:
            assert (produce(f, s, engine).out is not None) == ((f, s) in wrote), \
                f"{f} {s}: dsconv's {engine} output differs from tests/engine_check/results.json: run make engine-check"


def engine_table() -> str:
    """The README table: one row per scheme, one column per family, the engines whose own loader loaded every variant
    dsconv wrote (tests/engine_check/results.json)."""
    results = json.loads(ENGINE_CHECK.read_text())
    head = "| scheme | " + " | ".join(FAMILIES) + " |"
    lines = [head, "|" + "---|" * (len(FAMILIES) + 1)]
    for s in SCHEMES:
        cells = [" + ".join(x for x in (loaded_cell(results, e, f, s) for e in ENGINES) if x) or "-"
                 for f in FAMILIES]
        lines.append(f"| {LABELS.get(s, s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_readme_table_is_true_to_the_engine_check():
    text = README.read_text()
    m = re.search(r"<!-- engine-table -->\n(.*?)\n<!-- /engine-table -->", text, re.S)
    want = engine_table()
    if os.environ.get("DSCONV_UPDATE_README") and m:
        README.write_text(text[:m.start(1)] + want + text[m.end(1):])
        return
    assert m is not None, "README lacks the <!-- engine-table --> section"
    assert m.group(1).strip() == want, "README table differs from make engine-check's results:\n" + want
