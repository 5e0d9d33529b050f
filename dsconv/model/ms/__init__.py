"""The MindSpore network of a checkpoint: shared blocks (blocks.py), the generic builder driven by the family table
(build.py), the tensor source with its bookkeeping (weights.py), and one block per op no other family has (mla.py).
Importing a submodule imports MindSpore (optional: dsconv[mindir])."""
