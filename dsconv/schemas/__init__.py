"""Validated readers for every JSON/TOML/text input dsconv reads (layer 1, beside the reader and the writer).

One way in per file kind; each returns data of checked types and bounds or raises UserError (exit 2) naming the file,
the field or tensor, and the fix. `core` holds the bounded parsers and typed field access, `model` the model
directory's metadata (safetensors headers, index, config.json, their agreement), `files` everything else.
"""
from dsconv.schemas.core import (Fields, decode_utf8, parse_json, read_bytes, read_json, read_toml)  # noqa: F401
from dsconv.schemas.model import config, inventory, safetensors_header, safetensors_index  # noqa: F401
from dsconv.schemas.files import (atc_profile, calibration_rows, expert_load, hosts_file, manifest,  # noqa: F401
                                  quant_description, shard_plan, workspace_toml)
