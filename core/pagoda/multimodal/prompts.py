"""The offline API's prompts with images (``LLM.generate`` dict prompts, ``LLM.chat`` image parts):
images of several prompts are processed in a thread pool before the requests are queued."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagoda.errors import RequestError

PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


def _split(engine, prompt: Any, index: int):
    """(prompt for add_request, token ids to process or None, images) of one prompt."""
    if not isinstance(prompt, dict):
        return prompt, None, None
    unknown = sorted(set(prompt) - PROMPT_KEYS)
    if unknown:
        raise RequestError(f"prompt dict keys {unknown} are not supported ({', '.join(sorted(PROMPT_KEYS))})",
                           field=f"prompts[{index}]")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if (text is None) == (ids is None):
        raise RequestError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'",
                           field=f"prompts[{index}]")
    data = prompt.get("multi_modal_data")
    if data is None:
        return (text if ids is None else list(ids)), None, None
    proc = engine.mm_processor
    images = proc.images_of(data, f"prompts[{index}].multi_modal_data") if proc is not None \
        else [(None, f"prompts[{index}].multi_modal_data")]
    token_ids = engine.tokenize(text) if ids is None else list(ids)
    return text, token_ids, images


def prompt_with_images(engine, prompt_token_ids: list[int], multi_modal_data: Any, mm_inputs: Any,
                       params: Any) -> tuple[list[int], Any]:
    """``add_request``'s images, for either engine (``LLMEngine``, or the front of engines in other processes):
    ``multi_modal_data`` processed unless ``mm_inputs`` already is. Returns (the prompt's ids with every
    placeholder expanded, ``MultiModalInputs`` or None)."""
    if multi_modal_data is not None and mm_inputs is None:
        proc = engine.mm_processor
        images = proc.images_of(multi_modal_data) if proc is not None else [(None, "multi_modal_data")]
        mm_inputs = engine.process_multimodal(list(prompt_token_ids), images)
    if mm_inputs is None:
        return prompt_token_ids, None
    if params.truncate_prompt_tokens is not None:
        raise RequestError("truncate_prompt_tokens cannot cut a prompt with images", field="truncate_prompt_tokens")
    return mm_inputs.prompt_token_ids, mm_inputs


def prepare_prompts(engine, prompts: list) -> list[tuple[Any, dict]]:
    """(prompt, extra add_request keywords) of each prompt, images processed (in parallel)."""
    split = [_split(engine, p, i) for i, p in enumerate(prompts)]
    jobs = [(i, ids, images) for i, (_, ids, images) in enumerate(split) if images is not None]
    done: dict[int, Any] = {}
    if len(jobs) == 1:
        i, ids, images = jobs[0]
        done[i] = engine.process_multimodal(ids, images, f"prompts[{i}]")
    elif jobs:
        with ThreadPoolExecutor(max_workers=min(4, len(jobs))) as pool:
            futures = {i: pool.submit(engine.process_multimodal, ids, images, f"prompts[{i}]")
                       for i, ids, images in jobs}
            done = {i: f.result() for i, f in futures.items()}
    out = []
    for i, (prompt, _, _) in enumerate(split):
        if i in done:
            out.append((prompt, {"prompt_token_ids": done[i].prompt_token_ids, "mm_inputs": done[i]}))
        else:
            out.append((prompt, {}))
    return out


def chat_prompt(engine, conversation: list[dict], render) -> Any:
    """Token ids of a rendered conversation, or a dict prompt carrying its images."""
    from pagoda.multimodal.chat import has_images, split_image_parts

    if not has_images(conversation):
        return engine.tokenizer.encode(render(conversation), add_special_tokens=False)
    proc = engine.mm_processor
    messages, images = split_image_parts(conversation, proc.placeholder_text if proc is not None else None)
    ids = engine.tokenizer.encode(render(messages), add_special_tokens=False)
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": [im for im, _ in images]}}
