"""Triton implementations of the core kernel ops (signatures: pagoda.kernels.reference)."""
