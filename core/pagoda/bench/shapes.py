"""Named benchmark shapes: the transformers configs of ``/shared/BENCH_ANCHORS.md`` (and of
google/gemma-3-1b-it and openai/gpt-oss-20b, whose published configs these copy), written to a
directory as ``config.json`` so the engine loads them with ``load_format: dummy`` (random
weights built on the device; nothing is downloaded). gpt-oss-20b's experts are then bf16, as
pagoda computes the published MXFP4 ones after dequantizing them at load."""

from __future__ import annotations

import json
from pathlib import Path

from pagoda.errors import ConfigError

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "phi3-mini": dict(
        model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
        tie_word_embeddings=False, max_position_embeddings=4096, original_max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "deepseek-v3-4l": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=4, first_k_dense_replace=3,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        vocab_size=129280, tie_word_embeddings=False, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0}),
    # five layers of window 512 per global layer (pattern 6), MQA with 256-wide heads
    "gemma3-1b": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        sliding_window=512, hidden_activation="gelu_pytorch_tanh",
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # 24 layers alternating window 128 and global, sinks, 32 experts top-4 with biases
    "gpt-oss-20b": dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, sliding_window=128, vocab_size=201088, tie_word_embeddings=False,
        max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
    # Qwen/Qwen2.5-VL-3B-Instruct's config (vision tower and text model); the image workload
    # (--images-per-prompt) feeds it random images through its image processor's defaults
    "qwen2.5-vl-3b": dict(
        model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], tie_word_embeddings=True,
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, window_size=112, temporal_patch_size=2,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")),
}


def shape_config(name: str):
    """The transformers config object of a named shape."""
    if name not in SHAPES:
        raise ConfigError(f"--shape {name!r} is not a known shape (known: {', '.join(SHAPES)})")
    from transformers import AutoConfig

    fields = dict(SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def write_shape(name: str, directory: str | Path) -> Path:
    """Write the shape's config.json into ``directory`` (created) and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = shape_config(name)
    data = config.to_dict()
    data["architectures"] = SHAPES[name]["architectures"]
    (directory / "config.json").write_text(json.dumps(data, indent=1, default=str))
    return directory


def add_shape_arg(parser, help_text: str = "random-weight model of a named shape, built on the device "
                  "(instead of --model)") -> None:
    """``--shape NAME`` (one of ``SHAPES``) on a benchmark's parser."""
    parser.add_argument("--shape", choices=sorted(SHAPES), help=help_text)


def shape_engine_args(args, directory: str | Path) -> dict:
    """The engine config keys of ``--shape``: the shape's config.json written under ``directory`` (which
    must outlive the engine), random weights (``load_format: dummy``), no tokenizer; {} without
    ``--shape``. ``--model`` with ``--shape`` is a ConfigError."""
    if not getattr(args, "shape", None):
        return {}
    if args.model:
        raise ConfigError("give either --model or --shape, not both")
    return dict(model=str(write_shape(args.shape, Path(directory) / args.shape)), load_format="dummy",
                skip_tokenizer_init=True)
