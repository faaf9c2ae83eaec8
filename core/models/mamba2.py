"""The Mamba 2 mixer shared by Granite 4, Nemotron-H and Falcon-H1: a model class mixes it in and
sets its shapes (``set_mamba_shapes``: ``d_inner``, ``conv_dim``, ``heads``,
``head_dim``, ``groups``, ``d_state``, ``state``: a StateLayout; and ``chunk``,
``dt_limit``, ``mamba_eps``); a layer holds ``in_proj``, ``conv``, ``conv_bias``,
``dt_bias``, ``A``, ``D``, ``out_norm`` and ``out_proj`` (see GraniteHybridLayer).

Tensor parallelism: each rank keeps a contiguous share of the heads and of the groups
(head ``h`` reads group ``h // (heads / groups)``, so the shares match): the z, x, B, C
and dt rows of ``in_proj``, the x, B and C channels of the convolution, ``dt_bias``,
``A_log``, ``D``, the norm's channels and the columns of ``out_proj`` (row-parallel:
the model sums the ranks' outputs); the state holds only this rank's heads and
channels.  With fewer groups than ranks (Granite 4.0-H has one) each rank keeps the one
group its heads read (B and C are computed by every rank that shares it, as KV heads
are), and the gated norm, whose groups then span several ranks, adds the ranks' sums of
squares (one float per token) before it scales.  The heads must divide, and the groups
divide or be a multiple of the ranks (:meth:`Mamba2Mixer.mamba_refusal`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedserve.models.decoder import even_slice
from pagedserve.models.layers import linear
from pagedserve.models.recurrent import StateLayout, chunk_info, run_segmented

if TYPE_CHECKING:
    from pagedserve.executor.attention_metadata import AttentionMetadata

__all__ = ["Mamba2Mixer"]


class Mamba2Mixer:
    """The ``_mamba`` forward of a Mamba 2 layer: h [n, hidden] -> [n, hidden] (this
    rank's partial sum under tensor parallelism), with the step's state checkpoint work
    (``models.recurrent.run_segmented``)."""

    #: Whether the gated output norm normalises before the gate (Falcon-H1's option).
    norm_before_gate = False

    @staticmethod
    def mamba_refusal(heads: int, groups: int, tp: int, names: tuple[str, str]) -> str | None:
        """Why ``tp`` ranks cannot split a Mamba 2 layer of ``heads`` heads in ``groups``
        groups (``names``: the config keys), or None."""
        if heads % tp:
            return f"it must divide the Mamba 2 heads ({names[0]}={heads})"
        if groups % tp and tp % groups:
            return (
                f"it must divide the Mamba 2 groups ({names[1]}={groups}) or be a multiple of them (each rank "
                "keeps whole groups of B and C, or the one group its heads read)"
            )
        return None

    def set_mamba_shapes(self, heads: int, head_dim: int, groups: int, d_state: int, width: int) -> None:
        """The checkpoint's Mamba 2 shapes; this rank's share of heads and groups."""
        tp = self.parallel.tp_size
        #: (d_inner, groups, heads) of the checkpoint, which ``shard_mamba_tensor`` splits.
        self.mamba_global = (heads * head_dim, groups, heads)
        #: Ranks that share one group (1: each rank holds whole groups).
        self.group_ranks = max(1, tp // groups)
        #: Channels over which the gated norm takes its mean of squares (one group's).
        self.norm_size = heads * head_dim // groups
        self.heads, self.head_dim, self.groups = heads // tp, head_dim, max(1, groups // tp)
        self.d_state, self.width = d_state, width
        self.d_inner = self.heads * head_dim
        self.conv_dim = self.d_inner + 2 * self.groups * d_state
        self.state = StateLayout([(self.conv_dim, width - 1), (self.heads, head_dim, d_state)], self.dtype)

    def shard_mamba_tensor(self, leaf: str, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """This rank's slice of the Mamba 2 tensor ``leaf`` (``in_proj``, ``conv1d``,
        ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``), None for another name."""
        r, tp = self.parallel.tp_rank, self.parallel.tp_size
        d_inner, groups, heads = self.mamba_global
        gn = groups * self.d_state
        if leaf in ("in_proj", "conv1d"):  # z, x, B, C, dt rows; x, B, C channels (weight and bias)
            kinds = "zxBCt" if leaf == "in_proj" else "xBC"
            sizes = {"z": d_inner, "x": d_inner, "B": gn, "C": gn, "t": heads}
            if sum(sizes[k] for k in kinds) != t.shape[0]:
                raise ValueError(f"{name}: {t.shape[0]} rows, expected {[sizes[k] for k in kinds]}")
            parts = t.split([sizes[k] for k in kinds])
            if self.group_ranks == 1:
                return torch.cat([even_slice(name, p, 0, r, tp) for p in parts])
            g = r // self.group_ranks  # the one group this rank's heads read
            return torch.cat(
                [
                    p.narrow(0, g * self.d_state, self.d_state) if k in "BC" else even_slice(name, p, 0, r, tp)
                    for p, k in zip(parts, kinds)
                ]
            )
        if leaf in ("dt_bias", "A_log", "D", "norm"):
            return even_slice(name, t, 0, r, tp)
        if leaf == "out_proj":
            return even_slice(name, t, 1, r, tp)
        return None

    def _mamba(
        self, ops, layer, h: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """The mixer with its state-checkpoint work: projections, step sizes and the gated
        output norm once over the step's tokens, the convolution and SSD scan
        (:meth:`_mamba_scan`) in segments where checkpoints are due.  ``layer.in_bias`` (if
        the layer has one) is added to the input projection; without ``layer.out_norm``
        the output is gated alone (``y * silu(z)``); the norm normalises before the gate
        where ``norm_before_gate`` (Falcon-H1's option).  Returns this rank's partial sum
        (``out_proj`` is row-parallel, without its bias)."""
        n = h.shape[0]
        proj = linear(ops, h, layer.in_proj, getattr(layer, "in_bias", None))
        z, xbc, dt = proj.split([self.d_inner, self.conv_dim, self.heads], dim=-1)
        step = F.softplus(dt.float() + layer.dt_bias)
        if self.dt_limit != (0.0, math.inf):
            step = step.clamp(*self.dt_limit)
        (y,) = run_segmented(
            lambda xs, m, st: (self._mamba_scan(ops, layer, *xs, st, m),), (xbc, step), kv_cache, meta, self.state
        )
        y = y.reshape(n, self.d_inner)
        if layer.out_norm is None:
            y = (y.float() * F.silu(z.float())).to(h.dtype)
        elif self.group_ranks > 1:  # a norm group spans ranks (fewer groups than ranks)
            y = self._spanning_gated_norm(y, z, layer.out_norm, self.norm_before_gate)
        else:
            y = ops.rms_norm_gated(y, z, layer.out_norm, self.mamba_eps, self.norm_before_gate, self.norm_size)
        return linear(ops, y, layer.out_proj)

    def _spanning_gated_norm(
        self, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, norm_before_gate: bool = False
    ) -> torch.Tensor:
        """``rms_norm_gated(y, z, weight, eps, norm_before_gate, norm_size)`` (Mamba 2's norm
        after the gate by default) where one norm group spans ``group_ranks`` ranks, each
        holding its channels of it: the sums of squares of the ranks that share this rank's
        group are added."""
        p, k = self.parallel, self.group_ranks
        gate = F.silu(z.float())
        g = y.float() if norm_before_gate else y.float() * gate
        sums = p.all_gather(g.square().sum(-1, keepdim=True), dim=-1)  # [n, tp]
        first = p.tp_rank // k * k
        mean = sums[:, first : first + k].sum(-1, keepdim=True) / self.norm_size
        out = g * torch.rsqrt(mean + self.mamba_eps) * weight.float()
        return (out * gate if norm_before_gate else out).to(y.dtype)

    def _mamba_scan(
        self,
        ops,
        layer,
        xbc: torch.Tensor,
        step: torch.Tensor,
        states: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The convolution and SSD scan over ``states`` (the rows' convolution windows and
        SSM states, updated in place): y [n, heads, head_dim]."""
        n = xbc.shape[0]
        has_state, decode = chunk_info(meta)
        conv_state, state = states
        if decode:
            xbc = ops.causal_conv1d_update(xbc, layer.conv, layer.conv_bias, conv_state, "silu")
        else:
            xbc = ops.causal_conv1d(
                xbc, layer.conv, layer.conv_bias, conv_state, meta.query_start_loc, has_state, "silu"
            )
        gn = self.groups * self.d_state
        xs, B, C = xbc.split([self.d_inner, gn, gn], dim=-1)
        xs = xs.reshape(n, self.heads, self.head_dim)
        B, C = B.reshape(n, self.groups, self.d_state), C.reshape(n, self.groups, self.d_state)
        if decode:
            y = ops.mamba2_ssd_step(xs, step, layer.A, B, C, layer.D, state)
        else:
            y = ops.mamba2_ssd(xs, step, layer.A, B, C, layer.D, state, meta.query_start_loc, self.chunk)
        return y
