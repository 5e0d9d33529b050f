"""The `shard` stage: `run(ShardRequest) -> ShardResult` runs plan -> balance -> memory -> cluster files -> write.

A rejected plan is a result, not an exception: `ShardResult.failure` carries the CheckFailed (exit 3) so the command
can still print the plan (and --json) before raising it. Importing this module is cheap (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsconv import qformat
from dsconv.errors import CheckFailed, UserError


@dataclass
class ShardRequest:
    """Everything `dsconv shard` was asked (CLI options, resolved)."""

    model: Path | None = None
    config: Path | None = None
    ep: int | None = None
    tp: int | None = None
    world: int | None = None
    nodes: int | None = None
    cards_per_node: int | None = None
    expert_tp: int | None = None
    dp_attention: bool = False
    soc: str = "Ascend910B"
    placement: str = "contiguous"
    expert_load: Path | None = None
    redundant: int = 0
    tolerance: float = 0.02
    max_context: int = 4096
    batch: int = 1
    kv_bits: int | None = None  # None: 8 for a checkpoint quantized with a C8 (int8) KV cache, else 16
    memory_fraction: float = 0.8
    workspace_gb: float | None = None
    hosts: Path | None = None
    output: Path | None = None
    force: bool = False
    max_shard_size: str | int = "4GB"  # bytes, or text parse_size reads
    dry_run: bool = False
    plot: Path | None = None
    progress: bool | None = None
    engine: str | None = None    # dsconv.engines profile (default: dsconv.toml, else mindie)
    format: str | None = None    # mindie | ranks | plan (default: what the engine loads, engine_formats.py)
    source: Any = None           # an opened input instead of model/config (a config's quantized view)
    mtp: bool = False            # MindIE's offline-sharded folders carry the MTP layer too
    execution: Any = None        # dsconv.executor.ExecOptions: how rank parts are written (default inline)

    def options(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()
                if k not in ("model", "config", "output", "force", "progress", "execution")}


@dataclass
class ShardResult:
    plan: dict[str, Any]                       # the --json object
    text: str                                  # the terminal summary and chart
    written: dict[str, Any] | None = None
    failure: CheckFailed | None = None
    warnings: list[str] = field(default_factory=list)
    plot: Path | None = None                   # the PNG chart, when one was drawn


def _source_info(src: Any, from_config: bool) -> dict[str, Any]:
    desc = getattr(src, "quant_description", None)
    kind = "config" if from_config else ("quantized" if desc is not None else "checkpoint")
    dtypes: dict[str, int] = {}
    for info in src.tensors.values():
        dtypes[info.dtype] = dtypes.get(info.dtype, 0) + 1
    out = {"path": str(Path(src.root).absolute()), "kind": kind, "model_type": src.facts.model_type,
           "family": src.family.name, "dtypes": dtypes}
    if desc is not None:
        out["quant_type"] = desc.get("model_quant_type")
    if src.facts.fp8_block and not desc:
        out["fp8_block"] = list(src.facts.fp8_block)
    return out


def _check_range(name: str, value: float, lo: float, hi: float | None = None) -> None:
    if value < lo or (hi is not None and value > hi):
        raise UserError(f"{name} {value} is out of range", hint=f"use a value in [{lo}, {hi if hi else 'inf'}]")


def kv_bits_of(src: Any, asked: int | None) -> int:
    """The KV cache's bits: as asked, else 8 when the input was quantized with `--kv-cache int8` (its description
    says kv_cache_type C8 or an fa_quant_type: the engines then allocate an int8 cache), else 16."""
    if asked is not None:
        return asked
    return 8 if qformat.int8_cache(getattr(src, "quant_description", None)) else 16


def run(req: ShardRequest) -> ShardResult:
    """Plan (and unless --dry-run, write) the shards; a rejected plan comes back with `failure` set (exit 3)."""
    from dsconv.checkpoint import open_input
    from dsconv.runtime.process import gc_paused
    from dsconv.shard import balance, chart, memory, ranktable
    from dsconv.shard.layout import make_layout
    from dsconv.shard.plan import ShardOptions, find_alternatives, make_plan, plan_json
    from dsconv.shard.table import build_table
    from dsconv.soc import soc_facts
    from dsconv.tensors import parse_size

    warnings: list[str] = []
    _check_range("--balance-tolerance", req.tolerance, 0.0, 10.0)
    _check_range("--memory-fraction", req.memory_fraction, 0.05, 1.0)
    _check_range("--max-context", req.max_context, 1)
    _check_range("--batch", req.batch, 1)
    _check_range("--redundant-experts", req.redundant, 0)
    if req.workspace_gb is not None:
        _check_range("--workspace-gb", req.workspace_gb, 0.0, 2.0**20)
    if req.kv_bits not in (None, 8, 16):
        raise UserError(f"--kv-bits {req.kv_bits} is not supported", hint="use 16 (BF16/FP16 cache) or 8 (int8 C8)")
    with gc_paused():  # ~0.5 M small acyclic objects (header listing, plans): no collection walks them
        max_shard = parse_size(req.max_shard_size)
        src = req.source if req.source is not None else open_input(req.model, config=req.config)
        from_config = req.config is not None
        dry_run = req.dry_run or from_config
        if from_config and not req.dry_run:
            warnings.append("--config has no weights: printing the plan only (as with --dry-run)")
        output = None
        if not dry_run:
            from dsconv import workspace

            output = workspace.resolve_output("shard", req.output)
        facts = src.facts
        is_moe = bool(facts.is_moe)

        hosts = None
        nodes, cards = req.nodes, req.cards_per_node
        if req.hosts is not None:
            hosts = ranktable.read_hosts(req.hosts)
            hn, hc = len(hosts), len(hosts[0].device_ips)
            if (nodes not in (None, hn)) or (cards not in (None, hc)):
                raise UserError(f"{req.hosts} lists {hn} servers x {hc} devices, but the options say "
                                f"{nodes or '?'} nodes x {cards or '?'} cards",
                                hint="make --nodes/--cards-per-node agree with --hosts, or drop them")
            nodes, cards = hn, hc
        layout = make_layout(req.ep, req.tp, req.world, nodes, cards, req.dp_attention, is_moe, req.expert_tp)
        if hosts is not None and layout.world != len(hosts) * len(hosts[0].device_ips):
            raise UserError(f"world size {layout.world} but {req.hosts} lists {len(hosts) * len(hosts[0].device_ips)} "
                            "devices", hint="one device per rank")

        profile = soc_facts(req.soc)
        if profile.assumed_from:
            warnings.append(f"--soc {req.soc}: assuming {profile.soc_version} ({profile.usable_memory_mb // 1024} "
                            "GiB); pass the exact chip for another memory size")
        fit = memory.FitSettings(soc=profile.soc_version, card_bytes=profile.usable_memory_mb * 2**20,
                                 fraction=req.memory_fraction, max_context=req.max_context, batch=req.batch,
                                 kv_bytes=kv_bits_of(src, req.kv_bits) // 8,
                                 workspace_bytes=None if req.workspace_gb is None else int(req.workspace_gb * 2**30))
        load = None
        expert_load = req.expert_load
        if is_moe and req.placement == "eplb" and expert_load is None and not from_config:
            cand = Path(src.root) / "expert_load.json"
            if cand.is_file():
                expert_load = cand
                warnings.append(f"--placement eplb: using {cand} (written by dsconv quantize)")
        if expert_load is not None:
            if not is_moe:
                raise UserError("--expert-load given but the model has no routed experts")
            load, missing = balance.read_expert_load(expert_load, facts.num_experts, facts.moe_layers)
            if missing:
                warnings.append(f"{expert_load}: no load for MoE layer(s) {', '.join(map(str, missing))}; "
                                "they are balanced as if uniform")
        if req.placement != "contiguous" and not is_moe:
            raise UserError(f"--placement {req.placement}: the model has no routed experts")
        try:
            groups = int(src.config.get("n_group") or 1)
        except (TypeError, ValueError):
            groups = 1
        from dsconv import engines
        from dsconv.shard.engine_formats import resolve_format

        prof = engines.get(req.engine)
        engines.check_engine(prof, src.family, getattr(src, "root", None) or req.model or req.config)
        engine = prof.name
        opts = ShardOptions(placement=req.placement, redundant=req.redundant, tolerance=req.tolerance, fit=fit,
                            load=load, num_groups=groups, group_rule=prof.group_split)
        fmt, note = resolve_format(engine, req.format, src.family)
        if note and not dry_run:
            warnings.append(note)
        mplan = None
        if fmt == "mindie":  # every layout error (splits, quant types) before any work
            from dsconv.shard.mindie_write import build_plan

            mplan = build_plan(src, layout, mtp=req.mtp)
        table = build_table(src)
        plan = make_plan(table, layout, opts)
        if not plan.ok:
            plan.alternatives = find_alternatives(table, layout, opts)
        mindie = ranktable.mindie_parallel(layout, is_moe, src.family)
        obj = plan_json(plan, _source_info(src, from_config), mindie)
        obj.update(engine=engine, format=fmt)
        text = chart.render_summary(obj)
        result = ShardResult(obj, text, warnings=warnings)
        if req.plot is not None and plan.rank_bytes is not None:
            chart.save_png(obj, req.plot)
            result.plot = req.plot
        if not plan.ok:
            reasons = plan.reasons()
            alt = ", ".join(f"`{a['command']}`" for a in plan.alternatives[:3])
            details = ["rejected because:"] + ["  " + r for r in reasons]
            if plan.alternatives:
                details.append(f"valid layouts for world {layout.world}, best first (KV tokens on the fullest card):")
                details += [f"  {a['command']:<28} max {a['max_weight_bytes'] / 2**30:6.2f} GiB weights/card, "
                            f"max/mean {a['max_over_mean']:.4f}, {a['min_kv_tokens']:,} KV tokens"
                            for a in plan.alternatives]
            else:
                details.append(f"no (ep, tp) layout of world {layout.world} passes both checks")
            result.failure = CheckFailed(
                f"{src.root}: shard plan {layout.label()} rejected: {reasons[0].strip()}",
                hint=f"try {alt}" if alt else "change the world size, precision or --max-context",
                details="\n".join(details))
            return result
        if hosts is None:
            hosts = ranktable.placeholder_hosts(layout.nodes, layout.cards_per_node)
            if not dry_run:
                warnings.append("ranktable.json has placeholder addresses (192.0.2.x servers, 198.51.100.x devices): "
                                "pass --hosts FILE, or edit it before launching")
        files: dict[str, Any] = {"ranktable.json": ranktable.build_rank_table(hosts), "mindie_parallel.json": mindie}
        if plan.experts is not None and plan.experts.strategy != "contiguous":
            files["expert_map.json"] = balance.expert_map(plan.experts)
    if dry_run:
        return result
    from dsconv.executor import make_executor
    from dsconv.shard.write import write_shards

    with make_executor(req.execution) as ex:
        if fmt == "mindie":
            from dsconv.shard import mindie_write

            result.written = mindie_write.write(src, mplan, output, head=obj, files=files, force=req.force,
                                                options=req.options(), progress=req.progress, executor=ex)
        elif fmt == "plan":
            from dsconv.shard.engine_formats import write_plan_only

            result.written = write_plan_only(src, output, head=obj, files=files, force=req.force,
                                             options=req.options())
        else:
            result.written = write_shards(src, plan, output, head=obj, files=files, force=req.force,
                                          max_shard_size=max_shard, options=req.options(), progress=req.progress,
                                          executor=ex)
    result.written["files"] = sorted(files) + ["plan.json"]
    obj["output"] = result.written
    return result


def render(result: ShardResult) -> str:
    """The terminal text: the summary and chart, then (when the plan passed) the chart file and what was written."""
    from dsconv.tensors import human_bytes

    lines = [result.text]
    if result.failure is None:
        if result.plot is not None:
            lines.append(f"chart: {result.plot}")
        w = result.written or {}
        if w.get("format") == "mindie":
            lines.append(f"wrote MindIE's offline-sharded layout: {w['folders']} folders for {w['ranks']} ranks "
                         f"({human_bytes(w['bytes_written'])}), model_sharded_metadata.json and "
                         f"{', '.join(w['files'])} to {w['output']}")
        elif w.get("format") == "plan":
            lines.append(f"wrote {', '.join(w['files'])} to {w['output']} (no weight copies)")
        elif w:
            lines.append(f"wrote {w['ranks']} rank directories ({human_bytes(w['bytes_written'])}) and "
                         f"{', '.join(w['files'])} to {w['output']}")
    return "\n".join(lines)
