"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Request-level metrics are observed as requests finish; engine-level ones (running and
waiting sequences, KV blocks, preemptions, prefix cache, expert load) are read from
``LLMEngine.get_stats()`` at each scrape of ``/metrics``.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagoda.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# get_stats() key -> (metric name, help, kind)
ENGINE_METRICS = {
    "num_running": ("pagoda_num_seqs_running", "sequences in the running batch", "gauge"),
    "num_waiting": ("pagoda_num_seqs_waiting", "sequences waiting for a seat", "gauge"),
    "kv_blocks_total": ("pagoda_kv_blocks_total", "KV cache blocks", "gauge"),
    "kv_blocks_used": ("pagoda_kv_blocks_used", "KV cache blocks held by sequences", "gauge"),
    "kv_blocks_free": ("pagoda_kv_blocks_free", "KV cache blocks free or evictable (cached, unreferenced)",
                       "gauge"),
    "num_preemptions": ("pagoda_preemptions", "sequences preempted (recomputed later) for lack of blocks",
                        "counter"),
    "num_steps": ("pagoda_engine_steps", "engine steps run", "counter"),
    "steps_launched_ahead": ("pagoda_engine_steps_launched_ahead", "engine steps launched before the previous "
                             "step's tokens reached the host (the step pipeline)", "counter"),
    "steps_sampled_after_launch": ("pagoda_engine_steps_sampled_after_launch", "launched steps whose tokens were "
                                   "chosen on the device after the previous step's commit (grammar masks)",
                                   "counter"),
    "device_wait_seconds": ("pagoda_engine_device_wait_seconds", "host seconds the step pipeline waited for the "
                            "device's sampled tokens (near 0 while host work bounds the steps)", "counter"),
    "mixed_steps_replayed": ("pagoda_engine_mixed_steps_replayed", "steps with prefill chunks replayed from "
                             "captured graphs (the others with prefill chunks run eagerly)", "counter"),
    "prefill_tokens_computed": ("pagoda_prefill_tokens_computed", "prompt tokens computed (not served "
                                "from the prefix cache)", "counter"),
    "prefix_cache_hit_tokens": ("pagoda_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                                "counter"),
    "prefix_cache_query_tokens": ("pagoda_prefix_cache_query_tokens", "prompt tokens looked up in the "
                                  "prefix cache", "counter"),
}


class EngineCollector:
    """Turns the last ``get_stats()`` snapshot into metric families."""

    def __init__(self):
        self.stats: dict[str, Any] = {}

    def describe(self):
        return []  # families depend on the snapshot (expert load only for MoE models)

    def collect(self):
        stats = self.stats
        for key, (name, doc, kind) in ENGINE_METRICS.items():
            if key not in stats:
                continue
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=float(stats[key]))
        total = stats.get("kv_blocks_total")
        if total:
            yield GaugeMetricFamily("pagoda_kv_cache_usage_ratio", "share of KV cache blocks in use",
                                    value=stats.get("kv_blocks_used", 0) / total)
        masks = stats.get("structured_outputs")
        if masks:
            yield CounterMetricFamily("pagoda_grammar_mask_rows", "constrained rows whose grammar mask was "
                                      "filled", value=float(masks["mask_rows"]))
            yield CounterMetricFamily("pagoda_grammar_mask_seconds", "host seconds spent filling "
                                      "grammar masks", value=float(masks["mask_seconds"]))
            yield CounterMetricFamily("pagoda_grammar_fill_wait_seconds", "host seconds the engine waited for "
                                      "grammar masks filled ahead (part of mask_seconds)",
                                      value=float(masks.get("fill_wait_seconds", 0.0)))
        yield from speculative_families(stats.get("speculative"))
        replicas = stats.get("data_parallel")
        if replicas:  # data parallelism: each replica's gauges, labelled by replica
            for key in ("num_running", "num_waiting", "num_unfinished", "kv_blocks_used", "kv_blocks_total",
                        "generated_tokens"):
                family = GaugeMetricFamily(f"pagoda_dp_{key}", f"{key} of each data-parallel replica (its last "
                                           f"report)", labels=["replica"])
                for rep in replicas:
                    if key in rep:
                        family.add_metric([str(rep["replica"])], float(rep[key]))
                yield family
        experts = stats.get("expert_load")
        if experts:
            load = CounterMetricFamily("pagoda_expert_tokens", "tokens routed to each expert of each MoE "
                                       "layer", labels=["layer", "expert"])
            for layer, counts in experts["layers"].items():
                for expert, count in enumerate(counts):
                    load.add_metric([layer, str(expert)], float(count))
            yield load
            yield GaugeMetricFamily("pagoda_expert_load_max_over_mean", "most loaded expert / mean expert "
                                    "load, averaged over MoE layers (1 = balanced)",
                                    value=float(experts["max_over_mean"]))
            yield GaugeMetricFamily("pagoda_expert_active_share", "share of (layer, expert) pairs that "
                                    "received any token", value=float(experts["active_share"]))


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.http_requests = Counter("pagoda_http_requests", "HTTP requests by route and status",
                                     ["method", "route", "status"], registry=r)
        self.requests_finished = Counter("pagoda_requests_finished", "generation requests by how they ended "
                                         "(stop, length, abort, error, timeout)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("pagoda_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pagoda_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("pagoda_time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pagoda_time_per_output_token_seconds", "mean time between output tokens "
                              "of a request, after the first", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pagoda_e2e_request_latency_seconds", "time from arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.engine = EngineCollector()
        r.register(self.engine)

    def observe_request(self, out: RequestOutput | None, reason: str, start: float,
                        first_token: float | None) -> None:
        """Record one request that ended (``time.monotonic()`` times): generation, or pooling (its
        prompt tokens and end-to-end time; it generates none)."""
        now = time.monotonic()
        self.requests_finished.labels(reason).inc()
        if out is None:
            return
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        if not isinstance(out.outputs, list):  # a pooling output
            if reason == "stop":
                self.e2e.observe(now - start)
            return
        generated = [len(c.token_ids) for c in out.outputs]
        self.generation_tokens.inc(sum(generated))
        if first_token is not None and reason in ("stop", "length"):
            self.e2e.observe(now - start)
            longest = max(generated, default=0)
            if longest > 1:
                self.tpot.observe((now - first_token) / (longest - 1))

    def render(self, stats: dict[str, Any]) -> bytes:
        self.engine.stats = stats
        return generate_latest(self.registry)


def speculative_families(spec: dict | None):
    """Speculative decoding metrics (``get_stats()["speculative"]``), as vLLM names them."""
    if not spec:
        return
    yield CounterMetricFamily("pagoda_spec_decode_num_drafts", "verifications of drafted tokens (one per "
                              "sequence and step)", value=float(spec["num_drafts"]))
    yield CounterMetricFamily("pagoda_spec_decode_num_draft_tokens", "drafted tokens verified by the target",
                              value=float(spec["draft_tokens"]))
    yield CounterMetricFamily("pagoda_spec_decode_num_accepted_tokens", "drafted tokens accepted",
                              value=float(spec["accepted_tokens"]))
    yield GaugeMetricFamily("pagoda_spec_decode_acceptance_rate", "accepted / drafted tokens",
                            value=float(spec["acceptance_rate"]))
    yield GaugeMetricFamily("pagoda_spec_decode_mean_accepted_length", "tokens one verification yields (kept "
                            "drafts plus the target's token)", value=float(spec["mean_accepted_length"]))
    per = GaugeMetricFamily("pagoda_spec_decode_per_position_acceptance", "share of tokens drafted at each "
                            "position that were accepted", labels=["position"])
    for i, rate in enumerate(spec["per_position_acceptance"]):
        per.add_metric([str(i)], float(rate))
    yield per
