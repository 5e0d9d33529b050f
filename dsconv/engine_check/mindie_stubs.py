"""Stand-ins for the Ascend-only pieces MindIE-LLM imports, so its real weight loader runs on a CPU host.

The pattern is MindIE-LLM's own CPU unit tests (tests/pythontest/conftest.py and
examples/atb_models/tests/pythontest/atb_llm/models/base/mock_class.py in its repository): modules whose attributes
are mocks (`torch_npu`, `acl`, `_libatb_torch`, `llm_datadist`, `torchair`, `numba`), a device "npu" that is the CPU,
and a recorder where the ATB graph object would be. Nothing here decides which tensor is read, how it is cast,
packed, permuted or split: that is all MindIE's own code. Three stand-ins compute, each what the NPU op does:
- `npu_format_cast` (ND -> NZ) returns its input: the layout of the bytes on the card is not checked here;
- `npu_trans_quant_param` turns a float deq_scale into the int64 word the quantized matmul reads: the float32 bit
  pattern with the low 13 mantissa bits cleared, in the low 32 bits (CANN's documented conversion);
- an fp16 masked fill outside fp16's range gives +-inf, as the NPU cast does.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from typing import Any
from unittest.mock import MagicMock

#: torch_npu._C._npu_get_soc_version(): 224 is an Atlas 800I A2 (910B4 class, bf16 capable)
SOC_VERSION = 224


def trans_quant_param(scale: Any, offset: Any = None) -> Any:
    """CANN's npu_trans_quant_param on a host: float32 deq_scale -> int64 words (low 13 mantissa bits cleared)."""
    import torch

    bits = scale.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFE000
    return bits.to(scale.device) if hasattr(scale, "device") else bits


class GraphRecorder:
    """torch.classes.ModelTorch.ModelTorch: records the parameters and weight list a model hands to its ATB graph."""

    instances: list["GraphRecorder"] = []

    def __init__(self, name: str = "", *args: Any) -> None:
        self.name = name
        self.params: list[Any] = []
        self.weights: list[Any] = []
        self.kv_cache: list[Any] = []
        GraphRecorder.instances.append(self)

    def set_param(self, param: Any) -> str:
        self.params.append(param)
        return "{}"

    def set_weight(self, weights: Any) -> None:
        self.weights = list(weights)

    def set_kv_cache(self, k: Any, v: Any) -> None:
        self.kv_cache = [k, v]

    def __getattr__(self, name: str) -> Any:
        return MagicMock(name=f"ModelTorch.{name}")


def _module(name: str, attrs: dict | None = None) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.util.spec_from_loader(name, loader=None)
    m.__path__ = []
    for k, v in (attrs or {}).items():
        setattr(m, k, v)
    return m


class _MockModules:
    """A meta-path finder that answers the listed top-level packages (and their submodules) with mock modules."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".")[0] not in self.roots or name in sys.modules:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        m = MagicMock(name=spec.name)
        m.__spec__, m.__path__, m.__name__, m.__file__ = spec, [], spec.name, f"<stand-in {spec.name}>"
        m.__version__ = "0.0.0+stand-in"
        return m

    def exec_module(self, module: Any) -> None:
        pass


def install() -> None:
    """Register the stand-ins; call before importing atb_llm or mindie_llm."""
    import torch

    sys.meta_path.insert(0, _MockModules(("torch_npu", "acl", "_libatb_torch", "llm_datadist", "torchair", "numba",
                                          "triton", "torchvision", "torchaudio", "av", "janus", "decord")))
    import torch_npu  # noqa: F401  (created by the finder above; the real pieces set next)
    import torch_npu._C  # noqa: F401

    npu = sys.modules["torch_npu"]
    npu._C._npu_get_soc_version = MagicMock(return_value=SOC_VERSION)
    npu.npu_format_cast = lambda t, fmt=None, *a, **k: t
    npu.npu_format_cast_ = lambda t, fmt=None, *a, **k: t
    npu.npu_trans_quant_param = trans_quant_param
    npu.get_npu_format = lambda t: 2

    try:
        torch.utils.rename_privateuse1_backend("npu")
    except RuntimeError:
        pass
    torch.npu = MagicMock(name="torch.npu")
    torch.npu.is_available.return_value = True
    torch.npu.device_count.return_value = 8
    torch.npu.current_device.return_value = 0
    torch.npu.get_device_name.return_value = "Ascend910B4"
    torch.npu.mem_get_info.return_value = (60 << 30, 64 << 30)
    torch.Tensor.npu = lambda self, *a, **k: self

    _device_is_cpu(torch)
    _fp16_fill_saturates(torch)

    torch.classes.load_library = lambda path: None
    # libatb_speed_torch.so's classes: the graph objects record what a model hands them; operations are mocks
    atb_classes = {"ModelTorch": types.SimpleNamespace(ModelTorch=GraphRecorder, Context=MagicMock(name="Context"),
                                                       Event=MagicMock(name="Event"))}
    real_getattr = type(torch.classes).__getattr__

    def classes_getattr(self: Any, name: str) -> Any:
        if name.endswith("Torch"):
            return atb_classes.setdefault(name, MagicMock(name=f"torch.classes.{name}"))
        return real_getattr(self, name)

    type(torch.classes).__getattr__ = classes_getattr

    class Popen(subprocess.Popen):  # npu-smi / lspci: a host without an NPU answers with empty output
        def __init__(self, args: Any, *a: Any, **k: Any) -> None:
            name = (args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]).rsplit("/", 1)[-1]
            if name in ("npu-smi", "lspci"):
                args = [sys.executable, "-c", ""]
            super().__init__(args, *a, **k)

    subprocess.Popen = Popen


def _device_is_cpu(torch: Any) -> None:
    """Tensors created or moved "on npu" land on the CPU (torch.device('npu:0') itself stays constructible)."""

    def cpu(device: Any) -> Any:
        if device is None:
            return None
        s = str(device)
        return "cpu" if s.startswith("npu") else device

    real_to = torch.Tensor.to

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple(cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = cpu(kwargs["device"])
        return real_to(self, *args, **kwargs)

    torch.Tensor.to = to
    for fname in ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "zeros_like", "ones_like",
                  "empty_like", "full_like", "as_tensor", "eye", "linspace"):
        real = getattr(torch, fname)

        def wrapped(*a: Any, _real: Any = real, **k: Any) -> Any:
            if "device" in k:
                k["device"] = cpu(k["device"])
            return _real(*a, **k)

        setattr(torch, fname, wrapped)


def _fp16_fill_saturates(torch: Any) -> None:
    """A float16 masked fill with a value beyond its range saturates to +-inf on the NPU; CPU torch raises."""
    def saturating(real: Any) -> Any:
        def masked_fill(self: Any, mask: Any, value: Any) -> Any:
            if self.dtype == torch.float16 and isinstance(value, float) and abs(value) > 65504.0:
                value = float("inf") if value > 0 else float("-inf")
            return real(self, mask, value)
        return masked_fill

    torch.Tensor.masked_fill = saturating(torch.Tensor.masked_fill)
    torch.masked_fill = saturating(torch.masked_fill)
