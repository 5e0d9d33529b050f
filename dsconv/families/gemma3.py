"""Gemma 3 (text): Llama's table plus Qwen3's q/k norms and a second pair of norms around the MLP (sandwich layers:
the attention and MLP outputs are normed again before the residual add); tied embeddings by default.

What else differs is computation, read from transformers' config object by the MindSpore block
(model/ms/gemma3.py) and run by transformers itself elsewhere: GeGLU (`hidden_activation`), RMSNorm weights
stored as offsets from 1, embeddings scaled by sqrt(hidden), sliding/full layer types with their own rope bases,
query_pre_attn_scalar, final-logit softcapping.
"""
from dsconv.families.base import LAYER, Family, register
from dsconv.families.rows import decoder, dense_mlp, gqa_attention, norm, qk_norm


@register
class Gemma3(Family):
    name = "gemma3"
    model_types = ("gemma3_text",)
    table = decoder(attention=(*gqa_attention(), *qk_norm()),
                    mlp=(*norm(key="norm.pre_ff", module=LAYER + "pre_feedforward_layernorm"), *dense_mlp(),
                         *norm(key="norm.post_ff", module=LAYER + "post_feedforward_layernorm")))
    # one sliding layer (window 4, shorter than the check inputs) and one full; scalar != head_dim; softcapped logits
    tiny = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4, "final_logit_softcapping": 30.0,
            "layer_types": ["sliding_attention", "full_attention"]}
    norm_offset = 1.0
    engine_refused = {"mindie": (
        "its model router takes a model_type only where atb_llm/models/ has a folder of that name, and it has no "
        "gemma3_text (nor any gemma) folder (NotImplementedError 'unsupported model type: gemma3_text')",
        "MindIE-LLM atb_llm/models/__init__.py::get_model")}
    engine_refused_dtypes = {"vllm-ascend": (frozenset({"F16"}), "vLLM refuses gemma3_text in float16 ('Numerical "
                                             "instability. Please use bfloat16 or float32 instead.')",
                                             "vllm-ascend 0.23.0.post1 on vLLM 0.23.0: vllm/config/model.py::"
                                             "_FLOAT16_NOT_SUPPORTED_MODELS")}
    # post_attention_layernorm and post_feedforward_layernorm normalise each block's output before the residual add:
    # a norm's scale acts after its RMS, so it neither folds into o_proj / down_proj nor commutes with a rotation
    rotation_refused = ("its post_attention_layernorm and post_feedforward_layernorm normalise each block's output "
                        "before the residual add, so the residual stream passes through norms whose scale cannot "
                        "be folded into a linear, and an orthogonal rotation of it does not survive them")
    config_keys = {**Family.config_keys, "head_dim": 256, "tie_word_embeddings": True,  # Gemma3TextConfig's defaults
                   "hidden_activation": "gelu_pytorch_tanh"}

    def _facts(self, c):
        f = super()._facts(c)
        f.hidden_act = c["hidden_activation"]
        return f
