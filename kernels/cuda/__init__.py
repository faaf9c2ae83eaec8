"""cuda kernels."""
