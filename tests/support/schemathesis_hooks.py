"""schemathesis hooks for `tests/test_server_schemathesis.py` (loaded through SCHEMATHESIS_HOOKS).

Generation is kept short: a request that leaves its output length open gets a small one (a value the
request sets, valid or not, is sent as generated), so the run fits in CI's time.

schemathesis's `positive_data_acceptance` wants every schema-valid request accepted. A few refusals
depend on more than one field's type and range, which JSON Schema cannot say: a prompt too long for
the context, fields that contradict each other, a conversation the chat template refuses. The
document lists those as 400s with their codes (`pagoda.server.openapi.SEMANTIC_400_CODES`); this
check is the built-in one, except that a 400 carrying one of those codes is a documented refusal.
"""

import json

import schemathesis
from pagoda.server.openapi import SEMANTIC_400_CODES
from schemathesis.specs.openapi.checks import positive_data_acceptance


def _error_code(response) -> str | None:
    try:
        body = json.loads(response.content)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):  # OpenAI's shape
        return error.get("code")
    return body.get("code") if isinstance(body, dict) else None  # Ollama's, with pagoda's code


@schemathesis.check
def positive_data_acceptance_beyond_the_schema(ctx, response, case):
    try:
        return positive_data_acceptance(ctx, response, case)
    except Exception:
        if response.status_code == 400 and _error_code(response) in SEMANTIC_400_CODES:
            return None
        raise


SHORT = 3  # output tokens: at most this many for a schema-valid request, this many when a request does not say


@schemathesis.hook
def before_call(context, case, kwargs):
    """Keep generation short: a schema-valid request's output length is capped (a smaller valid value
    is still valid); one that does not say gets SHORT. A schema-violating request is sent as drawn."""
    body = case.body
    if not isinstance(body, dict):
        return
    valid = case.meta is not None and case.meta.generation.mode.is_positive
    if case.path in ("/v1/completions", "/v1/chat/completions"):
        _cap(body, ("max_tokens", "max_completion_tokens"), valid)
        if valid and isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = min(body["min_tokens"], SHORT)
    elif case.path in ("/api/generate", "/api/chat"):
        options = body.setdefault("options", {})
        if isinstance(options, dict):
            _cap(options, ("num_predict",), valid)


def _cap(fields: dict, names: tuple[str, ...], valid: bool) -> None:
    present = [n for n in names if fields.get(n) is not None]
    if not present:
        fields[names[0]] = SHORT
    elif valid:
        for name in present:
            if isinstance(fields[name], int) and not 1 <= fields[name] <= SHORT:  # num_predict -1: the context
                fields[name] = SHORT
