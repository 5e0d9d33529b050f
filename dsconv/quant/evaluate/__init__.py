"""`dsconv eval` and the quantized model as others see it: the eval stage (stage), the perplexity / logit comparison
against the original (fidelity), an exported ONNX model as a language model (onnx_lm), and the quantize output as a
fake-quantized torch model for the ONNX export (fakequant).

Inside quant/ rather than a stage of its own: it reads the quantize output through quant's own formats and algorithms,
and a stage never imports another stage. It never imports calibrate/: the layer runner, the texts and the metrics it
shares with quantize are dsconv.runner's."""
