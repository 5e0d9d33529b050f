"""Property-based tests of every validated reader (dsconv/schemas): seeded, a few hundred cases each.

The property: for ANY input a reader either returns data of the promised types or raises
UserError (exit 2, one line) - never another exception. Valid documents round-trip unchanged.
"""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsconv import schemas
from dsconv.errors import UserError
from dsconv.schemas.model import DTYPE_SIZES

pytestmark = [pytest.mark.unit]

SETTINGS = settings(max_examples=300, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                        st.dictionaries(st.text(max_size=10), c, max_size=4)),
                           max_leaves=20)
clean_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), st.floats(allow_nan=False, allow_infinity=False),
              st.text(st.characters(exclude_categories=("Cs",)), max_size=20)),
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=10), c, max_size=4)),
    max_leaves=20)
hostile_bytes = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda d, s: d * b"[" + s + d * b"]", st.integers(0, 3000), st.sampled_from([b"", b"1", b'"\\ud800"'])),
    st.builds(lambda n: b'{"a": ' + b"7" * n + b"}", st.integers(1, 6000)),
    json_values.map(lambda v: json.dumps(v, allow_nan=True).encode("utf-8", "surrogatepass")),
)


def only_user_errors(fn, *args):
    try:
        return fn(*args)
    except UserError as e:
        assert "\n" not in e.one_line()
        return None


@SETTINGS
@given(hostile_bytes)
def test_parse_json_never_crashes(raw):
    only_user_errors(schemas.parse_json, raw, "f.json", "fix it")


@SETTINGS
@given(clean_values)
def test_valid_json_round_trips(value):
    raw = json.dumps(value).encode()
    parsed = schemas.parse_json(raw, "f.json", "fix it")
    assert parsed == value or (isinstance(value, float) and math.isnan(value))


def header_entries():
    dims = st.lists(st.integers(0, 5), max_size=3)
    return st.dictionaries(st.text(st.characters(codec="ascii"), min_size=1, max_size=8),
                           st.tuples(st.sampled_from(sorted(DTYPE_SIZES)), dims), max_size=6)


@SETTINGS
@given(header_entries(), st.data())
def test_safetensors_header_accepts_valid_and_rejects_mutants(entries, data):
    header, offset = {}, 0
    for name, (dtype, shape) in entries.items():
        n = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    assert schemas.safetensors_header(raw, "m.safetensors", offset) == header
    # a mutated header (any byte changed, or a hostile value) is either still consistent or a UserError
    i = data.draw(st.integers(0, max(0, len(raw) - 1)))
    mutant = raw[:i] + data.draw(st.binary(min_size=1, max_size=3)) + raw[i + 1:]
    only_user_errors(schemas.safetensors_header, mutant, "m.safetensors", offset)
    if header:
        name = next(iter(header))
        key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        header[name][key] = data.draw(json_values)
        only_user_errors(schemas.safetensors_header, json.dumps(header, allow_nan=True).encode(), "m", offset)


BASE_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 320,
               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}


def _family_config_keys() -> set[str]:
    """Every key a family reads (Family.config_keys): a key a family starts reading is fuzzed here too."""
    from dsconv.families import families

    return set().union(*(f.config_keys for f in families()))


CONFIG_KEYS = sorted(set(schemas.model._INTS) | set(schemas.model._NUMBERS) | set(schemas.model._BOOLS)
                     | _family_config_keys())


@SETTINGS
@given(st.sampled_from(["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"]),
       st.dictionaries(st.sampled_from(CONFIG_KEYS), json_values, max_size=4))
def test_config_accepted_means_every_family_can_use_it(model_type, changes):
    """A config schemas.config accepts never crashes the family: facts and the synthesized tensor list work."""
    from dsconv.families import family_for, supported_model_types

    cfg = dict(BASE_CONFIG, model_type=model_type)
    if model_type == "deepseek_v3":
        cfg.update(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32)
    cfg.update(changes)
    def validate(c):  # what Checkpoint.open and ConfigOnly.open run
        schemas.config(c, "config.json", supported_model_types())
        schemas.model.config_fields(c, "config.json", family_for(c).config_keys)
        return c

    ok = only_user_errors(validate, cfg)
    if ok is not None:
        fam = family_for(cfg)
        facts = only_user_errors(fam.facts, cfg)
        if facts is not None:
            n = sum(1 for _ in fam.iter_shapes(facts))
            assert 0 < n <= schemas.model.MAX_TENSORS + 10_000


@pytest.mark.parametrize("reader,name", [
    (schemas.manifest, "dsconv_manifest.json"), (schemas.quant_description, "quant_model_description.json"),
    (schemas.workspace_toml, "dsconv.toml"), (schemas.expert_load, "expert_load.json"),
    (schemas.hosts_file, "hosts.txt"), (lambda p: schemas.atc_profile(p, 1), "profile.json"),
    (lambda p: schemas.calibration_rows(p, schemas.decode_utf8(p.read_bytes(), str(p))), "calib.jsonl"),
    (lambda p: schemas.calibration_rows(p, schemas.decode_utf8(p.read_bytes(), str(p))), "calib.json"),
])
def test_file_readers_never_crash(reader, name, tmp_path):
    path = tmp_path / name

    @SETTINGS
    @given(st.one_of(hostile_bytes, st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass"))))
    def check(raw):
        path.write_bytes(raw)
        only_user_errors(reader, path)

    check()


def test_file_readers_accept_their_valid_forms(tmp_path):
    p = tmp_path / "dsconv_manifest.json"
    p.write_text(json.dumps({"stage": "quantize", "files": {"a/b.json": {"sha256": "0" * 64, "size": 3}}}))
    assert schemas.manifest(p)["stage"] == "quantize"
    p = tmp_path / "hosts.txt"
    p.write_text("10.0.0.1 10.1.0.1 10.1.0.2\n# comment\n")
    assert schemas.hosts_file(p)[0][:2] == ("10.0.0.1", ["10.1.0.1", "10.1.0.2"])
    p = tmp_path / "expert_load.json"
    p.write_text('{"layers": {"3": [1, 2.5, 0]}}')
    assert schemas.expert_load(p) == {3: [1.0, 2.5, 0.0]}
    p = tmp_path / "dsconv.toml"
    p.write_text('[workspace]\nmodel = "m"\n')
    assert schemas.workspace_toml(p)["workspace"]["model"] == "m"


def test_every_key_a_family_reads_has_a_kind():
    """config_fields checks a declared key by its kind; a key with none would be a KeyError when a config is read."""
    assert all(schemas.model.config_key_known(k) for k in _family_config_keys())


@pytest.mark.parametrize("value", [None, "x", [1], {"a": 1}, -1, 2.5, True, 2**40])
def test_config_fields_either_types_or_user_error(value):
    """Each key each family reads, set to a hostile value: the family's facts are computed or a UserError names
    config.json and the key - never a TypeError in a shape (families/base.py) or the memory estimate."""
    from dsconv.families import families
    from dsconv.tiny import tiny_config

    for fam in families():
        base = tiny_config(fam.name).to_dict()
        for key in fam.config_keys:
            cfg = dict(base, **{key: value})
            try:
                facts = fam.facts(cfg)
            except UserError as e:
                assert f'"{key}"' in e.one_line() and "config.json" in e.one_line(), (fam.name, key, e.one_line())
                continue
            assert sum(1 for _ in fam.iter_shapes(facts)) > 0
            assert isinstance(facts.experts_per_tok, int) and isinstance(facts.intermediate_size, int)


def test_config_rejects_issue_examples():
    bad = {"num_hidden_layers": "2", "hidden_size": 2.5, "model_type": [], "num_key_value_heads": "2",
           "n_shared_experts": float("inf"), "vocab_size": 0}
    for key, value in bad.items():
        with pytest.raises(UserError, match=key):
            schemas.config(dict(BASE_CONFIG, **{key: value}))
    with pytest.raises(UserError, match="num_hidden_layers.*1..1024"):
        schemas.config(dict(BASE_CONFIG, num_hidden_layers=1099511627776))
    with pytest.raises(UserError, match="divisor of hidden_size 64"):
        schemas.config(dict(BASE_CONFIG, num_attention_heads=5, num_key_value_heads=5))


