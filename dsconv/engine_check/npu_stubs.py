"""Stand-ins for the Ascend-only modules vLLM-Ascend imports, so its real loader runs on a CPU host.

The pattern is vLLM-Ascend's own unit-test setup (tests/ut/conftest.py in its source): fake `torch_npu`,
`acl`, `mooncake.engine` and `triton.runtime` modules, `torch.npu`, and the privateuse1 backend renamed to "npu".
Nothing here computes: weight loading runs vLLM's and vLLM-Ascend's own code; only what happens after loading
(`process_weights_after_loading`, NPU kernels) would touch these stubs, and the check never relies on it.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any
from unittest.mock import MagicMock


def _module(name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.util.spec_from_loader(name, loader=None)
    return m


class _TorchvisionStandIn:
    """torchvision is imported by transformers' image processors that vLLM's model registry touches; PyPI's
    torchvision wheels are CUDA builds that fail beside the CPU torch, and no image is ever processed here."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torchvision" and not name.startswith("torchvision."):
            return None
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        m = MagicMock(name=spec.name)
        m.__spec__, m.__path__, m.__name__ = spec, [], spec.name
        m.__version__ = "0.0.0+stand-in"
        return m

    def exec_module(self, module: Any) -> None:
        pass


def install() -> None:
    """Register the stand-ins in sys.modules; call before importing vllm or vllm_ascend."""
    triton_runtime = MagicMock()
    triton_runtime.driver.active.utils.get_device_properties.return_value = {"num_aic": 8, "num_vectorcore": 8}
    sys.modules["triton.runtime"] = triton_runtime

    npu = _module("torch_npu")
    npu.__path__ = []
    npu.npu = MagicMock()
    npu.npu.current_device = MagicMock(return_value=0)
    npu.profiler = MagicMock()
    npu.npu_format_cast = MagicMock(side_effect=lambda weight, fmt: weight)   # format casts are identity here
    npu._C = MagicMock()
    npu._C._NPUTaskGroupHandle = MagicMock
    sys.modules["torch_npu"] = npu
    sys.modules["torch_npu._C"] = npu._C
    sys.modules["torch_npu._C._distributed_c10d"] = npu._C._distributed_c10d
    sys.modules["torch_npu._inductor"] = MagicMock()

    acl_rt = _module("acl.rt")
    acl_rt.memcpy = MagicMock()
    acl = _module("acl")
    acl.rt = acl_rt
    sys.modules["acl"], sys.modules["acl.rt"] = acl, acl_rt

    mooncake = _module("mooncake.engine")
    mooncake.TransferEngine = MagicMock()
    sys.modules["mooncake.engine"] = mooncake

    sys.meta_path.insert(0, _TorchvisionStandIn())

    import torch

    try:
        torch.utils.rename_privateuse1_backend("npu")
    except RuntimeError:
        pass
    torch.npu = MagicMock()
    torch.npu.Stream = MagicMock
    torch.npu.is_available = MagicMock(return_value=False)
    torch.version.cann = None
    torch.distributed.is_hccl_available = MagicMock(return_value=True)
