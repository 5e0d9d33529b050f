"""The `dsconv atc` stage: ATC/OM compile profiles for Ascend SoCs, checked before ATC runs.

profiles.py (SoC facts from atc_profiles/), options.py (ATC option grammar and combination rules), graph.py (the ONNX
header), shapes.py (input shapes and gears), fusion.py (fusion switch file), preflight.py (the rules), cast.py
(--cast-fp16 and its onnxruntime check), runner.py (atc where it exists), stage.py (the whole stage,
`run(AtcRequest) -> AtcResult`, and the text the command prints).
"""
