"""Engine contract of `dsconv quantize`: for every family x scheme x engine, the output is read the way that engine's
loader reads it (tests/engine_contract/mindie.py, vllm_ascend.py: files, keys, dtypes, shapes, packing, fused-layer
type agreement, duplicate names, completeness of aux tensors) and must show no difference. A combination dsconv
refuses (exit 2, before any work) must be one the engine really cannot load: the other engine's output of the same
combination fails this engine's reader. The README's "loads in" table is checked against these results."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.engine_contract import mindie, vllm_ascend
from tests.engine_contract.common import Problems, routing, tensor
from tests.engine_contract.conftest import ENGINES, FAMILIES, MOE, SCHEMES

pytestmark = [pytest.mark.cli, pytest.mark.slow]

READERS = {"mindie": mindie.read, "vllm-ascend": vllm_ascend.read}
README = Path(__file__).resolve().parents[2] / "README.md"
# w8a8 explicit differs from the --bits 8 recipe only where experts or DeepSeek regions are involved
CASES = [(f, s) for f in FAMILIES for s in SCHEMES if s != "w8a8" or f in MOE]


def _read(engine: str, out: Path, src: Path) -> Problems:
    from dsconv.checkpoint import Checkpoint

    ck = Checkpoint.open(src)
    shapes = {n: tuple(i.shape) for n, i in ck.tensors.items()}
    return READERS[engine](out, shapes, ck.facts.dtype, ck.facts.model_type)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("family,scheme", CASES)
def test_output_loads_or_refusal_is_justified(family, scheme, engine, produce):
    r = produce(family, scheme, engine)
    if r.out is not None:
        problems = _read(engine, r.out, r.src)
        assert problems == [], f"{family} {scheme} for {engine}:\n" + "\n".join(problems)
        return
    assert f"--engine {engine}" in r.refusal and ("layers" in r.refusal or "region" in r.refusal
                                                  or "--kv-cache" in r.refusal), r.refusal
    other = next(e for e in ENGINES if e != engine)
    o = produce(family, scheme, other)
    if o.out is not None:  # the refusal is real: what the other engine takes does not load in this one
        assert _read(engine, o.out, o.src) != [], f"{engine} refused {family} {scheme}, but its reader accepts it"


def test_fp16_deq_scale_per_engine(produce, contract_models):
    """deq_scale: float32 for bf16 models (both), int64 bit pattern for fp16 models (vLLM-Ascend param dtype;
    va/quantization/methods/w8a8_static.py::get_perchannel_param); MindIE takes both for fp16."""
    from dsconv.errors import UserError
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run
    from tests.engine_contract.conftest import FAST

    src = contract_models["deepseek_v3_fp16"]
    for engine in ENGINES:
        out = Path(str(produce("llama", "bits8", "mindie").out) + f"-ds16-{engine}")
        try:
            run(QuantRequest(src, out, QuantOptions(**{**FAST, **SCHEMES["bits8"], "engine": engine}), progress=False))
        except UserError as e:  # pragma: no cover - a refusal here is a bug
            pytest.fail(e.one_line())
        route = routing(out, Problems(), "ds16")
        assert route["model.layers.0.self_attn.o_proj.deq_scale"][1] == "I64"
        assert _read(engine, out, src) == []


@pytest.mark.parametrize("scheme", ["bits8_c8", "w4a8_c8"])
def test_deepseek_fa_quant_on_fp16_per_engine(scheme, produce, contract_models, tmp_path):
    """DeepSeek's int8 latent cache (FA quant) on a float16 model, read by both engines' readers: MindIE takes it
    with static W8A8 MLA (the `--bits 8` recipe, and the W4A8C8 recipe's attention), vLLM-Ascend with W8A8_DYNAMIC
    attention (the W4A8 recipe) and refuses `--bits 8`'s static attention - and what it refuses, its reader
    rejects in MindIE's output."""
    from dsconv.errors import UserError
    from dsconv.quant.plan.options import QuantOptions
    from dsconv.quant.stage import QuantRequest, run
    from tests.engine_contract.conftest import FAST

    src = contract_models["deepseek_v3_fp16"]
    outs = {}
    for engine in ENGINES:
        out = tmp_path / engine
        try:
            run(QuantRequest(src, out, QuantOptions(**{**FAST, **SCHEMES[scheme], "engine": engine}), progress=False))
            outs[engine] = out
        except UserError as e:
            assert engine == "vllm-ascend" and scheme == "bits8_c8" and "W8A8_DYNAMIC attention" in e.one_line()
    for engine, out in outs.items():
        assert _read(engine, out, src) == [], engine
        desc = json.loads((out / "quant_model_description.json").read_text())
        assert desc["fa_quant_type"] == "FAKQuant" and desc["model.layers.1.self_attn.fa_q.scale"] == "FAQuant"
    if "vllm-ascend" not in outs:
        assert _read("vllm-ascend", outs["mindie"], src) != []


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


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_pc"])
def test_w4a16_nibble_order(scheme, produce):
    """Per channel packs along k [n, k/2], per group along n [n/2, k], even element in the low nibble (MindIE-LLM
    atb/utils/quantize/w4a16.py::W4A16LinearStatic.__init__, low_bit_utils.py::int42int8): unpacked by that rule,
    the weights dequantize to the float ones."""
    from dsconv.checkpoint import Checkpoint

    r = produce("llama", scheme, "mindie")
    p = Problems()
    route = routing(r.out, p, "w4")
    ck = Checkpoint.open(r.src)
    P = "model.layers.0.mlp.down_proj"
    w = ck.load(P + ".weight").float().numpy()
    n, k = w.shape
    assert route[P + ".weight"][2] == ((n, k // 2) if scheme == "w4a16_pc" else (n // 2, k))
    assert mindie.int4_nibbles_match(route, P, w)


def test_refusals_name_kind_and_alternative(produce):
    """The exit-2 message names the layer kind, an example layer, the engine rule's source and the way out."""
    r = produce("qwen3_moe", "w8a16", "vllm-ascend")
    assert r.out is None and "routed_experts layers" in r.refusal and "--moe-scheme w4a8_dynamic | w8a8_dynamic" in r.refusal
    r = produce("llama", "w4a16", "vllm-ascend")
    assert r.out is None and "attention layers" in r.refusal and "registry.py" in r.refusal
    r = produce("mixtral", "w8a8", "vllm-ascend")
    assert r.out is None and "cannot be W8A8" in r.refusal and "create_scheme_for_layer" in r.refusal


ENGINE_CHECK = Path(__file__).resolve().parents[1] / "engine_check" / "results.json"


def _real_loader() -> dict[tuple[str, str], bool]:
    """(family, scheme) -> whether vLLM-Ascend's real loader loaded every variant dsconv wrote (bf16 and fp16,
    per-expert and fused experts), from `make engine-check`'s committed results."""
    out: dict[tuple[str, str], bool] = {}
    for c in json.loads(ENGINE_CHECK.read_text()):
        key = (c["family"], c["scheme"])
        ok = c["dsconv"] == "wrote" and c.get("load") == "ok"
        out[key] = out.get(key, True) and ok
    return out


def test_engine_check_results_are_current(produce):
    """The committed real-loader results describe what dsconv does now: every (family, scheme) it writes for
    vLLM-Ascend was written there too, and every refusal is one there (rerun `make engine-check` after a change)."""
    wrote = {(c["family"], c["scheme"]) for c in json.loads(ENGINE_CHECK.read_text())
             if c["dsconv"] == "wrote" and c["dtype"] == "bf16" and c["layout"] == "per-expert"}
    for f, s in CASES:
        assert (produce(f, s, "vllm-ascend").out is not None) == ((f, s) in wrote), \
            f"{f} {s}: dsconv's vLLM-Ascend output differs from tests/engine_check/results.json: run make engine-check"


def _table(produce) -> str:
    """The README table: one row per scheme, one column per family. MindIE from the contract readers (no loader
    runs here); vLLM only where vLLM-Ascend's real loader loaded every variant (tests/engine_check)."""
    real = _real_loader()
    head = "| scheme | " + " | ".join(FAMILIES) + " |"
    lines = [head, "|" + "---|" * (len(FAMILIES) + 1)]
    for s in SCHEMES:
        cells = []
        for f in FAMILIES:
            key = (f, s) if (f, s) in CASES else (f, "bits8")
            got = [e for e in ENGINES if produce(*key, e).out is not None
                   and (e != "vllm-ascend" or real.get(key, False))]
            cells.append(" + ".join({"mindie": "MindIE", "vllm-ascend": "vLLM"}[e] for e in got) or "-")
        label = {"bits8": "`--bits 8` (engine recipe)", "w4a16_pc": "w4a16 `--group-size 0`",
                 "w4a8": "w4a8_dynamic (MoE recipe)", "bits8_c8": "`--bits 8 --kv-cache int8`",
                 "w8a8_dynamic_c8": "w8a8_dynamic `--kv-cache int8`",
                 "w4a8_c8": "w4a8_dynamic `--kv-cache int8`"}.get(s, s)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_readme_table_is_true_to_the_contract(produce):
    text = README.read_text()
    m = re.search(r"<!-- engine-table -->\n(.*?)\n<!-- /engine-table -->", text, re.S)
    want = _table(produce)
    import os

    if os.environ.get("DSCONV_UPDATE_README") and m:
        README.write_text(text[:m.start(1)] + want + text[m.end(1):])
        return
    assert m is not None, "README lacks the <!-- engine-table --> section"
    assert m.group(1).strip() == want, "README table differs from the contract results:\n" + want
