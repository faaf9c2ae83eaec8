"""pagedserve_ort: a pagedserve platform whose dense layers run on ONNX Runtime.

The platform is named ``ort``.  It keeps tensors on the host (``device_type = "cpu"``)
and overrides ``linear``, with an ONNX Runtime session per weight prepared at load
(``prepare_linear_weight``); every other op stays the torch reference.  pagedserve finds
it through the ``pagedserve.platforms`` entry point in ``pyproject.toml`` and never names
it.

Environment:
    PAGEDSERVE_ORT_PROVIDERS  comma-separated ONNX Runtime execution providers, in order
                              of preference (default: CPUExecutionProvider).
    PAGEDSERVE_ORT_THREADS    intra-op threads per session (default: torch's thread count).
"""

from __future__ import annotations

from pagedserve.platforms import hookimpl
from pagedserve_ort.platform import OrtPlatform

__all__ = ["OrtPlatform", "pagedserve_register_platforms", "pagedserve_register_ops"]


@hookimpl
def pagedserve_register_platforms(register):
    # Import-light on purpose: onnx and onnxruntime are imported when `ort` first runs a layer.
    register(OrtPlatform)


@hookimpl
def pagedserve_register_ops(platform, ops):
    # Every plugin's hook sees every selected platform: only touch our own.
    if isinstance(platform, OrtPlatform):
        from pagedserve_ort.linear import OrtLinear

        linear = OrtLinear(platform.providers())
        ops.register("linear", linear.linear, source="pagedserve_ort")
        # Sessions only for weights fixed at load: weight offload rewrites the others in place.
        ops.register("prepare_linear_weight", linear.prepare, source="pagedserve_ort")
