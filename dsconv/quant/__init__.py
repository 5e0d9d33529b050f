"""Quantization: the math (schemes, observers, GPTQ), calibration and the output formats."""
