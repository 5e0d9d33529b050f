"""The mixed recipe of `--bits 8` (static W8A8): which roles get per-token dynamic activations instead.

The input of a gated MLP's down_proj (f(gate) * up) carries the largest activation outliers of an LLM, and on real
models they are token-wise (a few "massive activation" tokens, e.g. the first of each prompt, reach thousands while
the rest stay below ten): one per-tensor static range cannot serve both, whatever the smoothing or clipping.
Ascend's own static-W8A8 practices leave every down_proj out of static quantization for this reason
(docs/formats.md); dsconv gives them W8A8_DYNAMIC (per-token scales, still int8 GEMMs), which keeps q/k/v,
o_proj and gate/up static: 6 of 7 linears of a dense layer (86%). `--recipe uniform` keeps everything static.
"""
from __future__ import annotations

from dsconv.families.roles import Role
from dsconv.qformat import STATIC_TYPES
from dsconv.quant.formats.msmodelslim import FLOAT

DYNAMIC = "W8A8_DYNAMIC"
RECIPES = ("mixed", "uniform")
DEFAULT_RECIPE = "mixed"


# MindIE reads one quantized type per region (config.json `quantize`), so there down_proj cannot be dynamic inside a
# static model: it stays float, as in msModelSlim's own static-W8A8 practices.
RECIPE_FLOAT_REASON = "recipe mixed: down_proj kept float (the engine reads one quantized type per region)"


def planned_type(qtype: str, role: Role, recipe: str = DEFAULT_RECIPE, mix_ok: bool = True) -> str:
    """The type a linear of `role` gets when the scheme asks for `qtype` (FLOAT where the engine cannot mix types)."""
    if qtype in STATIC_TYPES and recipe == "mixed" and role == Role.MLP_OUT:
        return DYNAMIC if mix_ok else FLOAT
    return qtype
