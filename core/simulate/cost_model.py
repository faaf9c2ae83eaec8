"""How long one engine step takes: a roofline over the step's actual batch.

A step computes ``T`` new tokens of ``S`` sequences (``q_i`` new tokens each over a
context of ``c_i`` tokens, the new ones included) and samples ``N`` of them.  On each of
the ``tp x pp`` devices, summed over the pipeline stages (pagedserve runs one step
through the stages in turn, without micro-batches):

    linear     L x max(2 T P_active / tp / R(T),  P_read(T) b_w / tp / (BW e_mem))
    lm_head    max(2 N V H / tp / R(N),  V H b_w / tp / (BW e_mem))            (N > 0)
    attention  L x max(4 (heads/tp) d sum_i q_i (c_i - (q_i - 1)/2) / F_attn,
                       2 (kv_heads/tp) d b_kv sum_i c_i / BW_attn)
    elementwise  L T H x 12 b_act / (BW e_mem)          (norms, rope, residuals, activations)
    tp comm    2 L x (lat + 2 (tp-1)/tp x T H b_act / (IC e_ic))          (two all-reduces a layer)
    pp comm    (pp - 1) x (lat + T H b_act / (IC e_ic))
    kv copies  blocks moved between device and host x block bytes / (HOST e_host)
    offload    streamed weight bytes / (HOST e_host)                   (cpu_offload_gb)
    experts    L_moe x max(2 T k P_e / R_x(T),  E(T) P_e b_w / (BW_x e_mem,x))   (experts on the host)
    crossing   L_moe x 2 x (lat + T (H b_act + 6 k) / (HOST e_host))             (experts on the host)
    overhead   step_overhead + S x per_seq_overhead + T x per_token_overhead

``R(T)`` is the matmul rate at ``T`` rows (a calibrated curve for the weight format, the
LM head's own where calibrated, or ``peak x e_matmul``); ``P_active`` counts the top-k experts of a mixture-of-experts
layer and ``P_read(T)`` the experts the batch is expected to touch (all of them once
the batch is large).

With the routed experts on the host (``experts_hw``, the device map's
``experts=cpu,*=cuda``) the ``linear`` term leaves them out and ``experts`` prices them
on the host's profile (subscript x: its matmul rate and memory; ``k`` experts per token
of ``P_e`` weights, ``E(T)`` the experts touched, over the ``L_moe`` MoE layers), and
``crossing`` adds the activations each MoE layer moves over the device's host link: the
hidden states to the host and the experts' output back (``H b_act`` bytes a token each
way) and the routing (``k`` float32 weights and int64 ids a token, ``12 k`` bytes, taken
as ``6 k`` each way), each crossing paying the device's ``interconnect_latency_s``.  The
steps stay serial (the device waits for the host's experts).  Everything is a pure
function of the batch: no torch, no device.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.simulate.hardware import LM_HEAD_PREFIX, HardwareProfile
from pagedserve.simulate.model_spec import COMPUTE_KIND, WEIGHT_BYTES, ModelSpec

__all__ = ["CostModel", "StepBatch"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class StepBatch:
    """One step's work: per scheduled sequence its new tokens and its context length
    (new tokens included); the sequences that sample; KV blocks copied in and out."""

    q_lens: list[int]
    ctx_lens: list[int]
    num_samples: int
    blocks_in: int = 0
    blocks_out: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class CostModel:
    """Step durations of ``model`` on ``hw`` under tensor/pipeline parallelism."""

    def __init__(
        self,
        model: ModelSpec,
        hw: HardwareProfile,
        *,
        dtype: str = "bfloat16",
        kv_dtype_bytes: float | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        block_size: int | None = None,
        cpu_offload_bytes: float = 0.0,
        experts_hw: HardwareProfile | None = None,
    ) -> None:
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"dtype {dtype!r}: one of {', '.join(_DTYPE_BYTES)}")
        if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
            raise ValueError("tensor/pipeline parallel sizes must be >= 1")
        if pipeline_parallel_size > model.num_layers:
            raise ValueError(
                f"pipeline_parallel_size={pipeline_parallel_size} exceeds the model's {model.num_layers} layers"
            )
        if (tensor_parallel_size > 1 or pipeline_parallel_size > 1) and hw.interconnect_bandwidth <= 0:
            raise ValueError(f"hardware {hw.name!r} has no interconnect_bandwidth: cannot plan TP/PP")
        self.model, self.hw, self.dtype = model, hw, dtype
        self.tp, self.pp = tensor_parallel_size, pipeline_parallel_size
        self.act_bytes = _DTYPE_BYTES[dtype]
        self.kv_bytes = kv_dtype_bytes if kv_dtype_bytes is not None else self.act_bytes
        #: Tokens per KV block (None: the profile's, the platform's default as the engine resolves it).
        self.block_size = block_size or hw.block_size
        self.cpu_offload_bytes = cpu_offload_bytes
        if experts_hw is not None:
            if not model.num_moe_layers:
                raise ValueError(f"{model.name} has no routed experts to place on {experts_hw.name!r}")
            if tensor_parallel_size > 1 or pipeline_parallel_size > 1:
                raise ValueError("routed experts on the host cannot be combined with tensor/pipeline parallelism")
            if hw.host_bandwidth <= 0:
                raise ValueError(f"hardware {hw.name!r} has no host_bandwidth: cannot place the experts on the host")
        self.experts_hw = experts_hw
        # weight-only formats multiply in the activation dtype
        self.compute_kind = COMPUTE_KIND.get(
            model.weight_format, "float32" if model.weight_format == "float32" else dtype
        )
        self.fmt = model.weight_format
        # KV heads are split across TP ranks, replicated when there are fewer than ranks.
        self.kv_heads_per_rank = max(1, -(-model.num_kv_heads // self.tp))

    # -- memory ---------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> float:
        """KV bytes of one block on one device (its stage's layers, its share of heads)."""
        layers = -(-self.model.num_layers // self.pp)
        return 2 * layers * self.block_size * self.kv_heads_per_rank * self.model.head_dim * self.kv_bytes

    def weight_bytes_per_device(self) -> float:
        """Weight bytes on each device (less the routed experts when they are on the host)."""
        return (self.model.weight_bytes(self.dtype) - self.expert_bytes_on_host()) / (self.tp * self.pp)

    def expert_bytes_on_host(self) -> float:
        """Bytes of the routed experts kept in host memory (0 unless ``experts_hw``)."""
        m = self.model
        if self.experts_hw is None:
            return 0.0
        return m.num_moe_layers * m.num_experts * m.expert_params * m.bytes_per_weight

    # -- time -----------------------------------------------------------------------------------
    def _linear(self, flops: float, weight_bytes: float, rows: float, fmt: str | None = None) -> float:
        rate = self.hw.matmul_rate(fmt or self.fmt, self.compute_kind, rows)
        bw = self.hw.memory_bandwidth * self.hw.eff("memory")
        return max(flops / rate, weight_bytes / bw)

    def breakdown(self, b: StepBatch) -> dict[str, float]:
        """Seconds of each term of the step (see the module docstring)."""
        m, hw, tp = self.model, self.hw, self.tp
        T, S, N = b.num_tokens, len(b.q_lens), b.num_samples
        bw = hw.memory_bandwidth * hw.eff("memory")
        out: dict[str, float] = {}
        bpw = m.bytes_per_weight
        active, read = m.layer_params_active, m.layer_params_read(T)
        if self.experts_hw is not None:  # the routed experts run on the host
            routed_active = m.num_moe_layers * m.experts_per_token * m.expert_params
            routed_read = m.num_moe_layers * m.expected_experts_touched(T) * m.expert_params
            active, read = active - routed_active, read - routed_read
            x = self.experts_hw
            rate = x.matmul_rate(self.fmt, self.compute_kind, T) if T else 1.0
            x_bw = x.memory_bandwidth * x.eff("memory")
            out["experts"] = max(2.0 * T * routed_active / rate, routed_read * bpw / x_bw) if T else 0.0
            per_token = m.hidden_size * self.act_bytes + 6 * m.experts_per_token
            host_link = hw.host_bandwidth * hw.eff("host")
            crossing = hw.interconnect_latency_s + T * per_token / host_link
            out["expert_crossing"] = m.num_moe_layers * 2 * crossing if T else 0.0
        out["linear"] = self._linear(2.0 * T * active / tp, read * bpw / tp, T) if T else 0.0
        if N:
            head_bpw = bpw if not m.tie_word_embeddings else WEIGHT_BYTES[self.dtype]
            # the LM head's own calibrated curve when there is one (it may run another kernel)
            head_fmt = LM_HEAD_PREFIX + self.fmt if LM_HEAD_PREFIX + self.fmt in hw.matmul_curve else self.fmt
            out["lm_head"] = self._linear(
                2.0 * N * m.embedding_params / tp, m.embedding_params * head_bpw / tp, N, head_fmt
            )
        else:
            out["lm_head"] = 0.0
        heads, d = m.num_heads / tp, m.head_dim
        att_flops = 4.0 * heads * d * sum(q * (c - (q - 1) / 2) for q, c in zip(b.q_lens, b.ctx_lens))
        att_bytes = 2.0 * self.kv_heads_per_rank * d * self.kv_bytes * sum(b.ctx_lens)
        att_bytes += 2.0 * T * heads * d * self.act_bytes  # queries in, outputs out
        f_attn = hw.attention_flops or hw.peak(self.dtype) * hw.eff("attention")
        bw_attn = hw.attention_bandwidth or hw.memory_bandwidth * hw.eff("attention")
        out["attention"] = m.num_layers * max(att_flops / f_attn, att_bytes / bw_attn)
        out["elementwise"] = m.num_layers * T * m.hidden_size * 12 * self.act_bytes / tp / bw
        ic = hw.interconnect_bandwidth * hw.eff("interconnect")
        msg = T * m.hidden_size * self.act_bytes
        out["tp_comm"] = (
            2 * m.num_layers * (hw.interconnect_latency_s + 2 * (tp - 1) / tp * msg / ic) if tp > 1 else 0.0
        )
        out["pp_comm"] = (self.pp - 1) * (hw.interconnect_latency_s + msg / ic) if self.pp > 1 else 0.0
        host = hw.host_bandwidth * hw.eff("host")
        moved = (b.blocks_in + b.blocks_out) * self.kv_bytes_per_block() * self.pp
        if (moved or self.cpu_offload_bytes) and host <= 0:
            raise ValueError(f"hardware {hw.name!r} has no host_bandwidth: cannot plan host KV/weight offload")
        out["kv_copies"] = moved / host if moved else 0.0
        out["weight_offload"] = self.cpu_offload_bytes / host if self.cpu_offload_bytes else 0.0
        out["overhead"] = hw.step_overhead_s + S * hw.per_seq_overhead_s + T * hw.per_token_overhead_s
        return out

    def step_seconds(self, b: StepBatch) -> float:
        return sum(self.breakdown(b).values())

    def flops_per_token(self) -> float:
        """Forward FLOPs of one token of a short context (for the swap-vs-recompute policy)."""
        return 2.0 * (self.model.layer_params_active + self.model.embedding_params)
