"""The quantization math, on arrays: schemes (int8/int4 rounding, scales, packing), fake_quant (quantize then
dequantize, per rounding rule), error_metrics (relative errors), grid (clip-ratio search), gptq, observers (activation
ranges), sampling (a row sample reproducible across jobs), smoothing (SmoothQuant), clipping (ranges chosen by output
error), selection (the held-out split) and methods (the weight-rounding method names)."""
