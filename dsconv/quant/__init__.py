"""Quantization: the math (algorithms/), the calibrated path (calibrate/), what a run is asked and decides (plan/), the
output formats (formats/) and `dsconv eval` (evaluate/); stage.py runs a quantize, streaming.py is the weight-only path
(no calibration), weights.py quantizes one linear's weight the same way on both paths."""
