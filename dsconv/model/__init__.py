"""Model builders fed by the one reader: transformers modules for torch (torch_builder), MindSpore networks."""
