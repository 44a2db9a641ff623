"""Attention backends of the core (pure torch; they run on any platform)."""
