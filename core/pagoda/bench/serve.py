"""``pagoda bench serve``: drive a running server over HTTP and report latency and throughput.

Either a fixed ``--concurrency`` (that many requests in flight at all times) or a
``--request-rate`` (Poisson arrivals, requests per second), for ``--num-requests`` requests or
``--duration`` seconds, whichever ends first. Every request streams (so time to first token
and time per output token are measured at the client) and asks for ``--max-tokens`` tokens
with EOS ignored; ``--num-warmups N`` sends N untimed requests first. Only servers on this machine (loopback)
are accepted. This module reads the
arguments into a plan and reports; the requests and how they are driven are ``pagoda.bench.serve_client``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import random
import socket
import statistics
import sys
from urllib.parse import urlsplit

from pagoda.bench.serve_client import Plan, _drive
from pagoda.errors import ConfigError

WORDS = ("the of and to in is was for on that with as by at from his her they this which one all were when "
         "river mountain city music light garden winter engine letter market window story question answer "
         "morning silver doctor travel ocean history forest bridge village machine").split()


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load a running server (OpenAI API) and report TTFT, TPOT, throughput")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server requires one")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="requests in flight at once (default 8)")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    p.add_argument("--num-requests", type=int, default=64, help="requests to send (at most)")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--prompt-len", type=int, default=32, help="words per prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts and arrival times")
    p.add_argument("--structured-outputs", choices=("json", "regex", "choice"), default=None,
                   help="constrain every request (completions: `structured_outputs`; chat: `response_format` "
                        "for json) with the same JSON schema, regex or choice; the report adds the server's "
                        "grammar-mask cost from /metrics")
    p.add_argument("--compare-unconstrained", action="store_true",
                   help="with --structured-outputs: run the same requests unconstrained first and report the "
                        "constrained/unconstrained output tok/s ratio")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --compare-unconstrained: this many unconstrained/constrained pairs, interleaved; "
                        "the ratio reported is the median of the pairs' (a server's rate varies between runs)")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="send this many requests first, untimed, at the run's concurrency (with "
                        "--compare-unconstrained: this many of each mode): the server's first steps of a mode "
                        "compile kernels and grammars that would otherwise land in the timed run")
    p.add_argument("--client-processes", type=int, default=1,
                   help="drive the load from this many processes (requests and concurrency split between them): "
                        "one Python process parses about 8,000 streamed tokens/s, and a faster server needs more "
                        "(the report's client_cpu_share says when)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def check_loopback(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--url {url!r}: expected http://HOST:PORT")
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, parts.port or 80)}
    except OSError as exc:
        raise ConfigError(f"--url {url!r}: cannot resolve {parts.hostname}: {exc}") from exc
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ConfigError(f"--url {url!r}: pagoda bench serve only drives servers on this machine (loopback "
                          f"addresses such as 127.0.0.1 or localhost)")
    return url.rstrip("/")


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(values)

    def pct(q: float) -> float:  # linear interpolation between closest ranks
        pos = (len(s) - 1) * q
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "mean": sum(s) / len(s)}


def report(plan: Plan, wall: float) -> dict:
    ok = [r for r in plan.results if r.ok]
    errors: dict[str, int] = {}
    for r in plan.results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.end - r.start - r.ttft) / (r.output_tokens - 1)
            for r in ok if r.ttft is not None and r.output_tokens > 1]
    ms = lambda d: {k: (None if v is None else round(v * 1000, 3)) for k, v in d.items()}  # noqa: E731
    return {
        "model": plan.model, "endpoint": plan.endpoint, "url": plan.url,
        "mode": f"concurrency {plan.concurrency}" if plan.concurrency else f"rate {plan.rate:g}/s",
        "requests": len(plan.results), "completed": len(ok), "errors": errors, "duration_s": round(wall, 3),
        "request_throughput": round(len(ok) / wall, 3) if wall > 0 else None,
        "output_tokens": out_tokens, "output_tokens_per_s": round(out_tokens / wall, 2) if wall > 0 else None,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_ms": ms(percentiles([r.ttft for r in ok if r.ttft is not None])),
        "tpot_ms": ms(percentiles(tpot)),
        "e2e_ms": ms(percentiles([r.end - r.start for r in ok])),
    }


def build_plan(args) -> Plan:
    import httpx

    url = check_loopback(args.url)
    for name in ("num_requests", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        try:
            r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
        except httpx.HTTPError as exc:
            raise ConfigError(f"--url {url}: no server answers there ({type(exc).__name__})") from exc
        if r.status_code != 200:
            raise ConfigError(f"{url}/v1/models answered {r.status_code}: {r.text[:200]}")
        model = r.json()["data"][0]["id"]
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_len)) for _ in range(args.num_requests)]
    if args.compare_unconstrained and not args.structured_outputs:
        raise ConfigError("--compare-unconstrained needs --structured-outputs")
    if args.client_processes < 1:
        raise ConfigError("--client-processes must be >= 1")
    plan = Plan(url, headers, model, args.endpoint, prompts, args.max_tokens, args.temperature, args.timeout,
                duration=args.duration, structured=args.structured_outputs, client_processes=args.client_processes)
    if args.request_rate is not None:
        if args.request_rate <= 0:
            raise ConfigError("--request-rate must be > 0")
        t, plan.arrivals, plan.rate = 0.0, [], args.request_rate
        for _ in prompts:
            plan.arrivals.append(t)
            t += rng.expovariate(args.request_rate)
    else:
        plan.concurrency = args.concurrency or 8
        if plan.concurrency < 1:
            raise ConfigError("--concurrency must be >= 1")
    return plan


MASK_METRICS = ("pagoda_grammar_mask_seconds_total", "pagoda_grammar_mask_rows_total", "pagoda_engine_steps_total",
                "pagoda_engine_steps_launched_ahead_total", "pagoda_grammar_fill_wait_seconds_total",
                "pagoda_engine_device_wait_seconds_total")


def scrape(plan: Plan) -> dict[str, float]:
    """The server's grammar-mask counters, step count and waits (absent counters, e.g. another server's, read 0)."""
    import httpx

    r = httpx.get(plan.url + "/metrics", headers=plan.headers, timeout=10)
    values = dict.fromkeys(MASK_METRICS, 0.0)
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return values


def measured(plan: Plan) -> dict:
    """One run of the plan; the engine's steps and its waits for the device over it, and with a constraint the
    mask cost the server reports for it."""
    before = scrape(plan)
    wall, client_cpu = _drive(plan)
    rep = report(plan, wall)
    # The client's own CPU time over the wall time (its busiest process): near 1.0 the client (a Python
    # process parsing every streamed event) bounds the rate, not the server.
    rep["client_cpu_share"] = round(client_cpu, 3)
    rep["client_processes"] = plan.client_processes
    rep["structured_outputs"] = plan.structured
    after = scrape(plan)
    seconds, rows, steps, ahead, fill_wait, device_wait = (after[k] - before[k] for k in MASK_METRICS)
    per_step = lambda x: round(1000 * x / steps, 3) if steps else None  # noqa: E731 - ms per engine step
    # the device waited for the host most of a step where the host's wait for the device is short
    rep["engine"] = {"steps": int(steps), "steps_launched_ahead": int(ahead), "device_wait_ms_per_step":
                     per_step(device_wait)}
    if plan.structured:
        rep["grammar_mask"] = {"seconds": round(seconds, 4), "rows": int(rows), "engine_steps": int(steps),
                               "steps_launched_ahead": int(ahead), "ms_per_step": per_step(seconds),
                               "fill_wait_ms_per_step": per_step(fill_wait),
                               "us_per_row": round(1e6 * seconds / rows, 2) if rows else None,
                               "share_of_wall": round(seconds / wall, 4) if wall else None}
    return rep


def warm_up(plan: Plan, count: int, modes: list[str | None]) -> list[dict]:
    """``count`` untimed requests per mode in ``modes`` (None: unconstrained), at the plan's concurrency (rate
    mode: at most 8 at once), from one client process; their reports (kept out of the results)."""
    prompts = [plan.prompts[i % len(plan.prompts)] for i in range(count)]
    warm = dataclasses.replace(plan, prompts=prompts, arrivals=None, rate=None, duration=None, results=[],
                               concurrency=min(count, plan.concurrency or 8), client_processes=1)
    reports = []
    for mode in modes:
        warm.structured = mode
        wall, _ = _drive(warm)
        reports.append(report(warm, wall))
    return reports


def run(args) -> int:
    plan = build_plan(args)
    if args.repeats < 1 or (args.repeats > 1 and not args.compare_unconstrained):
        raise ConfigError("--repeats must be >= 1, and more than 1 needs --compare-unconstrained")
    if args.num_warmups < 0:
        raise ConfigError("--num-warmups must be >= 0")
    warmups = []
    if args.num_warmups:
        modes = [None, plan.structured] if args.compare_unconstrained else [plan.structured]
        warmups = warm_up(plan, args.num_warmups, modes)
        failed = sum(w["requests"] - w["completed"] for w in warmups)
        if failed:
            print(f"warning: {failed} of the warm-up requests failed", file=sys.stderr)
    reports, ratios = [], []
    for _ in range(args.repeats if args.compare_unconstrained else 1):
        if args.compare_unconstrained:
            kind, plan.structured = plan.structured, None
            reports.append(measured(plan))
            plan.structured = kind
        reports.append(measured(plan))
        if args.compare_unconstrained and reports[-2]["output_tokens_per_s"]:
            ratios.append(reports[-1]["output_tokens_per_s"] / reports[-2]["output_tokens_per_s"])
    rep = reports[-1]
    if ratios:
        rep["unconstrained"] = reports[-2]
        rep["ratio_to_unconstrained"] = round(statistics.median(ratios), 4)
        rep["pair_ratios"] = [round(r, 4) for r in ratios]
        # every pair's rates (the top-level report and "unconstrained" are the last pair's runs)
        rep["pair_rates"] = [[u["output_tokens_per_s"], c["output_tokens_per_s"]]
                             for u, c in zip(reports[0::2], reports[1::2])]
    if warmups:
        rep["warmups"] = {"requests_per_mode": args.num_warmups,
                          "completed": sum(w["completed"] for w in warmups)}
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        for r in reports:
            _print(r)
        if "ratio_to_unconstrained" in rep:
            pairs = f" (median of {len(ratios)} pairs: {rep['pair_ratios']})" if len(ratios) > 1 else ""
            print(f"  constrained / unconstrained output tok/s: {rep['ratio_to_unconstrained']:.3f}{pairs}")
    return 0 if all(r["completed"] == r["requests"] for r in reports) else 1


def _print(rep: dict) -> None:
    label = f" [{rep['structured_outputs']}]" if rep.get("structured_outputs") else ""
    print(f"{rep['completed']}/{rep['requests']} requests to {rep['model']}{label} ({rep['mode']}) in "
          f"{rep['duration_s']:.2f}s: {rep['request_throughput']} req/s, {rep['output_tokens_per_s']} output tok/s")
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        v = rep[key]
        print(f"  {key[:-3].upper():<5} ms  p50 {v['p50']}  p90 {v['p90']}  p99 {v['p99']}")
    share = rep.get("client_cpu_share")
    if share is not None:
        busy = "  (the client may be the bottleneck: more --client-processes)" if share > 0.85 else ""
        print(f"  client CPU  {100 * share:.0f}% of the wall time{busy}")
    mask = rep.get("grammar_mask")
    if mask:
        print(f"  grammar masks: {mask['ms_per_step']} ms per engine step ({mask['fill_wait_ms_per_step']} waiting "
              f"for fills ahead), {mask['us_per_row']} us per row, {100 * (mask['share_of_wall'] or 0):.1f}% of the "
              f"wall time")
    engine = rep.get("engine")
    if engine and engine["steps"]:
        print(f"  engine: {engine['steps']} steps, {engine['device_wait_ms_per_step']} ms per step waiting for the "
              f"device")
    if rep["errors"]:
        print(f"  errors: {rep['errors']}", file=sys.stderr)
