"""Python face of the native CPU kernels: loading, instruction-set choice, and op
wrappers with exactly the signatures and semantics of :mod:`pagedserve.kernels.reference`.

A wrapper calls the native kernel when it supports the inputs (dtype float32,
bfloat16 or float16; attention head sizes 64/80/96/128/256; CPU tensors contiguous in
their last dimension) and the reference otherwise, so registering these ops never
narrows what the registry accepts.

Nothing here reads the environment: the CPU platform reads its switches once
(PAGEDSERVE_CPU_KERNELS, PAGEDSERVE_CPU_ISA; :class:`pagedserve.platforms.options.CpuOptions`)
and passes them in.

Counted ops: every call of ``paged_attention`` and of the native linears adds one to
:data:`OP_CALLS` under ``"<op>:<implementation>"`` (a dict increment, well under 1% of
the smallest call); an attention call that runs the reference records why in
:data:`FALLBACKS` and logs it once per reason (the reason names the head size or dtype,
so once per model shape).  ``pagedserve platforms --ops`` shows what falls back.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from pagedserve.kernels import build, reference

__all__ = [
    "ISA_FEATURES",
    "ISA_ORDER",
    "NATIVE_OPS",
    "FALLBACKS",
    "NativeCpuKernels",
    "OP_CALLS",
    "attention_fallback_reason",
    "choose_isa",
    "count_call",
    "count_fallback",
    "dequantized_blocks",
    "load_cpu_kernels",
    "op_report",
    "unpack_linear_weight",
]

logger = logging.getLogger(__name__)

#: Calls of the counted ops in this process, by ``"<op>:<implementation>"``
#: (``paged_attention:native``, ``paged_attention:reference``, ``packed_linear:native``, ...).
OP_CALLS: dict[str, int] = {}
#: Why attention ran the torch reference: ``"<op>: <reason>"`` -> calls.
FALLBACKS: dict[str, int] = {}


def count_call(key: str) -> None:
    """One more call of ``key`` (``"<op>:<implementation>"``) in :data:`OP_CALLS`."""
    OP_CALLS[key] = OP_CALLS.get(key, 0) + 1


def count_fallback(op: str, reason: str) -> None:
    """One more call of ``op`` on the torch reference because of ``reason``; the first
    call for a reason is logged."""
    key = f"{op}: {reason}"
    seen = FALLBACKS.get(key)
    if seen is None:
        logger.warning("pagedserve: %s runs the torch reference (slow) on this CPU: %s", op, reason)
        seen = 0
    FALLBACKS[key] = seen + 1
    count_call(f"{op}:reference")


def op_report() -> dict[str, Any]:
    """What the counters hold: ``{"calls": OP_CALLS, "fallbacks": FALLBACKS}`` (copies)."""
    return {"calls": dict(OP_CALLS), "fallbacks": dict(FALLBACKS)}


def attention_fallback_reason(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor, head_sizes
) -> str:
    """Why the native attention kernel does not take these tensors."""
    if query.dtype not in _DTYPES:
        return f"dtype {str(query.dtype).removeprefix('torch.')} (native: float32, bfloat16, float16)"
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype or out.dtype != query.dtype:
        return f"KV cache dtype {str(key_cache.dtype).removeprefix('torch.')} differs from the query's"
    if query.shape[-1] not in head_sizes:
        sizes = ", ".join(str(h) for h in sorted(head_sizes))
        return f"head size {query.shape[-1]} (native: {sizes})"
    if not query.is_cpu:
        return "tensors not on the CPU"
    return "query or output not contiguous in the head dimension"


#: Instruction sets of the kernels, best first.
ISA_ORDER: tuple[str, ...] = ("avx512bf16", "avx512", "avx2", "scalar")

#: /proc/cpuinfo features each instruction set needs.
ISA_FEATURES: dict[str, frozenset[str]] = {
    "avx512bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "scalar": frozenset(),
}

#: Ops the native build overrides: each measured faster than its reference, except
#: silu_and_mul at prefill sizes, where it ties (docs/kernels_cpu.md).
NATIVE_OPS: tuple[str, ...] = (
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "argmax",
    "apply_token_bitmask",
    "embedding",
)

#: Rows of x up to which bf16 `linear` runs the skinny native kernel instead of torch's
#: GEMM (benchmarks/cpu_kernels.py --linear measures the crossover).
LINEAR_MAX_ROWS = 4

_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
#: Query dtypes of the attention kernels that read 8-bit float KV caches.
_KV8_QUERY_DTYPES = frozenset({torch.float32, torch.bfloat16})

log = logging.getLogger(__name__)
_logged_quantized_cache = False


def dequantized_blocks(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
    head_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache, block_tables) of just the blocks the sequences read, in
    ``dtype``: the distinct blocks of each sequence's first ceil(seq_len / block_size)
    table entries, converted (an unscaled 8-bit float widens exactly; a row-scaled row,
    int8 or an fp8 one ``head_size + 4`` wide, is its values times its scale, rounded
    once to ``dtype``; ``head_size`` defaults to the row less 4 for int8, the row
    otherwise), in the caches' layout
    (a head-major cache stays head-major); the tables renumbered into them.  Entries
    past a sequence's blocks point at block 0 of the result and are never read."""
    block_size = key_cache.shape[1]
    width = block_tables.shape[1]
    n_blocks = (seq_lens.long() + block_size - 1) // block_size
    used = torch.arange(width).view(1, width) < n_blocks.view(-1, 1)
    ids = block_tables[used].long()
    if ids.numel() == 0:
        ids = torch.zeros(1, dtype=torch.long)
    distinct, inverse = torch.unique(ids, return_inverse=True)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # index_select on the [blocks, heads, tokens, d] view keeps each head's rows together.
        picked = cache.transpose(1, 2).index_select(0, distinct)
        head = head_size
        if head is None:
            scaled = cache.dtype in reference.SCALED_KV_TORCH_DTYPES
            head = picked.shape[-1] - (reference.KV_SCALE_BYTES if scaled else 0)
        if reference.kv_rows_scaled(picked, head):  # values * their row's scale
            picked = reference.dequantize_kv(picked, head)
        return picked.to(dtype).transpose(1, 2)

    tables = torch.zeros_like(block_tables)
    if bool(used.any()):
        tables[used] = inverse.to(tables.dtype)
    return gather(key_cache), gather(value_cache), tables


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatcher's ~0.7 us when it already is (once per op
    call, 300 calls a decode step)."""
    return t if t.dtype == dtype else t.to(dtype)


def choose_isa(compiled: Sequence[str], features: frozenset[str], requested: str | None = None) -> str:
    """The instruction set to run: ``requested`` if compiled and supported, else the
    best compiled one this CPU supports.  Raises ValueError for an impossible request."""
    if features:
        runnable = [i for i in compiled if ISA_FEATURES.get(i, frozenset()) <= features]
    else:  # no /proc/cpuinfo: trust the build, whose flags came from the same place
        runnable = list(compiled)
    if requested:
        if requested not in runnable:
            raise ValueError(
                f"instruction set {requested!r} is not available here: compiled "
                f"{', '.join(compiled)}; runnable on this CPU {', '.join(runnable) or 'none'}"
            )
        return requested
    if not runnable:
        raise ValueError(f"none of the compiled instruction sets ({', '.join(compiled)}) runs on this CPU")
    return runnable[0]


def unpack_linear_weight(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of NativeCpuKernels.pack_linear_weight: [N/16, K/2, 16, 2] -> [N, K]."""
    nb, kp = packed.shape[0], packed.shape[1]
    return packed.permute(0, 2, 1, 3).reshape(nb * 16, kp * 2)


class NativeCpuKernels:
    """One loaded build of the CPU kernels bound to one instruction set.

    The methods named in NATIVE_OPS are drop-in replacements of the references.
    """

    def __init__(self, module: ModuleType, isa: str) -> None:
        self.module = module
        self.isa = isa
        self._isa = list(module.compiled_isas()).index(isa)
        self.head_sizes = frozenset(module.supported_head_sizes())
        #: Whether this instruction set has the skinny bf16 linear kernel (AVX-512 BF16).
        self.has_linear = bool(module.has_linear(self._isa))
        #: Whether it has the packed bf16 linear kernel (AVX-512 BF16; see pack_linear_weight).
        self.has_packed_linear = bool(module.has_packed_linear(self._isa))
        #: Whether its attention reads 8-bit KV caches (fp8, int8 with row scales) in
        #: registers (AVX-512), for float32 and bf16 queries; elsewhere they are
        #: dequantized first.
        self.has_kv8_attention = bool(module.has_kv8_attention(self._isa))
        #: Where pack_linear_weight puts packed weights: a HugePageArena (the CPU
        #: platform sets one unless PAGEDSERVE_CPU_WEIGHT_HUGE_PAGES=0), else torch's
        #: allocator.
        self.weight_arena = None

    @property
    def source(self) -> str:
        """How `pagedserve platforms --ops` labels these ops."""
        return f"cpu-native({self.isa})"

    def ops(self) -> dict[str, Callable[..., Any]]:
        ops = {name: getattr(self, name) for name in NATIVE_OPS}
        if self.has_linear:
            ops["linear"] = self.linear
        return ops

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        key_ends: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See reference.paged_attention: query [num_tokens, num_heads, head_size];
        caches [num_blocks, block_size, num_kv_heads, head_size]; int32 metadata.
        ``sliding_window`` and ``soft_cap`` are kernel parameters: the key loop starts
        at the first block the window reaches (slid-out table entries are never read)
        and the cap applies to the scaled scores before the online softmax; ``sinks``
        (float32 [num_heads]) join each row's denominator once its softmax is final;
        ``key_ends`` (int32 [num_tokens]) moves each query row's last key."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if soft_cap is not None and not soft_cap > 0:
            raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
        dtype = query.dtype
        if out is None:
            # empty_like is ~1 us cheaper per call than torch.empty(shape, dtype, device).
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        kv8 = (
            key_cache.dtype in reference.SCALED_KV_TORCH_DTYPES
            or key_cache.dtype in reference.QUANTIZED_KV_TORCH_DTYPES
        )
        if kv8:  # an 8-bit cache: read in registers where the instruction set can
            kernel_dtypes = self.has_kv8_attention and dtype in _KV8_QUERY_DTYPES
        else:
            kernel_dtypes = dtype in _DTYPES and key_cache.dtype == dtype
        if (
            kernel_dtypes
            and value_cache.dtype == key_cache.dtype
            and out.dtype == dtype
            and query.shape[-1] in self.head_sizes
            and query.is_cpu
            and query.stride(-1) == 1
            and out.stride(-1) == 1
        ):
            self.module.paged_attention(
                query,
                key_cache,
                value_cache,
                block_tables,
                seq_lens,
                query_start_loc,
                float(scale),
                out,
                self._isa,
                sliding_window or 0,
                float(soft_cap or 0.0),
                sinks,
                key_ends,
            )
            OP_CALLS["paged_attention:native"] = OP_CALLS.get("paged_attention:native", 0) + 1
            return out
        if kv8 and dtype in _DTYPES and query.is_cpu and value_cache.dtype == key_cache.dtype:
            return self._quantized_cache_attention(
                query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
                sliding_window, soft_cap, sinks, key_ends,
            )  # fmt: skip
        reason = attention_fallback_reason(query, key_cache, value_cache, out, self.head_sizes)
        count_fallback("paged_attention", reason)
        return reference.paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            out,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            sinks=sinks,
            key_ends=key_ends,
        )

    def _quantized_cache_attention(
        self,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        out,
        window,
        cap,
        sinks,
        key_ends=None,
    ) -> torch.Tensor:
        """paged_attention over an 8-bit cache where the kernel cannot read its rows (an
        fp8 one on an instruction set without the kv8 kernel or for a float16 query, an
        int8 one where the int8 kernel is missing): the blocks the batch reads are
        dequantized first (:func:`dequantized_blocks`) and the kernel runs on them (logged
        once).  Unscaled fp8 widens exactly to the query's dtype; row-scaled rows (int8,
        fp8 with row scales) times their scales do not fit 16 bits, so those run in
        float32 (query, blocks and output)."""
        head = query.shape[-1]
        work = torch.float32 if reference.kv_rows_scaled(key_cache, head) else query.dtype
        global _logged_quantized_cache
        if not _logged_quantized_cache:
            _logged_quantized_cache = True
            log.warning(
                "paged_attention: the native CPU kernel (%s) does not read %s KV rows for %s queries in "
                "registers; each call dequantizes the blocks it reads to %s and runs the kernel on them",
                self.isa,
                str(key_cache.dtype).removeprefix("torch."),
                str(query.dtype).removeprefix("torch."),
                str(work).removeprefix("torch."),
            )
        kc, vc, tables = dequantized_blocks(key_cache, value_cache, block_tables, seq_lens, work, head)
        if work == query.dtype:
            return self.paged_attention(
                query, kc, vc, tables, seq_lens, query_start_loc, scale, out,
                sliding_window=window, soft_cap=cap, sinks=sinks, key_ends=key_ends,
            )  # fmt: skip
        result = self.paged_attention(
            query.float(), kc, vc, tables, seq_lens, query_start_loc, scale,
            sliding_window=window, soft_cap=cap, sinks=sinks, key_ends=key_ends,
        )  # fmt: skip
        if out is None:
            return result.to(query.dtype)
        return out.copy_(result)

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """See reference.reshape_and_cache: key/value [num_tokens, num_kv_heads, head_size];
        slot_mapping int64 [num_tokens], -1 skips."""
        if not key_cache.is_cpu or not key.is_cpu:
            return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        dtype = key_cache.dtype
        if (
            key.dtype == dtype
            and value.dtype == dtype
            and value_cache.dtype == dtype
            and dtype in _DTYPES  # not an 8-bit cache: the rows are copied as they are
            and key.stride(-1) == 1
            and value.stride(-1) == 1
        ):
            self.module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
            return
        if reference.kv_rows_scaled(key_cache, key.shape[-1]):  # rows with their scales, then the copy
            key = reference.quantize_kv_rows(key, key_cache.dtype)
            value = reference.quantize_kv_rows(value, value_cache.dtype)
        elif key_cache.dtype in reference.QUANTIZED_KV_TORCH_DTYPES:  # saturating cast, then the row copy
            key = reference.quantize_kv(key, key_cache.dtype).contiguous()
            value = reference.quantize_kv(value, value_cache.dtype).contiguous()
        if key.dtype != key_cache.dtype or key.stride(-1) != 1:
            key = key.to(key_cache.dtype).contiguous()
        if value.dtype != value_cache.dtype or value.stride(-1) != 1:
            value = value.to(value_cache.dtype).contiguous()
        self.module.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """See reference.rms_norm: x [..., hidden], weight [hidden]; result in x's dtype."""
        if x.dtype not in _DTYPES or not x.is_cpu or x.stride(-1) != 1:
            return reference.rms_norm(x, weight, eps)
        return self.module.rms_norm(x, _as_dtype(weight, x.dtype), float(eps), self._isa)

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See reference.fused_add_rms_norm; updates x (normed) and residual in place (a
        float32 residual beside a narrower x or out_dtype: the residual in place, the row
        into x where it is of out_dtype, else a new tensor)."""
        if (out_dtype is not None and out_dtype != x.dtype) or residual.dtype != x.dtype:
            return self._fused_add_rms_norm_f32res(x, residual, weight, eps, out_dtype or x.dtype)
        if (
            x.dtype not in _DTYPES
            or residual.dtype != x.dtype
            or not x.is_cpu
            or x.shape != residual.shape
            or not x.is_contiguous()
            or not residual.is_contiguous()
            # Same shape, dtype and contiguity: they overlap iff their starts are nearer than their size.
            or abs(x.data_ptr() - residual.data_ptr()) < x.nbytes
        ):
            return reference.fused_add_rms_norm(x, residual, weight, eps)
        self.module.fused_add_rms_norm(x, residual, _as_dtype(weight, x.dtype), float(eps), self._isa)
        return x, residual

    def _fused_add_rms_norm_f32res(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A float32 residual stream (reference.fused_add_rms_norm's mixed case)."""
        if (
            residual.dtype != torch.float32
            or out_dtype not in _DTYPES
            or x.dtype not in (out_dtype, torch.float32)
            or not x.is_cpu
            or not residual.is_cpu
            or x.shape != residual.shape
            or not x.is_contiguous()
            or not residual.is_contiguous()
            # x and residual differ in dtype, so overlap is judged on their byte ranges.
            or (x.data_ptr() < residual.data_ptr() + residual.nbytes and residual.data_ptr() < x.data_ptr() + x.nbytes)
        ):
            return reference.fused_add_rms_norm(x, residual, weight, eps, out_dtype)
        # x is contiguous (checked above): empty_like is ~1.5 us cheaper than torch.empty(shape).
        out = x if x.dtype == out_dtype else torch.empty_like(x, dtype=out_dtype)
        self.module.fused_add_rms_norm_f32res(x, residual, _as_dtype(weight, out_dtype), out, float(eps), self._isa)
        return out, residual

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See reference.rotary_embedding; rotates query [T, H, D] and key [T, Hkv, D]
        in place and returns them."""
        if (
            query.dtype not in _DTYPES
            or key.dtype != query.dtype
            or query.dim() != 3
            or key.dim() != 3
            or not query.is_cpu
            or query.stride(-1) != 1
            or key.stride(-1) != 1
            or query.data_ptr() == key.data_ptr()
        ):
            return reference.rotary_embedding(positions, query, key, cos_sin_cache)
        if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
            cos_sin_cache = cos_sin_cache.float().contiguous()  # exact: the reference computes in fp32
        self.module.rotary_embedding(positions, query, key, cos_sin_cache, self._isa)
        return query, key

    def rotary_paged_attention(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See reference.rotary_paged_attention: one native call (rotary in place on query
        and key, the cache write, the attention) where the three native kernels take the
        inputs (a KV cache of the query's dtype: an 8-bit one takes the separate ops, whose
        write quantizes in torch); otherwise those three ops one after the other."""
        dtype = query.dtype
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        if (
            dtype in _DTYPES
            and key.dtype is dtype
            and value.dtype is dtype
            and key_cache.dtype is dtype
            and value_cache.dtype is dtype
            and out.dtype is dtype
            and query.shape[-1] in self.head_sizes
            and query.dim() == 3
            and key.dim() == 3
            and query.is_cpu
            and query.stride(-1) == 1
            and key.stride(-1) == 1
            and value.stride(-1) == 1
            and out.stride(-1) == 1
            and query.data_ptr() != key.data_ptr()
            and cos_sin_cache.dtype is torch.float32
            and cos_sin_cache.is_contiguous()
        ):
            self.module.rotary_paged_attention(
                positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping,
                block_tables, seq_lens, query_start_loc, float(scale), out, self._isa,
            )  # fmt: skip
            # It ran the native attention kernel: counted as such too.
            OP_CALLS["rotary_paged_attention:native"] = OP_CALLS.get("rotary_paged_attention:native", 0) + 1
            OP_CALLS["paged_attention:native"] = OP_CALLS.get("paged_attention:native", 0) + 1
            return out
        query, key = self.rotary_embedding(positions, query, key, cos_sin_cache)
        self.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return self.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """See reference.linear.  Up to LINEAR_MAX_ROWS bf16 rows (decode) go to the skinny
        kernel, which reads each weight once; larger batches to torch's GEMM."""
        if (
            not self.has_linear
            or x.dim() != 2
            or x.shape[0] > LINEAR_MAX_ROWS
            or x.dtype != torch.bfloat16
            or weight.dtype != torch.bfloat16
            or not x.is_cpu
            or not weight.is_cpu
            or x.stride(-1) != 1
            or weight.stride(-1) != 1
            or (bias is not None and bias.dtype != torch.bfloat16)
        ):
            return reference.linear(x, weight, bias)
        OP_CALLS["linear:native"] = OP_CALLS.get("linear:native", 0) + 1
        return self.module.linear(x, weight, bias, self._isa)

    def pack_linear_weight(self, weight: torch.Tensor, arena: bool = True) -> torch.Tensor | None:
        """A bf16 weight [N, K] -> the packed kernel's layout [N/16, K/2, 16, 2] (for every
        16 output columns, the (w[n][k], w[n][k+1]) pairs of each pair of k), or None
        when this build has no packed kernel or N % 16 or K % 2 is not 0.  In
        :attr:`weight_arena` when one is set and ``arena`` (a weight kept for the model,
        not a short-lived copy): on huge pages, the packed kernel's weight reads cost
        fewer TLB misses (docs/kernels_cpu.md)."""
        if (
            not self.has_packed_linear
            or weight.dim() != 2
            or weight.dtype != torch.bfloat16
            or not weight.is_cpu
            or weight.numel() == 0
            or weight.shape[0] % 16
            or weight.shape[1] % 2
        ):
            return None
        n, k = weight.shape
        pairs = weight.contiguous().view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
        if self.weight_arena is None or not arena:
            return pairs.contiguous()
        return self.weight_arena.empty(pairs.shape, torch.bfloat16).copy_(pairs)

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """reference.linear(x, w, bias) for ``packed = pack_linear_weight(w)``: bf16 x
        [..., K] through the packed kernel (float32 sums, one rounding to bf16); other
        dtypes through the reference on the unpacked weight."""
        if (
            x.dtype != torch.bfloat16
            or not x.is_cpu
            or x.stride(-1) != 1
            or (bias is not None and bias.dtype != torch.bfloat16)
        ):
            w = unpack_linear_weight(packed).to(x.dtype)
            return reference.linear(x, w, None if bias is None else bias.to(x.dtype))
        OP_CALLS["packed_linear:native"] = OP_CALLS.get("packed_linear:native", 0) + 1
        if x.dim() == 2:  # [M, N] already: no view (~0.7 us a call)
            return self.module.packed_linear(x, packed, bias, self._isa)
        lead = x.shape[:-1]
        return self.module.packed_linear(x.reshape(-1, x.shape[-1]), packed, bias, self._isa).view(
            *lead, packed.shape[0] * 16
        )

    def packed_linear_silu_and_mul(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """reference.linear_silu_and_mul(x, w, bias) for ``packed = pack_linear_weight(w)``,
        w = cat(gate, up) [2*d, K]: bf16 x through the gated packed kernel, which rounds
        both products to bf16 as the linear would and writes only the [..., d] result;
        otherwise (other dtypes, d % 16 != 0) packed_linear then silu_and_mul."""
        if (
            x.dtype != torch.bfloat16
            or not x.is_cpu
            or x.stride(-1) != 1
            or packed.shape[0] % 2
            or (bias is not None and bias.dtype != torch.bfloat16)
        ):
            return self.silu_and_mul(self.packed_linear(x, packed, bias))
        OP_CALLS["packed_linear_silu_and_mul:native"] = OP_CALLS.get("packed_linear_silu_and_mul:native", 0) + 1
        if x.dim() == 2:
            return self.module.packed_linear_silu_and_mul(x, packed, bias, self._isa)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        return self.module.packed_linear_silu_and_mul(x2, packed, bias, self._isa).view(*lead, packed.shape[0] * 8)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """See reference.argmax."""
        if x.dim() != 2 or x.dtype not in _DTYPES or not x.is_cpu or x.shape[1] == 0 or x.stride(-1) != 1:
            return reference.argmax(x)
        return self.module.argmax(x, self._isa)

    def apply_token_bitmask(
        self, logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See reference.apply_token_bitmask (in place; returns logits)."""
        if (
            logits.dim() != 2
            or logits.dtype not in _DTYPES
            or not logits.is_cpu
            or logits.stride(-1) != 1
            or bitmask.dtype != torch.int32
            or not bitmask.is_cpu
        ):
            return reference.apply_token_bitmask(logits, bitmask, indices)
        self.module.apply_token_bitmask(logits, bitmask.contiguous(), indices)
        return logits

    def embedding(self, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """See reference.embedding: token_ids int32/int64 [num_tokens]; weight [vocab,
        hidden] -> [num_tokens, hidden]; an id outside the vocabulary raises IndexError."""
        if (
            token_ids.dim() != 1
            or token_ids.dtype not in (torch.int32, torch.int64)
            or not token_ids.is_cpu
            or not isinstance(weight, torch.Tensor)
            or weight.dim() != 2
            or not weight.is_cpu
            or not weight.is_contiguous()
        ):
            return reference.embedding(token_ids, weight)
        return self.module.embedding(token_ids, weight)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """See reference.silu_and_mul: x [..., 2*d] -> [..., d]."""
        if x.dtype not in _DTYPES or not x.is_cpu or x.stride(-1) != 1:
            return reference.silu_and_mul(x)
        return self.module.silu_and_mul(x, self._isa)


def load_cpu_kernels(
    isa: str | None = None, verbose: bool = False, preferred_isa: str | None = None
) -> NativeCpuKernels | None:
    """Load (building on first use) the native CPU kernels.

    ``isa`` forces an instruction set (ValueError if it cannot run here); otherwise
    ``preferred_isa`` (the PAGEDSERVE_CPU_ISA switch: ignored with a warning if it
    cannot run here), otherwise the best one.  Returns None, with a warning saying why,
    when the kernels cannot be built or loaded.
    """
    try:
        module, _ = build.load_cpu_extension(verbose=verbose)
    except build.KernelBuildError as exc:
        warnings.warn(
            f"pagedserve: native CPU kernels unavailable ({exc}); using the torch reference kernels",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    compiled = list(module.compiled_isas())
    features = build.read_cpu_features()
    if isa is None:
        try:
            isa = choose_isa(compiled, features, preferred_isa)
        except ValueError as exc:
            warnings.warn(f"pagedserve: PAGEDSERVE_CPU_ISA ignored: {exc}", RuntimeWarning, stacklevel=2)
            isa = choose_isa(compiled, features)
    else:
        isa = choose_isa(compiled, features, isa)
    if verbose:
        print(f"pagedserve: running CPU kernels for {isa}", flush=True, file=sys.stderr)
    return NativeCpuKernels(module, isa)
