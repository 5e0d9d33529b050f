"""Output layouts of quantized checkpoints. One today: msModelSlim's (MindIE / vLLM-Ascend), in its current and its
older MindIE file naming (`--layout mindie`)."""
from dsconv.quant.formats.msmodelslim import (LAYOUTS, QuantLinear, check_description, description_types,
                                              emit_linear, layout_names, read_linear)

__all__ = ["LAYOUTS", "QuantLinear", "check_description", "description_types", "emit_linear", "layout_names",
           "read_linear"]
