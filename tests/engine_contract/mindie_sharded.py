"""Read a MindIE offline-sharded directory the way MindIE-LLM's loader does for each world rank (sharded mode), and
list every difference. Sub-ranks and folder names are restated from MindIE's code, not imported from dsconv."""
from __future__ import annotations

from pathlib import Path

from tests.engine_contract.common import FLOAT_DTYPES, Problems, read_json, routing
from tests.engine_contract.mindie import QUANT_TYPES, READS


def folders(r: int, tp: int, moe_tp: int) -> list[str]:
    """atb/models/base/model_utils.py::BaseModel.save_sharded + atb/utils/weights.py::Weights.__init__ (order moe,
    dense, attn, model, norm); atb/utils/mapping.py: attn_tp = r % tp, moe_tp = r % moe_tp, moe_ep = r // moe_tp."""
    a, t, e = r % tp, r % moe_tp, r // moe_tp
    return [f"model-moe-tp-{str(t).zfill(3)}-ep-{str(e).zfill(3)}", f"model-dense-tp-{str(a).zfill(3)}",
            f"model-attn-tp-{str(a).zfill(3)}", f"model-{str(r).zfill(3)}", "model-norm"]


def rank_routing(d: Path, r: int, tp: int, moe_tp: int, p: Problems) -> dict:
    """weights.py::Weights.__init__ (every folder must hold safetensors) + ::load_routing (no name twice)."""
    route: dict = {}
    for f in folders(r, tp, moe_tp):
        if not (d / f).is_dir():
            p.add("Weights.__init__", f"rank {r}: {f} does not exist")
            continue
        for name, v in routing(d / f, p, f"rank {r} {f}").items():
            if name in route:
                p.add("load_routing", f"rank {r}: {name} in {route[name][0].parent.name} and {f}")
            route[name] = v
    return route


def replicated(route: dict, desc: dict, module: str, rq: str, r: int, p: Problems) -> None:
    """linear/__init__.py::support_load_sharded_weight -> TensorReplicatedLinear.load(prefix=module_name) ->
    weights.py::get_replicated_weights: weight, and the region's aux tensors unless the weight is float;
    pack_type.py::calc_*_linear_pack_type: desc[module.weight] (KeyError)."""
    w = module + ".weight"
    if desc and w not in desc:
        p.add("calc_linear_pack_type", f"rank {r}: KeyError {w}")
    if w not in route:
        p.add("get_filename", f"rank {r}: weight {w} does not exist")
        return
    if route[w][1] in FLOAT_DTYPES:
        return
    for param in READS.get(rq, ()):
        if f"{module}.{param}" not in route:
            p.add("get_replicated_weights", f"rank {r}: weight {module}.{param} does not exist ({rq})")


def read(d: Path) -> Problems:
    p = Problems()
    if not (d / "model_sharded_metadata.json").is_file():
        p.add("Weights.__init__", "no model_sharded_metadata.json: not loaded as sharded")
        return p
    meta = read_json(d / "model_sharded_metadata.json")
    po = meta["parallel_option"]
    W, tp, moe_tp, moe_ep = meta["world_size"], po["tp"], po["moe_tp"], po["moe_ep"]
    cfg = read_json(d / "config.json")
    quantize = cfg.get("quantize")
    desc = {}
    if quantize not in (None, "float"):
        if quantize not in QUANT_TYPES:
            p.add("get_linear", f"quantize={quantize!r}")
        if not (d / "quant_model_description.json").is_file():
            p.add("_set_quant_params", "no quant_model_description.json at the root")
            return p
        desc = read_json(d / "quant_model_description.json")
    mla, moe = cfg.get("mla_quantize", quantize), cfg.get("moe_quantize", quantize)
    n_layers, first_dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0)
    heads, nope, rope, v, lora = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                                  cfg["v_head_dim"], cfg["kv_lora_rank"])
    E = cfg["n_routed_experts"]
    per = -(-E // moe_ep)  # atb/utils/moe_utils.py::assign
    for r in range(W):
        route = rank_routing(d, r, tp, moe_tp, p)
        e_local = len(range(min(E, (r // moe_tp) * per), min(E, (r // moe_tp + 1) * per)))
        need = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
        for L in range(n_layers):
            a = f"model.layers.{L}.self_attn."
            need += [f"model.layers.{L}.input_layernorm.weight", f"model.layers.{L}.post_attention_layernorm.weight",
                     a + "kv_a_layernorm.weight"]
            q = ["q_a_proj", "q_b_proj"] if cfg.get("q_lora_rank") else ["q_proj"]
            if cfg.get("q_lora_rank"):
                need.append(a + "q_a_layernorm.weight")
            for m in q + ["kv_a_proj_with_mqa", "o_proj"]:
                replicated(route, desc, a + m, mla, r, p)
            # modeling_deepseekv2.py L173-188: k_b/v_b by their MindIE names, 3-D
            for m, shape in (("k_b_proj", (heads // tp, nope, lora)), ("v_b_proj", (heads // tp, lora, v))):
                name = a + m + ".weight"
                if desc and name not in desc:
                    p.add("calc_linear_pack_type", f"rank {r}: KeyError {name}")
                if name not in route:
                    p.add("get_filename", f"rank {r}: weight {name} does not exist")
                elif route[name][2] != shape:
                    p.add("preprocess_kv_weights", f"rank {r}: {name} {route[name][2]}, expected {shape}")
            m = f"model.layers.{L}.mlp."
            if L < first_dense:  # DeepseekMLP: gate_up_proj pack entry
                for x in ("gate_up_proj", "down_proj"):
                    replicated(route, desc, m + x, quantize, r, p)
                continue
            # DeepseekMoE.__init__ / init_experts (sharded: layer-prefix pack entry, stacked experts)
            need += [m + "gate.weight"] + ([m + "gate.bias"] if cfg.get("topk_method", "noaux_tc") == "noaux_tc" else [])
            for x in ("shared_experts.gate_up_proj", "shared_experts.down_proj"):
                replicated(route, desc, m + x, quantize, r, p)
            for x in ("gate_up_proj", "down_proj"):
                replicated(route, desc, m + x, moe, r, p)
                name = m + x + ".weight"
                if name in route and route[name][2][0] != e_local:
                    p.add("load_moe", f"rank {r}: {name} stacks {route[name][2][0]} experts, the EP rank has {e_local}")
        for name in need:
            if name not in route:
                p.add("get_filename", f"rank {r}: weight {name} does not exist")
    router_in_source_order(d, p)
    return p


def router_in_source_order(d: Path, p: Problems) -> None:
    """modeling_deepseek.py::DeepseekMoE.__init__ (ep_level 1) rotates gate.weight/gate.bias rows to the rank's
    first expert at load time, with no check of weights.sharded (fast_linear.py::FastLinear.load reads the stored
    `gate.weight` when sharded): the stored rows must be the same, unrotated, in every EP folder."""
    import numpy as np

    from tests.engine_contract.common import tensor

    seen: dict[str, np.ndarray] = {}
    for folder in sorted(x for x in d.iterdir() if x.name.startswith("model-moe-")):
        route = routing(folder, p, folder.name)
        for name in route:
            if name.endswith((".mlp.gate.weight", ".mlp.gate.bias")):
                t = tensor(route, name)
                if name in seen and not np.array_equal(seen[name], t):
                    p.add("DeepseekMoE.__init__", f"{folder.name}: {name} rows differ from another EP rank's "
                                                  "(stored rotated: the loader rotates them again)")
                seen.setdefault(name, t)
