"""StructuredOutputsParams: what a request's output must match, with vLLM's names.

Exactly one of ``json`` (a JSON schema, as a dict or JSON text), ``regex``, ``choice`` (the output
is one of these strings), ``grammar`` (EBNF/GBNF or Lark text) or ``json_object`` (any JSON object)
is set. ``GrammarSpec`` is the canonical, hashable form the compile cache is keyed by.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

from pagoda.errors import RequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar to compile: ``kind`` (one of KINDS) and its canonical text."""

    kind: str
    text: str
    any_whitespace: bool = True  # JSON: whitespace between tokens as the model likes
    additional_properties: bool = True  # JSON: objects may hold properties the schema does not name


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        self.spec()  # validate now: a bad value is refused where it enters

    def field(self) -> str:
        """The set field's name (``json``, ``regex`` ...), for errors."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> GrammarSpec:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(f"structured_outputs needs exactly one of {', '.join(KINDS)} (got "
                               f"{', '.join(given) or 'none'})", field="structured_outputs",
                               code="invalid_combination")
        kind = given[0]
        value: Any = getattr(self, kind)
        field = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = jsonlib.loads(value)
                except ValueError as exc:
                    raise RequestError(f"{field} is not valid JSON: {exc}", field=field,
                                       code="invalid_grammar") from None
            if not isinstance(value, (dict, bool)):
                raise RequestError(f"{field} must be a JSON schema (an object)", field=field, code="invalid_grammar")
            # the schema's own key order: grammar engines emit properties in it (as OpenAI's API does)
            text = jsonlib.dumps(value, separators=(",", ":"))
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise RequestError(f"{field} must be a non-empty list of non-empty strings", field=field)
            text = jsonlib.dumps(list(value))
        elif kind == "json_object":
            if value is not True:
                raise RequestError(f"{field} must be true", field=field)
            text = ""
        else:
            if not isinstance(value, str) or not value:
                raise RequestError(f"{field} must be a non-empty string", field=field)
            text = value
        return GrammarSpec(kind, text, any_whitespace=not self.disable_any_whitespace,
                           additional_properties=not self.disable_additional_properties)
