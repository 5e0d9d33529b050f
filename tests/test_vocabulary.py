"""Layer 0: the one dtype table agrees with torch and numpy, sizes read and print as documented, and the SoC facts
that inspect and shard read are the ones the full ATC profile states."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsconv.atc.profiles import load_profile
from dsconv.errors import UserError
from dsconv.soc import available_socs, soc_facts
from dsconv.tensors import (DTYPE_FROM_CONFIG, DTYPES, PRECISIONS, TensorSpec, config_dtype_name, human_bytes,
                            parse_size, precision_torch_dtype, safetensors_dtype, torch_dtype)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", [d for d in DTYPES if DTYPES[d].torch])
def test_dtype_table_agrees_with_torch(name):
    t = torch.zeros(3, dtype=torch_dtype(name))
    assert t.element_size() == DTYPES[name].size
    assert safetensors_dtype(t) == name
    assert t.is_floating_point() == DTYPES[name].floating


@pytest.mark.parametrize("name", [d for d in DTYPES if DTYPES[d].numpy])
def test_dtype_table_agrees_with_numpy(name):
    a = np.zeros(2, dtype=np.dtype(DTYPES[name].numpy))
    assert a.itemsize == DTYPES[name].size
    assert safetensors_dtype(a) == name


def test_precisions_and_config_names():
    assert {p: config_dtype_name(p) for p in PRECISIONS} == {"fp32": "float32", "fp16": "float16",
                                                             "bf16": "bfloat16"}
    assert precision_torch_dtype("bf16") is torch.bfloat16
    assert DTYPE_FROM_CONFIG["half"] == "F16" and DTYPE_FROM_CONFIG["bfloat16"] == "BF16"
    assert TensorSpec("w", "BF16", (3, 5)).nbytes == 30
    with pytest.raises(KeyError):
        torch_dtype("F8_E8M0")  # no torch dtype here: a KeyError, never a wrong one


def test_sizes():
    assert parse_size("4GB") == 4 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(7) == 7
    with pytest.raises(UserError):
        parse_size("lots")
    assert human_bytes(1536) == "1.50 KiB" and human_bytes(1000) == "1,000 B"
    assert human_bytes(2 * 2**40 * 1500) == "3,000.00 TiB"


@pytest.mark.parametrize("soc", available_socs())
def test_soc_facts_are_the_profiles(soc):
    facts, prof = soc_facts(soc), load_profile(soc)
    assert (facts.soc_version, facts.device_memory_mb, facts.usable_memory_mb, facts.bf16, facts.fp16,
            facts.assumed_from) == (prof.soc_version, prof.device_memory_mb, prof.usable_memory_mb, prof.bf16,
                                    prof.fp16, prof.assumed_from)


def test_soc_names():
    assert soc_facts("ascend910b").assumed_from == "Ascend910B"
    assert not soc_facts("Ascend310P3").bf16
    with pytest.raises(UserError, match="no dsconv profile"):
        soc_facts("Ascend999")
