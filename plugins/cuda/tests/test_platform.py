"""The cuda plugin's registrations and the platform's behaviour without a GPU."""

import pytest
import torch
from pagoda.errors import PluginError
from pagoda.plugins import get_registry
from pagoda.selection import select_platform


def test_plugin_registers_platform_backend_and_kernels():
    reg = get_registry()
    assert reg.platforms.entries["cuda"].provider == "pagoda-cuda"
    assert reg.attention_backends.entries["triton"].provider == "pagoda-cuda"
    for op in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache",
               "fused_moe"):
        plat, prio, impl, provider = reg.kernels.candidates(op, "cuda")[0]
        assert (plat, provider) == ("cuda", "pagoda-cuda") and prio > 0
        assert reg.kernels.candidates(op, "cpu")[0][3] == "pagoda-core"


def test_platform_defaults():
    platform = get_registry().platforms.get("cuda")
    assert platform.default_dtype == "bfloat16"
    assert platform.dist_backend == "nccl"
    assert platform.supports_graphs


@pytest.mark.parametrize("gib, expected", [(141, 16384), (80, 16384), (24, 8192)])
def test_step_token_budget_follows_device_memory(monkeypatch, gib, expected):
    class Props:
        total_memory = gib * (1 << 30)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    assert get_registry().platforms.get("cuda").default_max_num_batched_tokens() == expected


@pytest.mark.parametrize("omp", ["", "3"])
def test_taking_a_gpu_leaves_torch_one_cpu_thread_unless_omp_num_threads_is_set(monkeypatch, omp):
    """torch's idle OpenMP threads spin on the cores the grammar masks' fill needs (docs/cuda.md)."""
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        get_registry().platforms.get("cuda").set_device(0)
        assert torch.get_num_threads() == (1 if not omp else 2)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_requesting_cuda_without_gpu_names_the_reason():
    platform = get_registry().platforms.get("cuda")
    assert not platform.is_available()
    assert "CUDA" in platform.unavailable_reason()
    with pytest.raises(PluginError, match="device 'cuda' was requested but is unavailable.*CUDA"):
        select_platform("cuda")
    assert select_platform("auto").name == "cpu"


@pytest.mark.gpu
def test_platform_on_gpu():
    platform = get_registry().platforms.get("cuda")
    assert platform.is_available() and select_platform("auto").name == "cuda"
    free, total = platform.memory_info()
    assert 0 < free <= total
    x = torch.zeros(4, device="cuda")

    def step():
        return x * 2 + 1

    step()
    graph = platform.capture_graph(step, platform.graph_pool())
    x.fill_(3)
    graph.replay()
    platform.synchronize()
    assert graph.output.tolist() == [7.0] * 4
    assert "cuda" in platform.describe()
