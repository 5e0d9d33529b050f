"""The KV-cache scales from calibration: what a layer's attention would cache, measured as it caches it.

C8 (GQA):

msModelSlim takes them where transformers hands them to the cache (`DynamicCache.update`, after rope and any k_norm;
MS processor/quant/attention.py), per channel over every KV head, and so does this: `KVCacheStats` is passed to the
decoder layer as its `cache`, so the attention calls `update(key_states, value_states, ...)` with exactly the
states a serving engine would write to its int8 cache; it keeps each channel's max |x| over the real (unpadded)
tokens and hands the states back unchanged (there is no cache: each batch attends to itself, as without one).
Max is order-free, so the forward jobs' partial statistics merge exactly (`merge`).

Keys are cached after rope, and calibration samples are short (tens to hundreds of tokens), so a channel's maximum
over them holds only for the positions seen: rope turns each pair of channels (i, i + rotary/2, transformers'
rotate_half) by an angle that grows with the position, moving a pair's magnitude between its two channels. A pair's
norm does not change with the angle, so the key scale of both channels of a pair is the pair's largest norm: it
holds at every position the engine serves (the cache layout is unchanged). Values are not rotated and keep their
per-channel maxima.

FA quant (DeepSeek MLA), as msModelSlim's fa3 processor (processor/quant/fa3/processor.py, hooks placed by
model/deepseek_v3/model_adapter.py::inject_fa3_placeholders): `FAStats` hooks the layer's modules and measures
* fa_q: the query's no-rope part after absorbing kv_b_proj's key part (q_nope @ W_UK: what the latent is scored
  against), per head;
* fa_k / fa_v: the latent the cache holds (kv_a_layernorm's output), as one head;
each batch's values by a recall window - the narrowest range holding a fraction of them (0.9999 for q and k, 1.0
for v, msModelSlim's ratios; core/observer/recall_window.py) - merged over batches by min/max, which is order-free
as well (the batches are the driver's whatever the worker count).

Scales are symmetric, as msModelSlim's: max(|min|, |max|) / 127, offset 0; rounded up onto the model dtype's grid
(`schemes.usable_scale`), because the engines hold them in the model dtype (vLLM-Ascend: kv_c8.py create_weights;
MindIE: weights.py correct_tensor_dtype), so the stored float32 is the number the engine uses.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from dsconv.errors import UserError
from dsconv.quant.algorithms.schemes import symmetric_scale
from dsconv.quant.calibrate.algorithm import Algorithm, JobEnv, LayerState, Observer
from dsconv.quant.calibrate.hooks import RowMask
from dsconv.quant.formats.msmodelslim import C8, FA_LAYOUT
from dsconv.quant.plan.kv_cache import OFFSET, SCALE, KVLayer

# msModelSlim's recall ratios per FA-quant tensor (model_adapter.py: FA3QuantPlaceHolder(ratio=...))
FA_RECALL = {"fa_q": 0.9999, "fa_k": 0.9999, "fa_v": 1.0}
HEADS_PER_STEP = 16  # absorbed queries held at once: 16 heads x 4096 tokens x 512 latent = 128 MiB float32


class KVCacheStats:
    """A stand-in for transformers' Cache during a statistics pass: per-channel max |key| and |value| of the states
    the attention would cache, real tokens only."""

    def __init__(self, rows: RowMask, rotary_fraction: float = 1.0) -> None:
        self.rows = rows
        self.rotary_fraction = rotary_fraction  # the head's share that rope turns (partial_rotary_factor)
        self.cache = self  # what the decoder layer is given as its cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.tokens = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._channels(key_states, rotated=True), self._channels(value_states)
        self.k = _max(self.k, k)
        self.v = _max(self.v, v)
        self.tokens += int(self.rows.count if self.rows.rows is None else self.rows.rows.sum())
        return key_states, value_states

    def _channels(self, x: torch.Tensor, rotated: bool = False) -> torch.Tensor:
        """[batch, heads, seq, head_dim] -> per channel (heads outermost, as k_proj writes its rows) max |x|; for
        `rotated` states each rope pair's max norm on both its channels (position-free, see the module's doc)."""
        b, h, s, d = x.shape
        flat = self.rows.apply(x.detach().transpose(1, 2).reshape(b * s, h * d), "the attention's cache states")
        if not flat.shape[0]:
            return torch.zeros(h * d)
        if not rotated:
            return flat.abs().amax(dim=0).float()
        return pair_norm_max(flat.float().view(-1, h, d), self.rotary_fraction).reshape(h * d)

    def merge(self, other: "KVCacheStats | tuple | None") -> None:
        """Fold another pass's (or a job's `partial()`) maxima into these."""
        if other is None:
            return
        k, v, tokens = other.partial() if isinstance(other, KVCacheStats) else other
        self.k, self.v = _max(self.k, k), _max(self.v, v)
        self.tokens += tokens

    def partial(self) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """What a forward job returns: (key maxima, value maxima, tokens)."""
        return self.k, self.v, self.tokens

    def remove(self) -> None:
        pass

    def tensors(self, kv: KVLayer) -> dict[str, torch.Tensor]:
        """The layer's four C8 tensors: float32 scales absmax/127 on the model dtype's grid, zero offsets."""
        if self.k is None or self.v is None:
            raise UserError(f"layer {kv.layer}: the attention never handed keys and values to the cache, so "
                            "--kv-cache int8 has nothing to calibrate", hint="drop --kv-cache for this model")
        out = {}
        (k_module, k_width), (v_module, v_width) = kv.owners
        for module, absmax, width in ((k_module, self.k, k_width), (v_module, self.v, v_width)):
            if absmax.numel() != width:
                raise UserError(f"layer {kv.layer}: the cache receives {absmax.numel()} channels from {module}, "
                                f"which writes {width}", hint="this model's attention caches another form; drop "
                                "--kv-cache")
            scale = symmetric_scale(absmax.numpy(), 8, f"{module} cache states")
            out[f"{module}.{SCALE}"] = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32))
            out[f"{module}.{OFFSET}"] = torch.zeros(width, dtype=torch.float32)
        return out


def pair_norm_max(keys: torch.Tensor, rotary_fraction: float = 1.0) -> torch.Tensor:
    """[tokens, heads, head_dim] post-rope keys -> [heads, head_dim]: each rope pair (i, i + rotary/2)'s largest
    norm over the tokens on both its channels; channels rope leaves alone keep their max |x|."""
    d = keys.shape[-1]
    r = int(d * rotary_fraction) // 2 * 2
    out = keys.abs().amax(dim=0)
    if r:
        half = r // 2
        norm = torch.sqrt(keys[..., :half] ** 2 + keys[..., half:r] ** 2).amax(dim=0)
        out[:, :half] = norm
        out[:, half:r] = norm
    return out


def _max(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else torch.maximum(a, b)


class FAStats:
    """FA quant's statistics of one MLA layer (module docstring): forward hooks on its query projection and latent
    norm, each batch reduced by recall windows, merged by min/max. `cache` is None: nothing stands in for a cache."""

    cache = None

    def __init__(self, kv: KVLayer, modules: dict[str, nn.Module], rows: RowMask, heads: int, nope: int) -> None:
        q_name, kv_b_name, norm_name = kv.measured
        self.rows, self.heads, self.nope = rows, heads, nope
        self.kv_b = modules[kv_b_name]
        self.lo: dict[str, torch.Tensor] = {}
        self.hi: dict[str, torch.Tensor] = {}
        self.handles = [modules[q_name].register_forward_hook(self._query),
                        modules[norm_name].register_forward_hook(self._latent)]

    def _query(self, mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        q = self.rows.apply(out.detach(), "the MLA query").float()
        q_nope = q.view(q.shape[0], self.heads, -1)[..., : self.nope]               # [tokens, heads, nope]
        w = self.kv_b.weight.detach().float()
        w_uk = w.view(self.heads, -1, w.shape[-1])[:, : self.nope]                  # [heads, nope, latent]
        lo, hi = [], []
        for h in range(0, self.heads, HEADS_PER_STEP):  # [heads, tokens, latent] a few heads at a time
            absorbed = torch.einsum("thn,hnc->htc", q_nope[:, h:h + HEADS_PER_STEP], w_uk[h:h + HEADS_PER_STEP])
            a, b = recall_window(absorbed.reshape(absorbed.shape[0], -1), FA_RECALL["fa_q"]) \
                if absorbed.shape[1] else (None, None)
            lo.append(a)
            hi.append(b)
        if lo[0] is not None:
            self._merge("fa_q", torch.cat(lo), torch.cat(hi))

    def _latent(self, mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        c = self.rows.apply(out.detach(), "the MLA latent").float().reshape(1, -1)  # one head
        self._update("fa_k", c)
        self._update("fa_v", c)

    def _update(self, key: str, rows: torch.Tensor) -> None:
        if rows.shape[1]:
            self._merge(key, *recall_window(rows, FA_RECALL[key]))

    def _merge(self, key: str, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.lo[key] = lo if key not in self.lo else torch.minimum(self.lo[key], lo)
        self.hi[key] = hi if key not in self.hi else torch.maximum(self.hi[key], hi)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def partial(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return self.lo, self.hi

    def merge(self, other: "FAStats | tuple | None") -> None:
        if other is None:
            return
        lo, hi = other.partial() if isinstance(other, FAStats) else other
        for key in lo:
            self._merge(key, lo[key], hi[key])

    def tensors(self, kv: KVLayer) -> dict[str, torch.Tensor]:
        """fa_q / fa_k / fa_v: float32 scales [n, 1] (max(|min|, |max|) / 127 on the model dtype's grid), int8 zero
        offsets [n, 1]."""
        (scale_name, _, _), (offset_name, _, _) = FA_LAYOUT
        out = {}
        for module, n in kv.owners:
            key = module.rpartition(".")[2]
            if key not in self.hi:
                raise UserError(f"layer {kv.layer}: no calibration token reached its MLA attention, so --kv-cache "
                                "int8 has nothing to calibrate", hint="use more calibration text")
            amax = torch.maximum(-self.lo[key].clamp(max=0), self.hi[key].clamp(min=0))
            scale = symmetric_scale(amax.numpy(), 8, f"{module} cache states")
            out[f"{module}.{scale_name}"] = torch.from_numpy(np.ascontiguousarray(scale, np.float32)).view(n, 1)
            out[f"{module}.{offset_name}"] = torch.zeros(n, 1, dtype=torch.int8)
        return out


def recall_window(rows: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the narrowest [lo, hi] holding int(ratio * N) of its N values (the first such window), as
    msModelSlim's core/observer/recall_window.py computes it - from the tails only: a window of k sorted values
    leaves out m = N - k of them, split between the two ends, so the m + 1 smallest and largest values decide it
    (two top-k, not a sort of N: a DeepSeek batch puts 2M values in each of 128 query heads)."""
    n = rows.shape[1]
    k = max(1, int(ratio * n))
    if k >= n:
        return rows.amin(dim=1), rows.amax(dim=1)
    m = n - k
    low = torch.topk(rows, m + 1, dim=1, largest=False, sorted=True).values   # ascending: window i starts at low[i]
    high = torch.topk(rows, m + 1, dim=1, largest=True, sorted=True).values   # descending: ... ends at high[m - i]
    width = high.flip(1) - low
    i = torch.argmin(width, dim=1, keepdim=True)
    return low.gather(1, i).squeeze(1), high.flip(1).gather(1, i).squeeze(1)


CacheStats = KVCacheStats | FAStats


def cache_stats(kv: KVLayer, sk: Any, layer: nn.Module, rows: RowMask) -> CacheStats:
    """The statistics object of one layer's cache form, attached to `layer` (its `cache`, if any, goes to the
    layer's forward; `remove()` detaches it)."""
    if kv.form == C8:
        return KVCacheStats(rows, sk.ck.facts.rotary_fraction)
    by_ck = {sk.ck_name(sk.module_names[m] + ".weight")[: -len(".weight")]: m for m in layer.modules()
             if m in sk.module_names and "weight" in dict(m.named_parameters(recurse=False))}
    facts = sk.ck.facts
    return FAStats(kv, by_ck, rows, facts.num_heads, facts.qk_nope_head_dim)


class KvCacheObserver(Observer):
    """The KV-cache statistics of one layer as an observer (algorithm.py): the stand-in cache its attention writes
    to, or FA quant's hooks; rebuilt in a forward job from the layer's cache plan."""

    key = "kv_cache"

    def __init__(self, kv: KVLayer, stats: CacheStats) -> None:
        self.kv, self.stats = kv, stats
        self.cache = stats.cache

    def spec(self, names: dict[nn.Module, str]) -> KVLayer:
        return self.kv

    @classmethod
    def install(cls, spec: KVLayer, env: JobEnv) -> "KvCacheObserver":
        return cls(spec, cache_stats(spec, env.sk, env.layer, env.rows))

    def remove(self) -> None:
        self.stats.remove()

    def partial(self, names: dict[nn.Module, str]) -> Any:
        return self.stats.partial()

    def merge(self, part: Any, offset: int, by_name: dict[str, nn.Module]) -> None:
        self.stats.merge(part)


class KvCacheScales(Algorithm):
    """--kv-cache int8: what each attention caches, measured during the statistics forward, written as the cache's
    scales (algorithm.py's plug-in)."""

    name = "kv_cache"
    step = "write"

    @classmethod
    def active(cls, run: Any) -> bool:
        return bool(run.plan.kv)

    def observers(self, st: LayerState) -> list[Observer]:
        kv = self.run.plan.kv.get(st.i)
        if kv is None:
            self.obs = None
            return []
        self.obs = KvCacheObserver(kv, cache_stats(kv, self.run.sk, st.layer, self.cal.acts.rows))
        return [self.obs]

    def after(self, st: LayerState) -> None:
        if self.obs is not None:
            with self.cal.clock(self.step):
                self.cal.qw.kv_cache(self.obs.stats.tensors(self.obs.kv))
