"""The offline API, with vLLM's names: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence as Seq
from typing import Any

import torch

from pagoda.config import EngineConfig, load_engine_config
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


class LLM:
    """An engine for offline batches.

    ``LLM(model="dir", device="cpu", dtype="float32", max_num_seqs=8, ...)`` takes every
    EngineConfig key as a keyword; ``config_file`` reads a YAML file first.
    """

    def __init__(self, model: str | None = None, config_file: str | None = None, **kwargs: Any):
        config = kwargs.pop("config", None)
        if config is None:
            config = load_engine_config(config_file, model=model, **kwargs)
        elif not isinstance(config, EngineConfig):
            raise TypeError("config must be an EngineConfig")
        self.config = config
        if config.data_parallel_size > 1:  # replicas in their own processes (pagoda.distributed.data_parallel)
            from pagoda.distributed.data_parallel import DataParallelEngine

            self.engine = DataParallelEngine(config)
        else:
            self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | dict | list[str] | list[dict] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: Any = None) -> list[RequestOutput]:
        """Outputs in the order of ``prompts`` (text, or token-id lists). ``use_tqdm``: a progress bar
        of finished prompts with the input and output token rates, as vLLM's (tqdm, on stderr). A prompt
        may be a dict as vLLM's: {"prompt": text | "prompt_token_ids": ids, "multi_modal_data": {"image": ...}}
        (docs/multimodal.md).
        ``lora_request``: a ``pagoda.lora.LoRARequest`` for every prompt, or a list of one per prompt
        (None entries: the base model); needs ``enable_lora``."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora_requests for {len(prompts)} prompts")
        from pagoda.multimodal.prompts import prepare_prompts

        requests = ((prompt, p, {"lora_request": lora, **kwargs})
                    for (prompt, kwargs), p, lora in zip(prepare_prompts(self.engine, prompts), params, loras))
        return self.run_requests(requests, use_tqdm=use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             lora_request: Any = None) -> list[RequestOutput]:
        from pagoda.multimodal.prompts import chat_prompt
        from pagoda.tokenizer import apply_chat_template

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        def render(conv: list[dict]) -> str:
            return apply_chat_template(self.tokenizer, conv, add_generation_prompt)

        # token ids, or {"prompt_token_ids", "multi_modal_data"} when a conversation has images
        prompts = [chat_prompt(self.engine, conv, render) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def run_requests(self, requests, use_tqdm: bool = False, prefix: str = "llm") -> list:
        """Add each ``(prompt, params, keyword arguments of engine.add_request)`` of ``requests`` as request
        ``{prefix}-N``, then step the engine until all have finished: their outputs, in order (the generation
        and pooling calls share it). If one cannot be added, those added before it are aborted and the error
        is raised."""
        ids: list[str] = []
        try:
            for prompt, params, kwargs in requests:
                ids.append(self.engine.add_request(f"{prefix}-{next(self._ids)}", prompt, params, **kwargs))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool = False) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = _ProgressBar(len(ids)) if use_tqdm else None
        # Objects older than this batch (the model, the engine, imports) stay out of the cyclic
        # collector while it runs: its full passes over them would stall steps by 10-100 ms.
        gc.freeze()
        try:
            while len(done) < len(ids):
                if not self.engine.has_unfinished_requests():
                    break
                for out in self.engine.step(finished_only=True):
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.finished(out)
        finally:
            gc.unfreeze()
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    # ------------------------------------------------------------------ pooling (runner="pooling", docs/pooling.md)
    def encode(self, prompts, pooling_params=None) -> list:
        """PoolingRequestOutputs (``.outputs.data``, a tensor) in the order of ``prompts``."""
        from pagoda.pooling import PoolingParams, offline

        return offline.encode(self, prompts, pooling_params or PoolingParams())

    def embed(self, prompts, pooling_params=None) -> list:
        """EmbeddingRequestOutputs (``.outputs.embedding``, a list of floats)."""
        from pagoda.pooling import offline

        return offline.embed(self, prompts, pooling_params)

    def classify(self, prompts, pooling_params=None) -> list:
        """ClassificationRequestOutputs (``.outputs.probs``) from the model's score head."""
        from pagoda.pooling import offline

        return offline.classify(self, prompts, pooling_params)

    def score(self, text_1, text_2, pooling_params=None) -> list:
        """ScoringRequestOutputs (``.outputs.score``) of each (text_1, text_2) pair: 1 x N or N x N."""
        from pagoda.pooling import offline

        return offline.score(self, text_1, text_2, pooling_params)

    def prompt_logits(self, prompt_token_ids: Seq[int]) -> torch.Tensor:
        """Logits [len(prompt), vocab] (float32, on the CPU) of every prompt position, computed
        in one prefill through the paged path. For tests and scoring."""
        return self.engine.score_prompt(prompt_token_ids)

    def get_stats(self) -> dict:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine (no-op on one device)."""
        self.engine.shutdown()


class _ProgressBar:
    """tqdm over finished prompts, with the estimated input and output token rates in its postfix."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.inputs = self.outputs = 0

    def finished(self, out: RequestOutput) -> None:
        self.inputs += len(out.prompt_token_ids or [])
        self.outputs += sum(len(c.token_ids) for c in out.outputs)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.bar.set_postfix_str(f"est. speed input: {self.inputs / elapsed:.2f} toks/s, "
                                 f"output: {self.outputs / elapsed:.2f} toks/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
