"""Capacity planning: pagedserve's real scheduler and KV-cache manager on a simulated
clock, each step priced by a cost model of the hardware (docs/simulate.md)."""

from __future__ import annotations

from pagedserve.simulate.cost_model import CostModel, StepBatch
from pagedserve.simulate.hardware import HardwareProfile, load_profile, local_profile_path, shipped_profiles
from pagedserve.simulate.model_spec import ModelSpec, load_model_config
from pagedserve.simulate.simulator import RequestTrace, SimResult, Simulator

__all__ = [
    "CostModel",
    "StepBatch",
    "HardwareProfile",
    "load_profile",
    "local_profile_path",
    "shipped_profiles",
    "ModelSpec",
    "load_model_config",
    "Simulator",
    "SimResult",
    "RequestTrace",
]
