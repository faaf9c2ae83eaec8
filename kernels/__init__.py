"""pagedserve kernels: the torch reference (the spec) and native/Triton implementations."""

__all__ = ["reference"]
