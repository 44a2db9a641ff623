"""vLLM's /tokenize and /detokenize: a prompt (or a conversation through the chat template) to its
token ids, and token ids back to text, with the model's own tokenizer."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from pagoda.server.chat_protocol import ChatMessage, Tool, message_text
from pagoda.server.frontend import Frontend
from pagoda.server.openapi import BODY_ERRORS, error_responses
from pagoda.server.protocol import MAX_MESSAGES, STRICT, ModelName, TokenId

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: ModelName | None = None
    prompt: str | None = Field(None, description="text; or send messages")
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages "
                                            "(the chat template writes them)")
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: ModelName | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(*BODY_ERRORS))
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    fe: Frontend = request.app.state.frontend
    fe.check_model(body.model)
    fe.check_limits(body)
    if (body.prompt is None) == (body.messages is None):
        from pagoda.server.errors import bad_request

        raise bad_request("send either prompt or messages", param="prompt", code="invalid_combination")
    if body.messages is not None:
        conversation = [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m.content)}
                        for m in body.messages]
        text = fe.render_chat(conversation, body.add_generation_prompt,
                              tools=[t.model_dump() for t in body.tools] if body.tools else None,
                              chat_template_kwargs=body.chat_template_kwargs)
        special = bool(body.add_special_tokens)
    else:
        text, special = body.prompt, body.add_special_tokens is not False
    ids = fe.encode(text, add_special_tokens=special, param="prompt" if body.prompt is not None else "messages",
                    allow_empty=True)
    out = {"count": len(ids), "max_model_len": fe.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = fe.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(*BODY_ERRORS))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    fe: Frontend = request.app.state.frontend
    fe.check_model(body.model)
    fe.check_limits(body)
    if fe.tokenizer is None:
        from pagoda.server.errors import bad_request

        raise bad_request("this model has no tokenizer", param="tokens")
    return {"prompt": fe.tokenizer.decode(body.tokens)}
