"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in one step.

``config`` reads the ``speculative_config`` engine key; ``ngram`` and ``draft_model`` propose
tokens; ``acceptance`` decides which drafted tokens a sequence keeps (greedy: exactly plain
decoding's tokens; sampled: rejection sampling, which leaves the target's distribution unchanged);
``decoder`` runs one engine step with verification; ``stats`` counts what was drafted and kept.
"""

from pagoda.speculative.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config"]
