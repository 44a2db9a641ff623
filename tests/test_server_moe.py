"""`pagoda serve` over a tiny MoE model (Qwen3-MoE): /metrics reports the tokens routed to each
expert of each layer, and the load-balance figures."""

import httpx
import pytest
from pagoda.config import EngineConfig
from pagoda.server import ServerConfig, ServerThread, build_app
from pagoda.testing import make_tiny_checkpoint
from prometheus_client.parser import text_string_to_metric_families

TOP_K = 3
MOE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, moe_intermediate_size=32, head_dim=32,
           num_experts=8, num_experts_per_tok=TOP_K, norm_topk_prob=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=2, tokenizer=True, **MOE)
    engine = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    with ServerThread(build_app(engine, ServerConfig())) as srv:
        yield srv


def test_expert_load_reaches_the_metrics(server):
    prompt, max_tokens = [5, 17, 42, 99, 7, 8, 250], 6
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens
    per_layer: dict[str, float] = {}
    gauges = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in family.samples:
            if s.name == "pagoda_expert_tokens_total":
                per_layer[s.labels["layer"]] = per_layer.get(s.labels["layer"], 0) + s.value
            elif s.name in ("pagoda_expert_load_max_over_mean", "pagoda_expert_active_share"):
                gauges[s.name] = s.value
    # every token run through the model (the prompt, then each generated token but the last) is
    # routed to TOP_K experts in each of the two MoE layers
    assert len(per_layer) == 2
    assert set(per_layer.values()) == {(len(prompt) + max_tokens - 1) * TOP_K}
    assert gauges["pagoda_expert_load_max_over_mean"] >= 1.0 and 0 < gauges["pagoda_expert_active_share"] <= 1
