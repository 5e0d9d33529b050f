"""Model builders fed by the one reader (dsconv.checkpoint) and described by the family tables (dsconv.families):
torch_builder (transformers' own module: export, quantize, eval, the MindIR reference) and ms (the MindSpore network
of the MindIR export)."""
