"""EngineConfig: one pydantic model read from YAML, ``PAGODA_*`` variables and CLI flags.

Precedence, lowest first: defaults, the YAML file, ``PAGODA_<KEY>`` environment variables,
explicit arguments (CLI flags or ``LLM(...)`` keywords). Errors name the source and key.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagoda.errors import ConfigError

DTYPES = ("auto", "float32", "float16", "bfloat16")


class EngineConfig(BaseModel):
    """Everything that shapes one engine. Field docs are the user documentation."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: str | None = Field(None, description="HF model directory, a .gguf file (or a directory holding "
                              "one), or a Hugging Face Hub repo id ORG/NAME (ORG/NAME:FILE.gguf or "
                              "ORG/NAME:QUANT_TAG for one GGUF file of it); None serves the embedded default "
                              "(SmolLM2-135M-Instruct)")
    revision: str | None = Field(None, description="branch, tag or commit of a hub repo id (default: main)")
    download_dir: str | None = Field(None, description="Hugging Face cache folder that hub repo ids are "
                                     "downloaded into and read from (default: HF_HUB_CACHE, under HF_HOME)")
    model_impl: Literal["auto", "pagoda", "transformers"] = Field(
        "auto", description="pagoda: the architecture's native class; transformers: transformers' modeling code "
        "on pagoda's paged KV cache (any causal LM transformers implements); auto: native if registered, else "
        "transformers")
    tokenizer: str | None = Field(None, description="tokenizer directory or hub repo id if not the model's")
    tokenizer_revision: str | None = Field(None, description="branch, tag or commit of a hub tokenizer "
                                           "(default: main)")
    served_model_name: str | None = Field(None, description="name reported by the API; default: the model")
    dtype: str = Field("auto", description="float32, float16, bfloat16, or auto (the platform's default)")
    device: str = Field("auto", description="platform name (cpu, cuda, ...) or auto (highest priority "
                        "available); an unavailable explicit device is an error")
    seed: int = Field(0, description="seed for random weights and for sampling without a request seed")
    block_size: int = Field(16, gt=0, le=1024, description="tokens per KV cache block")
    max_model_len: int | None = Field(None, gt=0, description="longest prompt+output; default: the "
                                      "model's max_position_embeddings")
    max_num_seqs: int = Field(256, gt=0, description="most sequences running in one step")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="token budget of one step (chunked "
                                               "prefill splits longer prompts); default: the platform's "
                                               "(16384 on a CUDA device of at least 70 GiB, else 8192; on a CPU, "
                                               "while sequences decode, what keeps a step near a second, "
                                               "docs/cpu.md); pagoda serve defaults to 8192 off the CPU")
    memory_utilization: float = Field(0.9, gt=0, le=1.0, description="fraction of device memory pagoda "
                                      "may use for weights, activations and KV cache (alias: "
                                      "gpu_memory_utilization)")
    kv_cache_memory_gb: float | None = Field(None, gt=0, description="KV cache size in GiB, instead of "
                                             "sizing it from memory_utilization")
    num_kv_blocks: int | None = Field(None, gt=0, description="fixed KV cache size in blocks (of block_size "
                                      "tokens in every layer); overrides the memory budget")
    attention_backend: str = Field("auto", description="attention backend name, or auto")
    attention_options: dict = Field(default_factory=dict, description="options for the selected attention "
                                    "backend, e.g. {tile_size: 256} for a tiled backend; a backend "
                                    "rejects options it does not know")
    enforce_eager: bool = Field(False, description="never capture graphs")
    cudagraph_mode: Literal["FULL", "FULL_DECODE_ONLY"] = Field(
        "FULL", description="which steps replay captured graphs (vLLM's compilation_config.cudagraph_mode "
                            "values): FULL, decode-only steps and steps that mix prefill chunks in (where the "
                            "attention backend captures those); FULL_DECODE_ONLY, decode-only steps")
    max_cudagraph_capture_size: int | None = Field(
        None, gt=0, description="largest step, in tokens, replayed from a captured graph (vLLM's compilation_"
                                "config key): decode batches up to it (and max_num_seqs), steps with prefill "
                                "chunks up to it (and the step token budget); unset: decode batches up to 512, "
                                "steps with prefill chunks up to 1024 tokens and, above that, up to the step "
                                "token budget where a replay timed at start-up beats the eager step")
    async_scheduling: bool | None = Field(None, description="launch streamed steps (the server) before the "
                                          "previous step's tokens reach the host, as offline batches are "
                                          "(requests without logprobs or logits processing; docs/cuda.md); unset: "
                                          "on where the platform runs steps ahead, without speculative decoding "
                                          "or pipeline stages")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of identical prompt prefixes")
    quantization: str | dict | None = Field(None, description="quantization method name or policy "
                                            "(see docs/quantization.md); checkpoint metadata wins")
    kv_cache_dtype: str = Field("auto", description="auto (the cache the checkpoint's quantization config "
                                "declares, else the model dtype), a quantized cache type such as fp8, or the "
                                "model dtype by name")
    tensor_parallel_size: int = Field(1, gt=0, description="devices one model is split over")
    enable_expert_parallel: bool = Field(False, description="split MoE experts over the ranks")
    # --- pipeline and data parallelism (docs/distributed.md) ---
    pipeline_parallel_size: int = Field(1, gt=0, description="pipeline stages the layers are split over (each "
                                        "stage tensor_parallel_size ranks; ranks = pipeline x tensor)")
    pp_layer_partition: list[int] | None = Field(None, description="layers per pipeline stage, e.g. [10, 14] "
                                                 "(must sum to the model's layers); default: an even split")
    data_parallel_size: int = Field(1, gt=0, description="engine replicas (each tensor_parallel_size x "
                                    "pipeline_parallel_size ranks) that requests are spread over")
    # --- end pipeline and data parallelism ---
    expert_placement: str | None = Field(None, description="JSON file placing (and replicating) experts on "
                                         "the expert-parallel ranks, e.g. a balanced placement from "
                                         "`pagoda bench throughput`; default: equal contiguous blocks")
    max_logprobs: int = Field(20, ge=0, description="largest logprobs a request may ask for")
    max_n: int = Field(128, gt=0, description="most completions one request may produce: n (and best_of), "
                       "times the number of prompts of a completions request; each is a sequence in the batch")
    reasoning_parser: str | None = Field(None, description="the reasoning parser of a thinking model (qwen3, "
                                         "deepseek_r1, deepseek_v3, a plugin's; auto: from the chat template): "
                                         "the server returns reasoning_content, and a structured-output grammar "
                                         "starts where the reasoning ends")
    logits_processors: list[str] = Field(default_factory=list, description="logits processors (registered by "
                                         "plugins, see docs/plugins.md) this engine enables; a request names the "
                                         "ones it wants")
    structured_outputs_backend: Literal["auto", "xgrammar", "llguidance"] = Field(
        "auto", description="grammar engine of structured outputs: xgrammar, llguidance, or auto (xgrammar, and "
        "llguidance for what xgrammar cannot compile)")
    structured_outputs_process: bool | None = Field(
        None, description="xgrammar's matchers in a process of their own, so that accepting tokens and filling "
        "masks hold no GIL the engine needs (docs/serving.md); unset: on where the platform runs steps ahead "
        "(GPUs), off on the CPU")
    skip_tokenizer_init: bool = Field(False, description="token ids in, token ids out")
    load_format: Literal["auto", "dummy"] = Field("auto", description="dummy: random weights of the "
                                                  "model's shapes (benchmarks)")
    speculative_config: dict | None = Field(None, description="speculative decoding (docs/speculative.md), "
                                            "vLLM's keys: {method: ngram, num_speculative_tokens: 3, "
                                            "prompt_lookup_max: 3, prompt_lookup_min: 1}, {method: draft_model, "
                                            "model: PATH, num_speculative_tokens: 3}, {method: mtp} (DeepSeek-V3) "
                                            "or {method: eagle3, model: HEAD} (an EAGLE-3 head)")
    # multimodal models (docs/multimodal.md)
    limit_mm_per_prompt: dict = Field(default_factory=lambda: {"image": 8}, description="most items of each "
                                      "modality one prompt may carry, e.g. {image: 4}; more is a 400 naming the "
                                      "extra item")
    max_image_pixels: int = Field(32 << 20, gt=0, description="largest image (width x height, decoded) a request "
                                  "may send; a larger one is refused before it is processed")
    mm_processor_kwargs: dict = Field(default_factory=dict, description="options of the model's image processor, "
                                      "e.g. {max_pixels: 1003520} to bound an image's tokens (Qwen2.5-VL)")
    # pooling models (embeddings, rerankers, classifiers; docs/pooling.md)
    runner: Literal["generate", "pooling"] = Field(
        "generate", description="generate: text generation; pooling: embeddings, scores and classes (prefill only, "
        "no sampling; /v1/embeddings, /v1/rerank, /v1/score, /api/embed)")
    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = Field(
        None, description="how a pooling runner pools a prompt's hidden states: LAST token, MEAN of every token, "
        "or the first (CLS) token; default: the model's sentence-transformers 1_Pooling/config.json, else LAST")
    normalize: bool | None = Field(None, description="L2-normalize embeddings; default: true when the model's "
                                   "sentence-transformers modules.json has a Normalize module or has no "
                                   "modules.json (false for a model with a score head)")
    classifier_from_token: list[str] | None = Field(
        None, description="score a causal LM by its logits of these tokens at the last position (Qwen3-Reranker "
        "style): [no, yes] gives sigmoid(logit(yes) - logit(no)); one token gives sigmoid(logit(token)); "
        "a comma-separated string is accepted")
    # LoRA adapters (pagoda.lora, docs/lora.md)
    enable_lora: bool = Field(False, description="serve PEFT LoRA adapters on top of the base model (requests "
                              "name one with lora_request / the server's model field)")
    max_loras: int = Field(1, gt=0, description="adapters resident on the device at once (slots): the most "
                           "distinct adapters one step runs; others wait, the least recently used is evicted")
    max_lora_rank: int = Field(16, gt=0, description="largest adapter rank r accepted; slots are sized for it")
    max_cpu_loras: int | None = Field(None, gt=0, description="adapters kept parsed in host memory (least "
                                      "recently used dropped first); default: max_loras")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and "gpu_memory_utilization" in data:
            data = dict(data)
            data.setdefault("memory_utilization", data.pop("gpu_memory_utilization"))
        return data

    @model_validator(mode="after")
    def _pooling_on_one_device(self) -> EngineConfig:
        if self.runner == "pooling" and self.tensor_parallel_size > 1:
            raise ValueError("runner: pooling runs on one device; set tensor_parallel_size: 1")
        return self

    @model_validator(mode="after")
    def _async_scheduling_alone(self) -> EngineConfig:
        if self.async_scheduling and self.speculative_config:
            raise ValueError("async_scheduling does not combine with speculative_config (verification steps run "
                             "one at a time): drop one of them")
        if self.async_scheduling and self.pipeline_parallel_size > 1:
            raise ValueError("async_scheduling needs pipeline_parallel_size: 1 (pipeline stages are not launched "
                             "ahead yet)")
        return self

    @field_validator("classifier_from_token", mode="before")
    @classmethod
    def _classifier_tokens(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [t.strip() for t in v.split(",") if t.strip()]
        if v is not None and len(v) not in (1, 2):
            raise ValueError("give one token, or two: [no, yes]")
        return v

    @field_validator("pooling_type", mode="before")
    @classmethod
    def _pooling_type(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        v = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
             "float": "float32"}.get(v, v)
        if v in DTYPES or _split_device_dtype(v) is not None:
            return v
        raise ValueError(f"must be one of {', '.join(DTYPES)} (or <device>-<dtype>, e.g. cuda-bfloat16)")

    @field_validator("speculative_config")
    @classmethod
    def _speculative(cls, v: dict | None) -> dict | None:
        from pagoda.speculative.config import parse_speculative_config

        try:
            parse_speculative_config(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("pp_layer_partition", mode="before")
    @classmethod
    def _pp_partition(cls, v: Any) -> Any:
        """The flag's text: ``10,14`` or ``[10, 14]``."""
        if isinstance(v, str):
            return [int(x) for x in v.strip("[] ").split(",") if x.strip()]
        return v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_dtype(cls, v: str) -> str:
        return {"fp8_e4m3": "fp8"}.get(v, v)

    def resolved_device_and_dtype(self) -> tuple[str, str]:
        """``dtype: <device>-<dtype>`` (e.g. ``cuda-bfloat16``) names the device too."""
        split = _split_device_dtype(self.dtype)
        if split is None:
            return self.device, self.dtype
        device, dtype = split
        if self.device not in ("auto", device):
            raise ConfigError(f"dtype {self.dtype!r} names device {device!r} but device is {self.device!r}")
        return device, dtype


def _split_device_dtype(value: str) -> tuple[str, str] | None:
    device, sep, dtype = value.partition("-")
    if sep and device and dtype in DTYPES[1:]:
        return device, dtype
    return None


def read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of keys, not {type(data).__name__}")
    return data


def engine_section(data: dict, source: str) -> dict:
    """A file is either flat EngineConfig keys or has ``engine:`` (and ``server:``) sections."""
    if "engine" in data or "server" in data:
        unknown = sorted(set(data) - {"engine", "server"})
        if unknown:
            raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(map(repr, unknown))}; a file with "
                              f"sections holds only 'engine:' and 'server:'")
        section = data.get("engine") or {}
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: 'engine' must be a mapping")
        return section
    return data


def env_overrides(model: type[BaseModel], prefix: str = "PAGODA_") -> dict:
    """``PAGODA_MAX_NUM_SEQS=8`` → ``{"max_num_seqs": 8}`` for the model's fields."""
    out = {}
    for name in model.model_fields:
        raw = os.environ.get(prefix + name.upper())
        if raw is not None:
            try:
                out[name] = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                out[name] = raw
    return out


def build_config(model: type[BaseModel], layers: list[tuple[str, dict]]) -> Any:
    """Merge ``(source, values)`` layers (later wins) and validate, naming the source of a bad key."""
    merged: dict = {}
    origin: dict[str, str] = {}
    for source, values in layers:
        for key, value in values.items():
            merged[key] = value
            origin[key] = source
    try:
        return model(**merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, model, origin)) from None


def format_validation_error(exc: ValidationError, model: type[BaseModel], origin: dict[str, str]) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        top = str(err["loc"][0]) if err["loc"] else ""
        where = origin.get(top, "arguments")
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(top, list(model.model_fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"{where}: unknown key {key!r}{hint} (valid keys: {', '.join(model.model_fields)})")
        else:
            got = err.get("input")
            lines.append(f"{where}: key {key!r}: {err['msg']} (got {got!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_engine_config(config_file: str | None = None, **overrides: Any) -> EngineConfig:
    """EngineConfig from an optional YAML file, then the environment, then ``overrides``
    (None values are ignored, so unset CLI flags do not override the file)."""
    layers: list[tuple[str, dict]] = []
    if config_file:
        layers.append((str(config_file), engine_section(read_yaml(config_file), str(config_file))))
    layers.append(("environment (PAGODA_*)", env_overrides(EngineConfig)))
    layers.append(("arguments", {k: v for k, v in overrides.items() if v is not None}))
    return build_config(EngineConfig, layers)
