"""One small module per command, each registering itself on `dsconv.cli.cli` (pipeline order below).

Commands stay thin: parse options, resolve workspace defaults, call one stage function, print its summary.
"""
from dsconv.commands import workspace_cmds  # noqa: F401  init, inspect, verify
from dsconv.commands import atc  # noqa: F401
from dsconv.commands import demo  # noqa: F401
from dsconv.commands import shard  # noqa: F401
from dsconv.commands import quantize  # noqa: F401
from dsconv.commands import export  # noqa: F401
from dsconv.commands import eval  # noqa: F401
