"""One small module per command; `dsconv.cli` adds them to the group in pipeline order.

Commands stay thin: parse options, resolve workspace defaults, call one stage function, print its summary. They import
their shared options from `options.py`, never `dsconv.cli` (which imports them).
"""
