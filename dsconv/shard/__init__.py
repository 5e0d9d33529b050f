"""`dsconv shard`: EP/TP plans that fit and balance, per-rank weights, and the cluster files.

From headers or config.json alone: layout.py reads the parallel options (and MindIE's rules on them), table.py groups
the tensors into kinds, placement.py places each kind on the ranks by its Role, plan.py judges one layout end to end
and finds alternatives; balance.py places the routed experts (contiguous / by bytes / DeepSeek EPLB) and checks weight
bytes per card; memory.py checks each card's HBM (weights + KV + workspace). Then ranktable.py writes the HCCL rank
table and MindIE's parallel settings, write.py streams the rank directories and chart.py shows the plan.
stage.py (`run(ShardRequest) -> ShardResult`, and the text the command prints) runs them in that order.
"""
