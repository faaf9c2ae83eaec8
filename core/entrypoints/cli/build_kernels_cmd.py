"""`pagedserve build-kernels`: compile the native kernels ahead of time.

Without it the CPU kernels are compiled on first use (a minute or two, once); with it
that happens now, into the same cache (kernels/build.py), so the first request is fast.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "run"]

TARGETS = ("cpu", "cuda", "rocm")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "build-kernels",
        help="compile the native kernels ahead of time",
        description="Compile the native kernels of a target ahead of time. The target defaults to "
        "PAGEDSERVE_TARGET_DEVICE, else the device torch sees (cuda/rocm), else cpu. "
        "MAX_JOBS bounds parallel compile jobs; PAGEDSERVE_CPU_ARCH_FLAGS replaces the CPU "
        "flags chosen from /proc/cpuinfo; PAGEDSERVE_KERNEL_CACHE moves the cache.",
    )
    p.add_argument("--target", choices=TARGETS, default=None, help="what to build (default: see above)")
    p.add_argument("--verbose", action="store_true", help="show flags, compiler commands and what took effect")
    p.add_argument("--force", action="store_true", help="rebuild even when the cache is current (cpu)")
    p.add_argument("--all", action="store_true", help="cpu: also every other native extension this CPU runs")
    return p


def run(args: argparse.Namespace) -> int:
    from pagedserve.kernels import build
    from pagedserve.platforms.options import target_device

    try:
        target = args.target or build.default_target(target_device())
        result = build.build_kernels(
            target, verbose=args.verbose, force=getattr(args, "force", False), every=getattr(args, "all", False)
        )
    except build.KernelBuildError as exc:
        print(f"pagedserve build-kernels: {exc}", file=sys.stderr)
        return 1
    if isinstance(result, build.BuildReport):
        print(result.summary())
    else:
        print(f"{target} kernels built: {getattr(result, '__file__', result)}")
    return 0
