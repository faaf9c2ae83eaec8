"""Op overrides of the CPU platform: the native kernels where they build and load, and
the quantized linear ops (platforms/cpu/quant_ops.py)."""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.platforms.ops import REFERENCE_CAPABILITIES, OpRegistry
from pagedserve.platforms.options import CpuOptions

__all__ = ["register_cpu_ops"]


def register_cpu_ops(ops: OpRegistry, options: CpuOptions | None = None) -> None:
    """Install the CPU platform's ops into ``ops``, as ``options`` (the platform's; None:
    read from the environment now) switch them.

    Loads the native kernels (compiling them on first use; see kernels/build.py) and
    packs bf16 linear weights at load: in the layouts of the kernels measured fastest
    on this machine (platforms/cpu/tuned_linear.py), or with PAGEDSERVE_CPU_TUNE=0 for
    the native packed kernel where it is built, else oneDNN (platforms/cpu/dense_ops.py).
    Where the CPU has AMX, or else AVX-512 BF16, paged attention is likewise chosen by
    measurement per query-token bucket (platforms/cpu/tuned_attention.py; tuning off:
    AMX tiles, else the AVX-512 BF16 tiling, for prefill sequences, native for the rest).
    PAGEDSERVE_CPU_KERNELS=0 keeps every op the torch reference, quantized ones
    included.  When the native kernels cannot be built, their torch references stay
    registered; the loader has already warned why.
    """
    import torch

    from pagedserve.kernels.cpu import load_cpu_kernels
    from pagedserve.platforms.cpu import dense_ops
    from pagedserve.platforms.cpu.quant_ops import register_cpu_quant_ops

    options = CpuOptions.from_env() if options is None else options
    if not options.native_kernels:
        return
    kernels = load_cpu_kernels(preferred_isa=options.isa)
    if kernels is not None and options.weight_huge_pages:
        from pagedserve.kernels.cpu.hugepages import HugePageArena

        kernels.weight_arena = HugePageArena()
    if kernels is not None:
        for name, fn in kernels.ops().items():
            ops.register(name, fn, source=kernels.source, capabilities=REFERENCE_CAPABILITIES.get(name, ()))
    # One tuner (and cache file object) for every tuned op: two would overwrite each
    # other's entries on disk.
    tuner = None
    if options.tune:
        from pagedserve.platforms.cpu.tuning import Tuner, TuningCache

        tuner = Tuner(TuningCache.default())
    decode_native: Callable[..., bool] | None = None
    if kernels is not None and options.amx_attention:
        from pagedserve.platforms.cpu.attention_ops import WHOLE_BATCH, attention_candidates

        # AMX tiles where they measure faster (per query-token bucket, at the first call
        # of each head configuration: platforms/cpu/tuned_attention.py), else (tuning
        # off) for prefill sequences, native for decodes (docs/kernels_cpu.md, "AMX
        # attention"); without AMX the same with the AVX-512 BF16 tiling where the CPU
        # has it; otherwise the native kernel stays, untimed.
        candidates = attention_candidates(kernels)
        split_name = "amx_prefill" if "amx_prefill" in candidates else "bf16_prefill"
        split = candidates.get(split_name)
        if split is not None and tuner is not None:
            from pagedserve.platforms.cpu.tuned_attention import TunedAttention

            whole = {n: candidates[n] for n in WHOLE_BATCH if n in candidates}
            tuned_attn = TunedAttention(tuner, whole, static=split)
            source = f"{kernels.source}+tuned(" + ",".join(sorted(whole)) + ")"
            ops.register("paged_attention", tuned_attn.op(), source=source)
            native_attention = candidates["native"]

            def tuned_decode_native(query, key_cache) -> bool:
                # Other dtypes go to the static split, whose decodes run native.
                if query.dtype is not torch.bfloat16 or key_cache.dtype is not torch.bfloat16:
                    return True
                return tuned_attn.decode_kernel(query, key_cache) is native_attention

            decode_native = tuned_decode_native

        elif split is not None:
            ops.register("paged_attention", split, source=f"{kernels.source}+{split_name.replace('_', '-')}")
    if kernels is not None:
        from pagedserve.platforms.cpu.attention_ops import make_rotary_paged_attention

        # Decode steps in one native call where their attention is the native kernel.
        fused = make_rotary_paged_attention(kernels, ops, decode_native)
        ops.register("rotary_paged_attention", fused, source=f"{kernels.source}+fused-decode")
    native = kernels if kernels is not None and kernels.has_packed_linear else None
    if options.prepack and tuner is not None and (native is not None or dense_ops.onednn_available()):
        # Measured dispatch (platforms/cpu/tuned_linear.py): the kernels timed on the
        # model's shapes at load, cached per machine.
        from pagedserve.platforms.cpu.tuned_linear import TunedLinear

        tuned = TunedLinear(
            tuner,
            native,
            ops.get("linear"),
            ops.get("silu_and_mul"),
            dual_bytes=options.tune_dual_mb << 20,
        )
        source = "cpu-tuned(" + ",".join(sorted(tuned.kernels)) + ")"
        ops.register("prepare_linear_weight", tuned.prepare_op(), source=source)
        ops.register("linear", tuned.linear, source=source)
        ops.register("linear_silu_and_mul", tuned.linear_silu_and_mul, source=source)
    elif options.prepack and (native is not None or dense_ops.onednn_available()):
        # bf16 weights packed at load: for the native packed kernel where it is built,
        # else for oneDNN; plain ones keep the linear above.
        source = f"cpu-native-packed({kernels.isa})" if native is not None else "onednn-prepack"
        ops.register("prepare_linear_weight", dense_ops.make_prepare_linear_weight(native), source=source)
        ops.register("linear", dense_ops.make_linear(ops.get("linear"), native), source=source)
        if native is not None:
            ops.register(
                "linear_silu_and_mul",
                dense_ops.make_linear_silu_and_mul(ops.get("linear"), ops.get("silu_and_mul"), native),
                source=source,
            )
    register_cpu_quant_ops(ops, options, tuner)
    from pagedserve.kernels import build

    # These build on first use (an engine without speculation, adapters or experts never
    # compiles them): registered only where they can be built, so the op table never
    # names a native kernel that will not exist.
    if build.toolchain_available():
        from pagedserve.kernels.cpu import spec_native
        from pagedserve.platforms.cpu.lora_ops import register_cpu_lora_ops
        from pagedserve.platforms.cpu.moe_ops import register_cpu_moe_ops

        ops.register("rejection_sample", spec_native.rejection_sample, source=spec_native.SOURCE)
        from pagedserve.kernels.cpu import mla_native

        ops.register("mla_paged_attention", mla_native.mla_paged_attention, source=mla_native.SOURCE)
        from pagedserve.kernels.cpu import recurrent_native

        # Gated DeltaNet, Mamba 1/2, the short convolutions: native over the reference
        # (each call still hands inputs the kernels do not take to the reference).
        for name, fn in recurrent_native.OPS.items():
            ops.register(name, fn, source=recurrent_native.SOURCE)
        register_cpu_lora_ops(ops)
        register_cpu_moe_ops(ops, prepack=options.prepack)
