"""Show a plan: per-card bars of weights / KV cache / workspace / free in the terminal, and as a PNG (`--plot FILE`).

The terminal bar spans the card's whole memory; `|` marks the budget (memory x fraction): a bar whose filled part
crosses it does not fit. The PNG draws the same stacks with matplotlib's Agg backend (no display needed).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

GiB = 2**30
WIDTH = 48
GLYPHS = {"weights": "█", "kv": "▓", "workspace": "▒", "free": "░"}


def _bar(parts: list[tuple[str, int]], total: int, budget: int, width: int = WIDTH) -> str:
    cells: list[str] = []
    acc = 0
    for key, value in parts:
        acc += max(value, 0)
        n = round(acc / total * width) - len(cells) if total else 0
        cells += [GLYPHS[key]] * min(max(n, 0), width - len(cells))  # a card far over its memory: a full bar
    cells = cells[:width] + [" "] * (width - len(cells))
    mark = min(width - 1, round(budget / total * width)) if total else 0
    cells.insert(mark, "|")
    return "".join(cells)


def rank_rows(plan_obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, rank record) per card; above 16 cards, runs of identical cards are folded into one row."""
    ranks = plan_obj["ranks"]
    if len(ranks) <= 16:
        return [(f"rank {r['rank']:>3} n{r['node']}/c{r['device']}", r) for r in ranks]
    rows, start = [], 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i]["hbm_bytes"] != ranks[start]["hbm_bytes"]:
            r0 = ranks[start]
            label = f"ranks {r0['rank']}-{ranks[i - 1]['rank']}" if i - 1 > start else \
                f"rank {r0['rank']:>3} n{r0['node']}/c{r0['device']}"
            rows.append((label, ranks[start]))
            start = i
    return rows


def terminal_chart(plan_obj: dict[str, Any]) -> str:
    mem = plan_obj["memory"]
    total, budget = mem["card_bytes"], mem["budget_bytes"]
    lines = [f"per card, of {total / GiB:.0f} GiB ({mem['soc']}; | = budget {mem['fraction']:g} x = "
             f"{budget / GiB:.1f} GiB):  {GLYPHS['weights']} weights  {GLYPHS['kv']} KV cache  "
             f"{GLYPHS['workspace']} workspace+comm  {GLYPHS['free']} free"]
    for label, r in rank_rows(plan_obj):
        free_in_budget = max(budget - r["hbm_bytes"], 0)
        parts = [("weights", r["bytes"]), ("kv", r["kv_bytes"]), ("workspace", r["workspace_bytes"]),
                 ("free", free_in_budget)]
        flag = "" if r["free_bytes"] >= 0 else "  DOES NOT FIT"
        lines.append(f"{label:<18}{_bar(parts, total, budget)} weights {_gib(r['bytes']):>10}, used "
                     f"{_gib(r['hbm_bytes']):>10}, KV tokens left {r['kv_tokens_left']:>12,}{flag}")
    return "\n".join(lines)


def save_png(plan_obj: dict[str, Any], path: Path) -> Path:
    """Stacked bars per card (GiB) with the budget line; written with the Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ranks = plan_obj["ranks"]
    mem = plan_obj["memory"]
    x = list(range(len(ranks)))
    w = [r["bytes"] / GiB for r in ranks]
    kv = [r["kv_bytes"] / GiB for r in ranks]
    ws = [r["workspace_bytes"] / GiB for r in ranks]
    free = [max(r["free_bytes"], 0) / GiB for r in ranks]
    fig, ax = plt.subplots(figsize=(max(7.5, 0.28 * len(ranks) + 3.5), 4.5), dpi=100)
    ax.bar(x, w, label="weights", color="#3b6ea8")
    ax.bar(x, kv, bottom=w, label="KV cache", color="#e08a2c")
    b2 = [a + b for a, b in zip(w, kv)]
    ax.bar(x, ws, bottom=b2, label="workspace + comm", color="#9a9a9a")
    b3 = [a + b for a, b in zip(b2, ws)]
    ax.bar(x, free, bottom=b3, label="free (in budget)", color="#cfe8cf")
    ax.axhline(mem["budget_bytes"] / GiB, color="red", linestyle="--", linewidth=1,
               label=f"budget ({mem['fraction']:g} x {mem['card_bytes'] / GiB:.0f} GiB)")
    lay = plan_obj["layout"]
    ax.set_title(f"{plan_obj['source'].get('model_type', '')}: world {lay['world']}, tp {lay['tp']} x dp {lay['dp']}, "
                 f"ep {lay['ep']} x moe_tp {lay['moe_tp']} on {mem['soc']}", fontsize=9)
    ax.set_xlabel("rank")
    ax.set_ylabel("GiB per card")
    ax.set_ylim(0, mem["card_bytes"] / GiB)
    ax.set_xticks(x[:: max(1, len(x) // 32)])
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _gib(n: float) -> str:
    """GiB with two decimals, or a smaller unit for the tiny models of tests and the demo."""
    if abs(n) >= GiB / 10 or n == 0:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 2**20:.2f} MiB" if abs(n) >= 2**20 / 10 else f"{n / 1024:.1f} KiB"


def render_summary(obj: dict[str, Any]) -> str:
    """The plan in a few lines, then the per-card chart (when the plan got as far as bytes per card)."""
    src, lay = obj["source"], obj["layout"]
    what = {"config": "config.json alone", "quantized": f"quantized {src.get('quant_type') or ''} output",
            "checkpoint": "FP8 checkpoint" if src.get("fp8_block") else "checkpoint"}[src["kind"]]
    lines = [f"{src['model_type']} ({what}, {obj['tensor_count']:,} tensors, {_gib(obj['total_bytes'])}) at {src['path']}"]
    lines.append(f"layout: world {lay['world']} = {lay['nodes']} node(s) x {lay['cards_per_node']} cards; attention "
                 f"tp {lay['tp']} x dp {lay['dp']}" + (f"; MoE ep {lay['ep']} x moe_tp {lay['moe_tp']}"
                                                       if "experts" in obj else "") +
                 (f"; dense parts tp {lay['dense_tp']} (dp-attention)" if lay["dp_attention"] else ""))
    if "mindie" in obj:
        m = obj["mindie"]
        lines.append("MindIE: " + ", ".join(f"{k} {v}" for k, v in m.items() if not isinstance(v, dict)))
    for note in obj.get("notes", []):
        lines.append(f"note: {note}")
    ex = obj.get("experts")
    if ex:
        lines.append(f"experts: {ex['placement']}" + (f" + {ex['redundant']} redundant per layer" if ex["redundant"]
                                                      else "") +
                     (" (hierarchical by node)" if ex["hierarchical"] else "") +
                     f"; experts per EP rank per layer: {ex['per_layer_min']}" +
                     (f"..{ex['per_layer_max']}" if ex["per_layer_max"] != ex["per_layer_min"] else ""))
        for when in ("before", "after"):
            f = ex.get("load", {}).get(when)
            if f:
                lines.append(f"  token load per EP rank {when:<6}: mean {f['mean_load']:,.1f}, max {f['max_load']:,.1f}"
                             f" -> balancedness {f['balancedness']:.3f} (worst layer {f['worst_layer_balancedness']:.3f})")
    if "balance" in obj:
        b, m = obj["balance"], obj["memory"]
        lines.append(f"weights per card: mean {_gib(b['mean_bytes'])}, max {_gib(b['max_bytes'])}, min "
                     f"{_gib(b['min_bytes'])}; max/mean {b['max_over_mean']:.4f} (tolerance "
                     f"{b['tolerance']:.1%}) {'ok' if b['ok'] else 'UNBALANCED'}")
        ws = m["workspace"]
        lines.append(f"memory: {m['soc']} {m['card_bytes'] / GiB:.0f} GiB x {m['fraction']:g} = "
                     f"{_gib(m['budget_bytes'])} per card; KV {m['kv_bytes_per_token']:,} B/token/card x "
                     f"{m['max_context']:,} x {m['batch']}"
                     + (f" + linear-attention state {m['state_bytes'] // m['batch']:,} B/sequence/card x {m['batch']}"
                        if m.get("state_bytes") else "") + f" = {_gib(m['kv_requested_bytes'])}; workspace "
                     f"{_gib(ws['runtime'] + ws['activations'])} + comm {_gib(ws['comm'])}; "
                     f"{'fits' if m['ok'] else 'DOES NOT FIT'}, >= {m['min_kv_tokens']:,} KV tokens per card")
        lines.append("")
        lines.append(terminal_chart(obj))
    lines.append("")
    lines.append("plan OK" if obj["ok"] else "plan REJECTED")
    return "\n".join(lines)
