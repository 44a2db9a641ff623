"""Structured outputs: a request's output held to a JSON schema, regex, choice or grammar, through
a grammar engine (xgrammar or llguidance) that masks the tokens the grammar does not allow."""

from pagoda.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
