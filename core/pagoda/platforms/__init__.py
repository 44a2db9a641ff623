"""Platforms the core provides itself (the CPU)."""
