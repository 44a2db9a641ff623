"""What a layer is, from its prefix: its kind and its checkpoint (HF) module names.

pagoda fuses some projections (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``), so a
checkpoint's list of modules that stay unquantized (``modules_to_not_convert``,
``ignored_layers``) names pieces of a pagoda layer; a fused layer is skipped when all of its
pieces are listed, and a layer with only some pieces listed is an error (one matmul cannot
be half quantized).
"""

from __future__ import annotations

import re

from pagoda.errors import ModelLoadError

# pagoda fused layer name -> the checkpoint modules it holds
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
ATTENTION_LEAVES = {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_a_proj", "q_b_proj",
                    "kv_a_proj_with_mqa", "kv_b_proj", "fused_qkv_a_proj", "query_key_value", "dense"}
ROUTER_LEAVES = {"gate", "router", "shared_expert_gate"}
KINDS = ("attention", "mlp", "experts", "shared_experts", "router", "other")


def layer_kind(prefix: str) -> str:
    """One of KINDS: routed MoE ``experts``, ``shared_experts``, ``attention``, dense ``mlp``,
    a MoE ``router`` gate (always kept in full precision), or ``other``."""
    parts = prefix.split(".")
    leaf = parts[-1]
    if leaf in ROUTER_LEAVES:
        return "router"
    if any(p in ("shared_expert", "shared_experts") for p in parts):
        return "shared_experts"
    if "experts" in parts:
        return "experts"
    if leaf in ATTENTION_LEAVES or any("attn" in p or "attention" in p for p in parts[:-1]):
        return "attention"
    if any(p in ("mlp", "feed_forward", "ffn") for p in parts) or leaf.endswith(("_proj", "fc1", "fc2")):
        return "mlp"
    return "other"


def checkpoint_names(prefix: str) -> list[str]:
    """pagoda prefix -> the checkpoint module names it is loaded from."""
    head, _, leaf = prefix.rpartition(".")
    parts = FUSED_PARTS.get(leaf)
    if parts is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def _names_module(name: str, entry: str) -> bool:
    """Whether module ``entry`` (a name or dotted path fragment) is ``name`` or contains it,
    matched on whole dotted components ("layers.1" does not match "layers.10")."""
    return re.search(rf"(^|\.){re.escape(entry)}(\.|$)", name) is not None


def is_listed(prefix: str, modules: list[str] | None, key: str) -> bool:
    """Whether a checkpoint's module list ``key`` (e.g. ``modules_to_not_convert``) covers
    this pagoda layer."""
    if not modules:
        return False
    if any(_names_module(prefix, m) for m in modules):  # e.g. Phi-3 stores qkv_proj fused already
        return True
    names = checkpoint_names(prefix)
    hits = [any(_names_module(n, m) for m in modules) for n in names]
    if all(hits):
        return True
    if any(hits):
        listed = [n for n, h in zip(names, hits) if h]
        raise ModelLoadError(f"quantization_config.{key} lists {', '.join(listed)} but not the other parts of "
                             f"{', '.join(names)}, which pagoda computes as one fused layer {prefix!r}; "
                             f"list all of them or none")
    return False
