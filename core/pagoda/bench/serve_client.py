"""The client side of ``pagoda bench serve``: the requests it sends and how it drives them.

A ``Plan`` (built by ``pagoda.bench.serve.build_plan``) lists the prompts and the load; ``one_request``
streams one completion or chat request (constrained by ``--structured-outputs`` as clients send it:
``BENCH_SCHEMA``, ``BENCH_CONSTRAINTS``) and times its first token and its end; ``drive`` keeps
``--concurrency`` requests in flight or sends them at the plan's Poisson arrival times; ``_drive`` splits
the plan over ``--client-processes`` processes that start together. Each request's ``Result`` lands in
``plan.results``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field

# the constraint of --structured-outputs: open-ended enough that outputs run long, as extraction does
BENCH_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                "required": ["street", "city"]}},
    "required": ["name", "age", "tags", "address"]}
BENCH_CONSTRAINTS = {"json": {"json": BENCH_SCHEMA}, "regex": {"regex": r"([a-z]+ ){4,40}[a-z]+\."},
                     "choice": {"choice": ["positive", "negative", "neutral"]}}


def constrain(body: dict, kind: str | None, endpoint: str) -> None:
    """Add the --structured-outputs constraint to a request body, as clients send it."""
    if kind is None:
        return
    if kind == "json" and endpoint == "chat":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": BENCH_SCHEMA}}
    else:
        body["structured_outputs"] = BENCH_CONSTRAINTS[kind]


@dataclass
class Result:
    ok: bool
    start: float
    end: float
    ttft: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


@dataclass
class Plan:
    url: str
    headers: dict
    model: str
    endpoint: str
    prompts: list[str]
    max_tokens: int
    temperature: float
    timeout: float
    arrivals: list[float] | None = None  # seconds after start (rate mode)
    rate: float | None = None
    concurrency: int | None = None
    duration: float | None = None
    structured: str | None = None  # --structured-outputs
    client_processes: int = 1
    results: list[Result] = field(default_factory=list)


async def one_request(client, plan: Plan, prompt: str) -> Result:
    body = {"model": plan.model, "max_tokens": plan.max_tokens, "temperature": plan.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if plan.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    constrain(body, plan.structured, plan.endpoint)
    start = time.perf_counter()
    result = Result(ok=False, start=start, end=start)
    try:
        async with client.stream("POST", plan.url + path, json=body, headers=plan.headers,
                                 timeout=plan.timeout) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = f"stream error: {event['error'].get('type')}"
                    return result
                if result.ttft is None and _carries_token(event):
                    result.ttft = time.perf_counter() - start
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage in the stream"
    except Exception as exc:  # connection refused, timeout ...
        result.error = type(exc).__name__
    finally:
        result.end = time.perf_counter()
    return result


def _carries_token(event: dict) -> bool:
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        if delta is None or delta.get("content") or choice.get("logprobs") or choice.get("finish_reason"):
            return True  # completions chunks carry a token each; chat's first chunk is only the role
    return False


async def drive(plan: Plan, t0: float | None = None) -> float:
    """Send the plan's requests (its results fill ``plan.results``); the wall time from ``t0`` (a
    ``time.perf_counter()`` value, the same clock in every process of this machine; default: now)."""
    import httpx

    limit = plan.concurrency or len(plan.prompts)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=limit + 4)) as client:
        if t0 is None:
            t0 = time.perf_counter()
        else:
            await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        stop_at = None if plan.duration is None else t0 + plan.duration
        if plan.concurrency:
            queue = iter(plan.prompts)

            async def worker() -> None:
                for prompt in queue:
                    if stop_at is not None and time.perf_counter() >= stop_at:
                        return
                    plan.results.append(await one_request(client, plan, prompt))

            await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
        else:
            tasks = []
            for prompt, at in zip(plan.prompts, plan.arrivals or []):
                delay = t0 + at - time.perf_counter()
                if stop_at is not None and t0 + at >= stop_at:
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one_request(client, plan, prompt)))
            plan.results.extend(await asyncio.gather(*tasks))
        return time.perf_counter() - t0


def _drive_part(plan: Plan, t0: float | None = None) -> tuple[list[Result], float, float]:
    """One client process's run: (its results, its wall time from t0, its CPU seconds)."""
    plan.results = []
    cpu0 = time.process_time()
    wall = asyncio.run(drive(plan, t0))
    return plan.results, wall, time.process_time() - cpu0


def _client_ready(hold: float) -> None:
    import httpx  # noqa: F401 - imported before the clock starts

    time.sleep(hold)


def _split(plan: Plan, n: int) -> list[Plan]:
    """The plan in n parts: every n-th request (with its arrival time) and 1/n of the concurrency each."""
    if plan.concurrency:
        n = min(n, plan.concurrency)
    parts = []
    for i in range(n):
        part = dataclasses.replace(plan, prompts=plan.prompts[i::n], results=[],
                                   arrivals=None if plan.arrivals is None else plan.arrivals[i::n])
        if plan.concurrency:
            part.concurrency = plan.concurrency // n + (i < plan.concurrency % n)
        parts.append(part)
    return [p for p in parts if p.prompts]


def _drive(plan: Plan) -> tuple[float, float]:
    """Run the plan from ``plan.client_processes`` processes that start together; fills
    ``plan.results``; returns (wall time, the busiest process's CPU time over the wall time)."""
    if plan.client_processes <= 1:
        done = [_drive_part(plan)]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        parts = _split(plan, plan.client_processes)
        # spawned (this process may run threads, e.g. a server in tests); each worker first imports its client
        # and holds on a moment, so that every part starts in its own, ready process at the same t0
        with ProcessPoolExecutor(len(parts), mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_client_ready, [0.2] * len(parts)))
            t0 = time.perf_counter() + 0.05
            done = list(pool.map(_drive_part, parts, [t0] * len(parts)))
    plan.results = [r for results, _, _ in done for r in results]
    wall = max(w for _, w, _ in done)
    return wall, max(cpu / wall for _, _, cpu in done) if wall > 0 else 0.0
