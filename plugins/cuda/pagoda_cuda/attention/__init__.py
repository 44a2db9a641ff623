"""Triton attention backends: paged MHA/GQA (and MLA decode over the latent cache)."""
