"""The quantization math, on arrays: schemes (int8/int4 rounding, scales, packing), grid (clip-ratio search), gptq,
observers (activation ranges), smoothing (SmoothQuant), clipping (ranges chosen by output error), selection (the
held-out split) and methods (the weight-rounding method names)."""
