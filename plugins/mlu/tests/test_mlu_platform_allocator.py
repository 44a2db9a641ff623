"""MluPlatform's wiring to torch.mlu (through a STAND-IN torch_mlu) and the KV pool's arithmetic.

No test here runs on, or says anything about, MLU hardware: the stand-in only records calls.
"""

from types import SimpleNamespace

import pytest
import torch
from mlu_stand_ins import StandInTorchMlu, install_torch_mlu
from pagoda.errors import ConfigError, PluginError
from pagoda.plugins import load_plugins
from pagoda.selection import select_allocator
from pagoda_mlu.allocator import MluKVAllocator, plan_kv_pool
from pagoda_mlu.platform import MluPlatform

GiB = 1 << 30


def config(**overrides):
    values = dict(num_kv_blocks=None, kv_cache_memory_gb=None, memory_utilization=0.9)
    values.update(overrides)
    return SimpleNamespace(**values)


# ---------------------------------------------------------------- availability
def test_unavailable_without_torch_mlu(monkeypatch):
    install_torch_mlu(monkeypatch, None, import_error=ImportError("No module named 'torch_mlu'"))
    platform = MluPlatform()
    reason = platform.unavailable_reason()
    assert not platform.is_available()
    assert "torch_mlu is not importable" in reason and "not from PyPI" in reason and "docs/mlu.md" in reason
    with pytest.raises(PluginError, match="the mlu platform is unavailable: torch_mlu is not importable"):
        platform.memory_info()


def test_broken_torch_mlu_install_is_named(monkeypatch):
    install_torch_mlu(monkeypatch, None, import_error=OSError("libcnrt.so: cannot open shared object file"))
    assert MluPlatform().unavailable_reason() == (
        "torch_mlu failed to import: OSError: libcnrt.so: cannot open shared object file")


def test_torch_mlu_without_devices(monkeypatch):
    install_torch_mlu(monkeypatch, StandInTorchMlu(devices=0))
    reason = MluPlatform().unavailable_reason()
    assert "torch_mlu imported but reports no MLU device" in reason and "cnmon" in reason


def test_platform_calls_torch_mlu(monkeypatch):
    mlu = StandInTorchMlu(devices=2, free=30 * GiB, total=48 * GiB, bf16=False)
    install_torch_mlu(monkeypatch, mlu)
    platform = MluPlatform()
    assert platform.is_available() and platform.device_count() == 2
    assert (platform.dist_backend, platform.default_dtype, platform.env_switch) == ("cncl", "float16",
                                                                                   "PAGODA_USE_CAMB")
    platform.set_device(1)
    assert platform.memory_info() == (30 * GiB, 48 * GiB)
    platform.synchronize()
    platform.empty_cache()
    assert mlu.calls == [("set_device", 1), ("mem_get_info",), ("synchronize",), ("empty_cache",)]
    assert platform.describe() == "mlu (2 device(s), torch_mlu stand-in)"
    assert platform.dtype_unsupported_reason("float16") is None
    assert "is_bf16_supported() is False" in platform.dtype_unsupported_reason("bfloat16")
    assert not platform.supports_graphs  # this stand-in has no torch.mlu.MLUGraph: the engine runs eagerly


def test_graph_capture_uses_mlu_graphs(monkeypatch):
    mlu = StandInTorchMlu(graphs=True)
    install_torch_mlu(monkeypatch, mlu)
    platform = MluPlatform()
    assert platform.supports_graphs
    pool = platform.graph_pool()
    captured = platform.capture_graph(lambda: "static output", pool)
    assert captured.output == "static output"
    assert mlu.calls == [("graph begin", pool), ("graph end", pool)]
    captured.replay()
    assert captured.graph.replays == 1


# ---------------------------------------------------------------- KV pool sizing
# bytes per block (16 tokens, float16): 2 (K and V) x layers x KV heads x head size x 16 x 2 bytes
LLAMA3_8B_BLOCK = 2 * 32 * 8 * 128 * 16 * 2  # 2 MiB
QWEN3_30B_A3B_BLOCK = 2 * 48 * 4 * 128 * 16 * 2  # 1.5 MiB
DEEPSEEK_V3_MLA_BLOCK = 61 * (512 + 64) * 16 * 2  # one latent of kv_lora_rank + rope dims per token


@pytest.mark.parametrize("total_gib,free_gib,cached_gib,util,block,expected", [
    # (42 - 0.1 * 48) GiB = 37.2 GiB budget / 2 MiB = 19046.4 blocks
    (48, 40, 2, 0.9, LLAMA3_8B_BLOCK, 19046),
    # (13 - 0.15 * 24) GiB = 9.4 GiB / 1.5 MiB = 6417.07 blocks
    (24, 13, 0, 0.85, QWEN3_30B_A3B_BLOCK, 6417),
    # (20 - 0.1 * 80) GiB = 12 GiB / 1124352 bytes = 11459.85 blocks
    (80, 19, 1, 0.9, DEEPSEEK_V3_MLA_BLOCK, 11459),
])
def test_pool_size_from_mlu_free_memory(monkeypatch, total_gib, free_gib, cached_gib, util, block, expected):
    # Free memory as torch.mlu.mem_get_info reports it after the weights are loaded; `cached`
    # is what the caching allocator holds unused and hands back on empty_cache().
    mlu = StandInTorchMlu(free=free_gib * GiB, total=total_gib * GiB, cached=cached_gib * GiB)
    install_torch_mlu(monkeypatch, mlu)
    plan = MluKVAllocator().plan(MluPlatform(), block, config(memory_utilization=util))
    assert mlu.calls == [("empty_cache",), ("mem_get_info",)]  # measured after releasing the cache
    assert (plan.num_blocks, plan.source) == (expected, "memory_utilization")
    assert plan.pool_bytes <= plan.budget_bytes < plan.pool_bytes + block


def test_explicit_sizes_do_not_measure_memory(monkeypatch):
    mlu = StandInTorchMlu(free=GiB, total=48 * GiB)
    install_torch_mlu(monkeypatch, mlu)
    allocator, platform = MluKVAllocator(), MluPlatform()
    assert allocator.num_blocks(platform, LLAMA3_8B_BLOCK, config(kv_cache_memory_gb=10)) == 5120  # 10 GiB / 2 MiB
    assert allocator.num_blocks(platform, LLAMA3_8B_BLOCK, config(num_kv_blocks=777)) == 777
    assert mlu.calls == []


def test_no_room_for_the_cache_names_the_settings():
    with pytest.raises(ConfigError) as err:
        plan_kv_pool(4 * GiB, 48 * GiB, LLAMA3_8B_BLOCK, config(memory_utilization=0.9))
    message = str(err.value)
    assert "no memory left for the KV cache on mlu" in message and "memory_utilization allows -0.80 GiB" in message
    assert "device free 4.00 of 48.00 GiB" in message and "kv_cache_memory_gb / num_kv_blocks" in message


def test_pool_is_one_allocation_with_a_view_per_layer():
    shapes = [(2, 10, 2, 4, 8), (2, 10, 2, 4, 8), (10, 4, 12)]  # two MHA layers and an MLA one
    caches = MluKVAllocator().allocate(shapes, torch.float16, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == shapes
    storage = caches[0].untyped_storage()
    assert all(c.untyped_storage().data_ptr() == storage.data_ptr() for c in caches)
    assert storage.nbytes() == sum(c.numel() for c in caches) * 2  # exactly the layers, back to back
    assert all(c.is_contiguous() for c in caches)
    for i, cache in enumerate(caches):
        cache.fill_(i)
    assert [float(c.float().mean()) for c in caches] == [0.0, 1.0, 2.0]  # no view overlaps another


def test_mlu_pool_is_the_allocator_of_the_mlu_platform():
    reg = load_plugins()
    assert select_allocator(reg.platforms.get("mlu"), reg).name == "mlu-pool"
    assert select_allocator(reg.platforms.get("cpu"), reg).name == "default"
