"""A real dense Qwen2 checkpoint restated as a one-expert `qwen2_moe` checkpoint with the same function.

    python -m benchmarks.moe_restatement DENSE_DIR OUT_DIR

Why: no trained MoE model ships on PyPI, and the W4A8 recipe quantizes routed experts only. Restating the real
Qwen2.5-Coder-0.5B as a MoE of one routed expert (its MLP, unchanged) puts real trained MLP weights and real
activations through the routed-expert path of `quantize --scheme w4a8_dynamic`: int4 per-channel experts with
per-token int8 activations, W8A8_DYNAMIC attention. Routing is trivial (softmax over one expert = 1), and the shared
expert is all zeros (its output is exactly 0), so the float model computes what the dense one does; the benchmark
checks that on the float perplexity before quantizing. What it cannot show: the effect of routing sparsity (each
real expert sees a fraction of the tokens).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

SHARED_I = 16  # the zero shared expert's width: the smallest the layout takes (even rows, W8A8_DYNAMIC)


def restate(dense: Path, out: Path) -> Path:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.loads((dense / "config.json").read_text())
    if cfg.get("model_type") != "qwen2":
        raise SystemExit(f"{dense}: a qwen2 checkpoint is needed, got {cfg.get('model_type')}")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    moe = {**cfg, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 1,
           "num_experts_per_tok": 1, "moe_intermediate_size": I, "shared_expert_intermediate_size": SHARED_I,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False, "qkv_bias": True,
           "output_router_logits": False, "router_aux_loss_coef": 0.0}
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(dense.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                if ".mlp." in name:
                    prefix, proj = name.split(".mlp.")
                    tensors[f"{prefix}.mlp.experts.0.{proj}"] = t
                else:
                    tensors[name] = t
    dtype = next(iter(tensors.values())).dtype
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp"
        tensors[f"{p}.gate.weight"] = torch.zeros(1, H, dtype=dtype)
        tensors[f"{p}.shared_expert.gate_proj.weight"] = torch.zeros(SHARED_I, H, dtype=dtype)
        tensors[f"{p}.shared_expert.up_proj.weight"] = torch.zeros(SHARED_I, H, dtype=dtype)
        tensors[f"{p}.shared_expert.down_proj.weight"] = torch.zeros(H, SHARED_I, dtype=dtype)
        tensors[f"{p}.shared_expert_gate.weight"] = torch.zeros(1, H, dtype=dtype)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(moe, indent=2) + "\n")
    for f in dense.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" and not f.name.endswith(".json.index"):
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    restate(Path(sys.argv[1]), Path(sys.argv[2]))
