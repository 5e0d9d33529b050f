"""`dsconv shard`: plan EP/TP placement that fits and balances, then write per-rank weights and cluster files."""
from __future__ import annotations

from pathlib import Path

import click

from dsconv import workspace
from dsconv.errors import UserError
from dsconv.commands.quantize import SCHEME_NAMES
from dsconv.shard.layout import MAX_WORLD
from dsconv.commands.options import (PATH, SIZE, emit_json, exec_options, force_option, json_option, output_option,
                                     resolve_exec, warn)


#: a rank count: positive, and bounded so a typo cannot ask for a per-rank plan of 10^23 cards
RANKS = click.IntRange(1, MAX_WORLD)


@click.command()
@click.option("--model", "-m", type=PATH, default=None,
              help="HF checkpoint (FP8 included) or `dsconv quantize` output (default: the workspace's quantize "
                   "output if there is one, else its model).")
@click.option("--config", "config", type=PATH, default=None,
              help="Plan from a config.json alone (the family's synthesised tensor list); implies --dry-run.")
@click.option("--ep", type=RANKS, default=None,
              help="Expert-parallel degree (MindIE moe_ep; default: world / tp for MoE models, 1 otherwise).")
@click.option("--tp", type=RANKS, default=None,
              help="Tensor-parallel degree of attention (and, without --dp-attention, of embeddings, head and "
                   "dense MLPs); replicated over dp = world / tp.")
@click.option("--world", type=RANKS, default=None, help="World size (default: ep x tp).")
@click.option("--nodes", type=RANKS, default=None, help="Servers in the cluster.")
@click.option("--cards-per-node", type=RANKS, default=None, help="NPUs per server (default 8).")
@click.option("--expert-tp", type=RANKS, default=None,
              help="Expert-TP (MindIE moe_tp); derived as world / ep, give it only to assert it.")
@click.option("--dp-attention", is_flag=True,
              help="Attention alone is data-parallel: embeddings, head, dense MLPs and shared experts are split "
                   "over all cards.")
@click.option("--soc", default="Ascend910B", show_default=True, help="SoC whose memory each card has.")
@click.option("--placement", type=click.Choice(["contiguous", "balanced", "eplb"]), default="contiguous",
              show_default=True, help="Routed experts: engine default, packed by bytes, or DeepSeek EPLB on load.")
@click.option("--expert-load", type=PATH, default=None,
              help='Tokens per expert per layer for eplb: {"layers": {"3": [n0, n1, ...], ...}} '
                   "(default: expert_load.json in the input dir).")
@click.option("--redundant-experts", "redundant", type=int, default=0, show_default=True,
              help="Extra expert copies per MoE layer for eplb (the hottest experts are replicated).")
@click.option("--balance-tolerance", "tolerance", type=float, default=0.02, show_default=True,
              help="Largest accepted max/mean - 1 of weight bytes per card.")
@click.option("--max-context", type=int, default=4096, show_default=True, help="Tokens per sequence in the KV cache.")
@click.option("--batch", type=int, default=1, show_default=True, help="Concurrent sequences per DP group.")
@click.option("--kv-bits", type=click.Choice(["16", "8"]), default=None,
              help="KV cache precision (default: 8 for a model quantized with --kv-cache int8, else 16).")
@click.option("--memory-fraction", type=float, default=0.8, show_default=True,
              help="Share of card memory the engine may use (MindIE NPU_MEMORY_FRACTION).")
@click.option("--workspace-gb", type=click.FloatRange(0, 2**20), default=None,
              help="Workspace per card instead of dsconv's estimate (HCCL buffers still added).")
@click.option("--hosts", type=PATH, default=None,
              help="Server and NPU addresses for ranktable.json: JSON {\"servers\": [{\"server_ip\", \"device_ips\"}]} "
                   "or lines 'SERVER_IP DEVICE_IP ...'.")
@click.option("--max-shard-size", type=SIZE, default="4GB", show_default=True,
              help="Size cap of each rank's safetensors parts (a tensor larger than it is a part of its own).")
@click.option("--engine", type=click.Choice(["mindie", "vllm-ascend"]), default=None,
              help="Serving engine (default: `engine` in dsconv.toml, else mindie).")
@click.option("--format", "fmt", type=click.Choice(["mindie", "ranks", "plan"]), default=None,
              help="mindie: MindIE's offline-sharded folders (DeepSeek-V3/R1, the default there with --engine mindie); "
                   "ranks: generic rank_XX/ copies for inspection; plan: plan.json + cluster files only (the default "
                   "where the engine shards at load time).")
@click.option("--scheme", type=click.Choice(SCHEME_NAMES), default=None,
              help="With --config: plan the output `dsconv quantize --scheme SCHEME` would write (its tensors' real "
                   "sizes), e.g. w4a8_dynamic for DeepSeek-R1 on one node.")
@click.option("--mtp", is_flag=True,
              help="--format mindie: place the MTP layer too (MindIE builds it when serving with MTP speculative "
                   "decoding, num_speculative_tokens > 0); without it MindIE's folders leave it out.")
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")
@click.option("--plot", type=PATH, default=None, help="Also draw the per-card chart into this PNG.")
@output_option
@exec_options
@force_option
@json_option
def shard(model: Path | None, config: Path | None, ep, tp, world, nodes, cards_per_node, expert_tp, dp_attention, soc,
          placement, expert_load, redundant, tolerance, max_context, batch, kv_bits, memory_fraction, workspace_gb,
          hosts, max_shard_size, engine, fmt, scheme, mtp, dry_run, plot, output, workers, executor, ray_address,
          force, as_json) -> None:
    """Place every tensor on every rank (EP/TP), check balance and HBM fit, write rank_XX/ dirs and cluster files.

    A plan that is unbalanced or does not fit exits 3 with the reason per rank and valid layouts for the same world.
    """
    from dsconv.shard.stage import ShardRequest, render, run

    source = None
    if scheme is not None:
        if config is None:
            raise UserError("--scheme plans a quantize output from --config", hint="add --config config.json, or "
                            "shard the written output with --model")
        from dsconv.checkpoint import ConfigOnly
        from dsconv.quant.stage import planned_output

        src = ConfigOnly.open(config)
        source = src.quantized_view(*planned_output(src, scheme, engine))
    if config is None and model is None:
        model = workspace.previous_output("quantize") or workspace.resolve_model(None)
    req = ShardRequest(model=model, config=config, ep=ep, tp=tp, world=world, nodes=nodes,
                       cards_per_node=cards_per_node, expert_tp=expert_tp, dp_attention=dp_attention, soc=soc,
                       placement=placement, expert_load=expert_load, redundant=redundant, tolerance=tolerance,
                       max_context=max_context, batch=batch, kv_bits=int(kv_bits) if kv_bits else None, memory_fraction=memory_fraction,
                       workspace_gb=workspace_gb, hosts=hosts, output=output, force=force,
                       max_shard_size=max_shard_size, dry_run=dry_run, plot=plot, engine=engine, format=fmt,
                       execution=resolve_exec(workers, executor, ray_address), source=source, mtp=mtp)
    result = run(req)
    for w in result.warnings:
        warn(w)
    if as_json:
        emit_json(result.plan)
    else:
        click.echo(render(result))
    if result.failure is not None:
        raise result.failure
