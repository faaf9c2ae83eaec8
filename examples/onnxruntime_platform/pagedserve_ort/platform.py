"""OrtPlatform: host memory and tensors, dense layers through ONNX Runtime."""

from __future__ import annotations

import importlib.util
import os

import torch

from pagedserve.platforms import Platform

__all__ = ["OrtPlatform", "DEFAULT_PROVIDERS"]

DEFAULT_PROVIDERS = ("CPUExecutionProvider",)


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class OrtPlatform(Platform):
    """Tensors live on the host; ONNX Runtime computes ``linear`` (float32 only)."""

    name = "ort"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = (torch.float32,)
    # The platform interface this plugin was written against (docs/platforms.md).
    interface_version = "1.0"

    @staticmethod
    def providers() -> list[str]:
        """Execution providers from PAGEDSERVE_ORT_PROVIDERS, else the CPU one."""
        raw = os.environ.get("PAGEDSERVE_ORT_PROVIDERS", "")
        names = [p.strip() for p in raw.split(",") if p.strip()]
        return names or list(DEFAULT_PROVIDERS)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        missing = [m for m in ("onnxruntime", "onnx") if importlib.util.find_spec(m) is None]
        if missing:
            return False, f"{' and '.join(missing)} not installed; pip install onnxruntime onnx"
        wanted = cls.providers()
        if wanted == list(DEFAULT_PROVIDERS):
            # Every onnxruntime build has the CPU provider: no need to load the runtime.
            return True, "onnxruntime is installed (CPUExecutionProvider)"
        import onnxruntime

        have = onnxruntime.get_available_providers()
        absent = [p for p in wanted if p not in have]
        if absent:
            return False, (
                f"PAGEDSERVE_ORT_PROVIDERS asks for {', '.join(absent)}, which this onnxruntime "
                f"{onnxruntime.__version__} lacks (it has {', '.join(have)})"
            )
        return True, f"onnxruntime {onnxruntime.__version__} with {', '.join(wanted)}"

    def total_memory(self) -> int:
        total = _meminfo("MemTotal")
        return total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def free_memory(self) -> int:
        free = _meminfo("MemAvailable")
        return free if free is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
