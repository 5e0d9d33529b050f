"""What quantize and eval share and neither owns: transformers' decoder layers run one at a time from the checkpoint
(layers), the text files and the model's tokenizer (texts), and the figures eval reports (metrics)."""
