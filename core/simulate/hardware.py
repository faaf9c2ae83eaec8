"""Hardware profiles: the numbers the cost model needs about one device and its links.

A profile is a JSON file.  Shipped profiles (``profiles/*.json``, from public
datasheets; each names its sources) are found by name (``h100-sxm``); any other file is
given by path; ``cpu-local`` is the last ``pagedserve simulate calibrate`` of this
machine, stored at ``<cache root>/simulate/cpu-local.json`` where the cache root is
``$XDG_CACHE_HOME/pagedserve``, else ``~/.cache/pagedserve`` (the root whose ``kernels/``
holds pagedserve's kernel builds).  ``$PAGEDSERVE_CACHE_DIR`` is a deprecated alias of
the root, as for the kernel builds (kernels/build.py), and warns.

Rates are per device, in SI units: bytes, bytes/s, FLOP/s, seconds.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import pathlib
import warnings
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from typing import Any

__all__ = [
    "HardwareProfile",
    "load_profile",
    "shipped_profiles",
    "local_profile_path",
    "LOCAL_PROFILE",
    "CALIBRATED_FIT",
    "LM_HEAD_PREFIX",
]

LOCAL_PROFILE = "cpu-local"

#: ``matmul_curve`` key prefix of a format's LM-head curve (``"lm_head:q4_1"``): the head
#: may run another kernel than the layers (a tied GGUF embedding's type, float32 logits).
LM_HEAD_PREFIX = "lm_head:"

#: What a calibration fits per weight format (``HardwareProfile.calibrated[fmt]``).
CALIBRATED_FIT = ("efficiency_matmul", "step_overhead_s", "per_seq_overhead_s", "per_token_overhead_s")

_EFFICIENCY_KEYS = ("matmul", "memory", "attention", "interconnect", "host")


def cache_root(env: dict[str, str] | None = None) -> pathlib.Path:
    env = os.environ if env is None else env
    if env.get("PAGEDSERVE_CACHE_DIR"):
        warnings.warn(
            "PAGEDSERVE_CACHE_DIR is deprecated: set XDG_CACHE_HOME (the cache root is $XDG_CACHE_HOME/pagedserve)",
            DeprecationWarning,
            stacklevel=2,
        )
        return pathlib.Path(env["PAGEDSERVE_CACHE_DIR"]).expanduser()
    base = pathlib.Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else pathlib.Path.home() / ".cache"
    return base / "pagedserve"


def local_profile_path(env: dict[str, str] | None = None) -> pathlib.Path:
    """Where ``pagedserve simulate calibrate`` writes and ``--hardware cpu-local`` reads."""
    return cache_root(env) / "simulate" / f"{LOCAL_PROFILE}.json"


@dataclass
class HardwareProfile:
    """One device.  ``peak_flops`` is keyed by compute dtype (float32, bfloat16, float16,
    fp8, int8); ``efficiency`` holds the fraction of each peak that a well-shaped kernel
    reaches (matmul, memory, attention, interconnect, host).  ``matmul_curve`` (from a
    calibration) maps a weight format to measured ``[tokens, FLOP/s]`` points that replace
    the peak for that format; ``attention_bandwidth`` and
    ``attention_flops`` (measured) replace the attention roofline's rates.

    ``calibrated`` (written by ``pagedserve simulate calibrate``) maps each weight format
    it measured to what ran and what was fitted for it: the model, the ops and
    implementations of its linear layers, and that format's in-engine matmul efficiency
    and step overheads (``CALIBRATED_FIT``).  :meth:`for_format` gives the profile a
    model of one format is priced with, and refuses a format the calibration lacks."""

    name: str
    memory_bytes: float
    memory_bandwidth: float
    peak_flops: dict[str, float]
    interconnect_bandwidth: float = 0.0
    interconnect_latency_s: float = 1e-5
    host_bandwidth: float = 0.0
    efficiency: dict[str, float] = field(default_factory=dict)
    step_overhead_s: float = 0.0
    per_seq_overhead_s: float = 0.0
    per_token_overhead_s: float = 0.0
    default_memory_utilization: float = 0.9
    matmul_curve: dict[str, list[list[float]]] = field(default_factory=dict)
    attention_bandwidth: float | None = None
    attention_flops: float | None = None
    description: str = ""
    sources: list[str] = field(default_factory=list)
    calibrated: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The platform's default cap on one request's prompt tokens per step (and on a
    #: step's prompt tokens beside decodes) when prompts may be chunked: the CPU
    #: platform's 512 (``Platform.default_long_prefill_token_threshold``); 0: none.
    long_prefill_token_threshold: int = 0
    #: The platform's default KV block size (``Platform.default_block_size``): what the
    #: planner sizes blocks with when ``--block-size`` is not given.
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"hardware profile {self.name!r}: block_size must be a power of two, got {self.block_size}"
            )
        for key in ("memory_bytes", "memory_bandwidth"):
            if not getattr(self, key) > 0:
                raise ValueError(f"hardware profile {self.name!r}: {key} must be positive")
        if not self.peak_flops or any(not v > 0 for v in self.peak_flops.values()):
            raise ValueError(f"hardware profile {self.name!r}: peak_flops needs positive FLOP/s per dtype")
        for k, v in self.efficiency.items():
            if k not in _EFFICIENCY_KEYS or not 0 < v <= 1:
                raise ValueError(
                    f"hardware profile {self.name!r}: efficiency {k}={v} (keys "
                    f"{', '.join(_EFFICIENCY_KEYS)}, values in (0, 1])"
                )
        for fmt, pts in self.matmul_curve.items():
            if not pts or any(len(p) != 2 or p[0] < 1 or p[1] <= 0 for p in pts):
                raise ValueError(
                    f"hardware profile {self.name!r}: matmul_curve[{fmt!r}] must be [[tokens >= 1, FLOP/s > 0], ...]"
                )
            self.matmul_curve[fmt] = sorted([float(a), float(b)] for a, b in pts)
        for fmt, entry in self.calibrated.items():
            missing = [k for k in CALIBRATED_FIT if not isinstance(entry.get(k), (int, float))]
            if fmt not in self.matmul_curve or missing:
                raise ValueError(
                    f"hardware profile {self.name!r}: calibrated[{fmt!r}] needs a matmul_curve[{fmt!r}] and "
                    f"numbers for {', '.join(CALIBRATED_FIT)} (missing: {', '.join(missing) or 'the curve'})"
                )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(k for k in data if k not in known and not k.startswith("_"))
        if unknown:
            raise ValueError(f"hardware profile: unknown keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise ValueError(f"hardware profile: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def for_format(self, fmt: str) -> HardwareProfile:
        """The profile a model whose linear weights are ``fmt`` is priced with.

        A calibrated profile carries one matmul curve, efficiency and overhead fit per
        format it measured (the engine runs different kernels for each: GGUF blocks
        through ``gguf_linear``, bf16 through ``linear``); this picks ``fmt``'s.  A format
        the calibration did not measure is an error naming the command that adds it:
        another format's curve can be several times off.  A shipped (datasheet) profile
        is returned as it is; a calibration older than the per-format record only warns.
        """
        if not self.calibrated:
            if self.matmul_curve and fmt not in self.matmul_curve:
                warnings.warn(
                    f"hardware profile {self.name!r} has no matmul curve for {fmt} weights: pricing them at "
                    f"peak x efficiency; re-run `pagedserve simulate calibrate --model <a {fmt} model>`",
                    stacklevel=2,
                )
            elif self.matmul_curve:
                warnings.warn(
                    f"hardware profile {self.name!r} predates per-format calibration (it does not record "
                    "which ops it measured): re-run `pagedserve simulate calibrate` for trustworthy predictions",
                    stacklevel=2,
                )
            return self
        entry = self.calibrated.get(fmt)
        if entry is None:
            have = ", ".join(f"{f} (model {e.get('model', '?')})" for f, e in sorted(self.calibrated.items()))
            raise ValueError(
                f"hardware profile {self.name!r} was calibrated for {have}, not for {fmt} weights, which run "
                f"other kernels; run `pagedserve simulate calibrate --model <a {fmt} model>` to add {fmt} "
                "to it (or pick a format it has with --quantization)"
            )
        return replace(
            self,
            efficiency={**self.efficiency, "matmul": float(entry["efficiency_matmul"])},
            step_overhead_s=float(entry["step_overhead_s"]),
            per_seq_overhead_s=float(entry["per_seq_overhead_s"]),
            per_token_overhead_s=float(entry["per_token_overhead_s"]),
            matmul_curve={k: v for k, v in self.matmul_curve.items() if k in (fmt, LM_HEAD_PREFIX + fmt)},
            calibrated={fmt: entry},
        )

    def eff(self, key: str) -> float:
        return self.efficiency.get(key, 1.0)

    def peak(self, kind: str) -> float:
        """Peak FLOP/s for a compute dtype (falls back to bfloat16, then the largest listed)."""
        if kind in self.peak_flops:
            return self.peak_flops[kind]
        return self.peak_flops.get("bfloat16") or max(self.peak_flops.values())

    def matmul_rate(self, fmt: str, kind: str, tokens: float) -> float:
        """Achieved FLOP/s of the linear layers at a batch of ``tokens`` rows.

        A calibrated curve is interpolated in log(tokens) (flat beyond its ends);
        otherwise the peak (the memory term of the roofline covers small batches).  Either
        is scaled by ``efficiency.matmul``.
        """
        pts = self.matmul_curve.get(fmt)
        if not pts:
            return self.peak(kind) * self.eff("matmul")
        xs = [p[0] for p in pts]
        if tokens <= xs[0]:
            rate = pts[0][1]
        elif tokens >= xs[-1]:
            rate = pts[-1][1]
        else:
            i = bisect.bisect_right(xs, tokens)
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
            w = (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
            rate = y0 + w * (y1 - y0)
        return rate * self.eff("matmul")


def shipped_profiles() -> list[str]:
    folder = resources.files("pagedserve.simulate").joinpath("profiles")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name, ``cpu-local``, or a JSON file by path."""
    path = pathlib.Path(name_or_path).expanduser()
    if name_or_path == LOCAL_PROFILE:
        path = local_profile_path()
        if not path.is_file():
            raise ValueError(
                f"--hardware {LOCAL_PROFILE}: no calibration at {path}; run `pagedserve simulate calibrate` first"
            )
    elif not path.is_file():
        if name_or_path not in shipped_profiles():
            raise ValueError(
                f"--hardware {name_or_path!r} is neither a profile file nor a known profile "
                f"({', '.join(shipped_profiles() + [LOCAL_PROFILE])})"
            )
        text = resources.files("pagedserve.simulate").joinpath("profiles", f"{name_or_path}.json").read_text()
        return HardwareProfile.from_dict(json.loads(text))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"hardware profile {str(path)!r} is not valid JSON: {e}") from e
    return HardwareProfile.from_dict(data)
