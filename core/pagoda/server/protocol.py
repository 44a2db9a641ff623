"""Request bodies of the OpenAI API (pydantic), and their SamplingParams (chat: chat_protocol.py).

Every field is typed strictly (``true`` is not a number, ``"5"`` is not an integer) and bounded
where it enters: numbers by range, strings and lists by length, and the limits that depend on the
served model (token ids, ``top_k``, ``n``, ``logprobs``, output lengths) through ``limit(...)``,
which the OpenAPI document and the request checks both read (see ``pagoda.server.openapi``).
Unknown fields are ignored (clients send many optional ones); known fields that pagoda cannot
honour are refused with a 400 naming them and are left out of the document.
pagoda extensions, as in vLLM: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from pagoda.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from pagoda.server.errors import bad_request
from pagoda.server.openapi import limit
from pagoda.structured_outputs import StructuredOutputsParams

MAX_NAME_CHARS = 1024  # model names, user ids
MAX_MESSAGES = 4096

STRICT = ConfigDict(extra="ignore", strict=True, protected_namespaces=(), allow_inf_nan=False)



def integral(value: object) -> object:
    """JSON Schema counts 2.0 as an integer: take it as 2. Everything else stays for the strict
    check (``true`` and ``"2"`` are not integers)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(integral)]
TokenId = Annotated[Int, Field(ge=0, json_schema_extra=limit("token_id"))]
TokenIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra=limit("prompt_tokens"))]
Truncate = Annotated[Annotated[Literal[-1], BeforeValidator(integral)] | Annotated[Int, Field(ge=1)], Field(
    json_schema_extra=limit("context_tokens"), description="keep the last N tokens of each input (-1: as many as "
    "the context holds) instead of refusing an input over the context")]
OutputTokens = Annotated[Int, Field(ge=1, json_schema_extra=limit("output_tokens"))]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Seed = Annotated[Int, Field(ge=INT64_MIN, le=INT64_MAX, json_schema_extra=limit("seed"))]
ModelName = Annotated[str, Field(max_length=MAX_NAME_CHARS, json_schema_extra=limit("model"))]


BadWord = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS, pattern=r"\S")]
MAX_GRAMMAR_CHARS = 1 << 20  # a regex or grammar's text (JSON schemas are bounded by the body size)


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""

    model_config = STRICT
    json_schema: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=4096)] | None = None
    grammar: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description="EBNF (GBNF) or Lark")
    json_object: Literal[True] | None = None
    disable_any_whitespace: bool = False

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_schema, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object,
                                       disable_any_whitespace=self.disable_any_whitespace)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = STRICT

    model: ModelName | None = Field(None, description="the served model (optional)")
    n: Int = Field(1, ge=1, json_schema_extra=limit("n"), description="completions to generate")
    truncate_prompt_tokens: Truncate | None = None
    temperature: float | None = Field(None, ge=0, description="0: greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Seed | None = Field(None, description="completion i of n uses seed + i")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream=true")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], float],
                          Field(max_length=MAX_LOGIT_BIAS,  # keys: only token ids (the document says so too)
                                json_schema_extra={"additionalProperties": False})] | None = Field(
        None, description="token id (as a string) -> bias added to its logit, clamped to [-100, 100]")
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    # pagoda / vLLM extensions
    top_k: Int | None = Field(None, ge=-1, json_schema_extra=limit("top_k"), description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: Int = Field(0, ge=0, json_schema_extra=limit("output_tokens"))
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LOGIT_BIAS)] | None = None
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_STOP_STRINGS)] | None = None
    prompt_logprobs: Int | None = Field(None, ge=0, json_schema_extra=limit("logprobs"),
                                        description="logprobs of the prompt's tokens (and the top k)")
    logits_processors: list[Annotated[str, Field(json_schema_extra=limit("logits_processor"))]] | None = Field(
        None, description="logits processors (enabled on the server) to apply")
    structured_outputs: StructuredOutputs | None = Field(None, description="the output must match this")

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options",
                              code="invalid_combination")

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams; a bad value raises RequestError naming the field."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, prompt_logprobs=self.prompt_logprobs,
            logit_bias=None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()},
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            logits_processors=self.logits_processors, structured_outputs=structured_outputs,
            truncate_prompt_tokens=self.truncate_prompt_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# several prompts: one request each, n completions each; max_n bounds their product
Prompts = Field(min_length=1, json_schema_extra=limit("prompts"))
Prompt = (Annotated[str, Field(min_length=1)]
          | Annotated[list[Annotated[str, Field(min_length=1)]], Prompts]
          | TokenIds
          | Annotated[list[TokenIds], Prompts])


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description="text, a list of texts, token ids, or a list of token-id lists")
    max_tokens: OutputTokens | None = Field(None, description="default 16 (capped by the context)")
    logprobs: Int | None = Field(None, ge=0, json_schema_extra=limit("logprobs"))
    echo: bool = False
    best_of: SkipJsonSchema[int | None] = None
    suffix: SkipJsonSchema[str | None] = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by pagoda", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of={self.best_of} is not supported (pagoda returns every one of the n "
                              f"completions; leave best_of unset or equal to n)", param="best_of")

    def prompts(self, max_n: int) -> list[str | list[int]]:
        """The prompt as a list of text or token-id prompts; their completions (n each) at most max_n."""
        p = self.prompt
        if isinstance(p, str):
            prompts = [p]
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if len(prompts) * self.n > max_n:
            raise bad_request(f"{len(prompts)} prompts x n={self.n} completions is more than this server's max_n="
                              f"{max_n} completions per request", param="prompt", code="invalid_combination")
        return prompts
