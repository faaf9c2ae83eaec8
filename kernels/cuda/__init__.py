"""CUDA C++ kernels: nvcc-only sources (``*.cu``, ``*.cuh``), a torch binding
(``binding.cpp``), the on-demand build (:mod:`.build`) and the op wrappers (:mod:`.ops`).

Importing this package builds nothing; ``build.build_cuda_extension()`` does.
"""

__all__ = ["build", "ops"]
