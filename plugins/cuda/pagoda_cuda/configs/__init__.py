"""Measured tile configs per GPU model (JSON, read by the kernels)."""
