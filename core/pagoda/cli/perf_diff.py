"""``pagoda perf-diff A.json B.json [--plot diff.png]``: compare two ``pagoda bench`` results.

Reads ``pagoda bench throughput --json`` files (every timed run is kept in ``runs``) or
``pagoda bench serve --json`` reports (one run each). For each metric — throughput, latency
percentiles, the engine's time split — it compares the medians of B's runs with A's and
calls the change noise when it lies within the runs' own spread: the larger of A's and B's
range (max - min over their runs), and never less than ``--min-change`` (relative, default
2%; the only threshold when a file holds one run). Otherwise it is a regression or an
improvement, by the metric's direction. ``--plot`` draws B against A side by side (A = 100%,
whiskers: each file's range over its runs). ``--fail-on-regression`` exits 1 on any
regression (for CI).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from pagoda.errors import ConfigError

PLOT_PX = (1200, 450)  # width, height of the --plot PNG
DPI = 100
PERCENTILES = ("p50", "p90", "p99")
# throughput: higher is better; latency and time split: lower is better
THROUGHPUT = ("output_tok_s", "total_tok_s", "requests_per_s")
LATENCIES = ("ttft", "tpot", "e2e")
TIME_SPLIT = ("prefill", "decode", "schedule", "postprocess")
# the fields that make two results comparable
WORKLOAD_KEYS = ("num_prompts", "input_len", "output_len", "ignore_eos")


@dataclass
class MetricDiff:
    metric: str
    group: str  # throughput, latency, time split
    higher_is_better: bool
    a: float  # median over A's runs
    b: float
    a_runs: list[float]
    b_runs: list[float]
    threshold: float  # absolute change below which the difference is noise
    verdict: str = "noise"  # noise, regression, improvement

    @property
    def change(self) -> float:
        return (self.b - self.a) / self.a if self.a else float("inf") if self.b else 0.0


def add_parser(sub) -> None:
    p = sub.add_parser("perf-diff", help="compare two `pagoda bench` JSON results (noise-aware)",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("a", metavar="A.json", help="baseline result")
    p.add_argument("b", metavar="B.json", help="result to compare with the baseline")
    p.add_argument("--plot", metavar="PNG", help="write a side-by-side chart (matplotlib)")
    p.add_argument("--min-change", type=float, default=0.02,
                   help="relative change always treated as noise (default 0.02 = 2%%)")
    p.add_argument("--fail-on-regression", action="store_true", help="exit 1 if any metric regressed")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------- reading
def load_result(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(data, dict) or not ("runs" in data or "output_tokens_per_s" in data):
        raise ConfigError(f"{path}: not a `pagoda bench throughput --json` or `pagoda bench serve --json` result "
                          f"(no 'runs' and no 'output_tokens_per_s')")
    return data


def run_metrics(result: dict, path: str) -> list[dict[str, tuple[str, bool, float]]]:
    """Per run: metric name -> (group, higher is better, value)."""
    if "runs" not in result:  # bench serve: one run
        run = {"output_tok_s": ("throughput", True, result.get("output_tokens_per_s")),
               "requests_per_s": ("throughput", True, result.get("request_throughput"))}
        for lat in LATENCIES:
            for pct in PERCENTILES:
                run[f"{lat}_{pct}_ms"] = ("latency", False, (result.get(f"{lat}_ms") or {}).get(pct))
        return [{k: v for k, v in run.items() if v[2] is not None}]
    if not result["runs"]:
        raise ConfigError(f"{path}: 'runs' is empty")
    runs = []
    for r in result["runs"]:
        m = {k: ("throughput", True, r[k]) for k in THROUGHPUT if r.get(k) is not None}
        for lat, pcts in (r.get("latency_ms") or {}).items():
            for pct in PERCENTILES:
                if pcts.get(pct) is not None:
                    m[f"{lat}_{pct}_ms"] = ("latency", False, pcts[pct])
        for part in TIME_SPLIT:
            if (r.get("times") or {}).get(part) is not None:
                m[f"{part}_s"] = ("time split", False, r["times"][part])
        runs.append(m)
    return runs


def differences(a: dict, b: dict, min_change: float, names: tuple[str, str] = ("A", "B")) -> list[MetricDiff]:
    runs_a, runs_b = run_metrics(a, names[0]), run_metrics(b, names[1])
    out = []
    for metric, (group, higher, _) in runs_a[0].items():
        va = [r[metric][2] for r in runs_a if metric in r]
        vb = [r[metric][2] for r in runs_b if metric in r]
        if not vb:
            continue
        ma, mb = statistics.median(va), statistics.median(vb)
        threshold = max(max(va) - min(va), max(vb) - min(vb), min_change * abs(ma))
        d = MetricDiff(metric, group, higher, ma, mb, va, vb, threshold)
        if abs(mb - ma) > threshold:
            d.verdict = "improvement" if (mb > ma) == higher else "regression"
        out.append(d)
    return out


def mismatches(a: dict, b: dict) -> list[str]:
    """What differs between the two setups (a comparison across them may mislead)."""
    notes = []
    for key in WORKLOAD_KEYS:
        va, vb = (a.get("workload") or {}).get(key), (b.get("workload") or {}).get(key)
        if va != vb:
            notes.append(f"workload.{key}: {va} vs {vb}")
    for key in ("device", "dtype"):
        if a.get(key) != b.get(key):
            notes.append(f"{key}: {a.get(key)} vs {b.get(key)}")
    ma, mb = a.get("model") or {}, b.get("model") or {}
    if isinstance(ma, dict) and isinstance(mb, dict):
        for key in ("shape", "path", "architecture"):
            if ma.get(key) != mb.get(key):
                notes.append(f"model.{key}: {ma.get(key)} vs {mb.get(key)}")
    elif ma != mb:
        notes.append(f"model: {ma} vs {mb}")
    return notes


# ---------------------------------------------------------------------------- output
def format_table(diffs: list[MetricDiff], notes: list[str]) -> list[str]:
    lines = [f"{'metric':<18} {'A':>12} {'B':>12} {'change':>8} {'noise band':>11}  verdict"]
    for d in diffs:
        band = f"±{100 * d.threshold / abs(d.a):.1f}%" if d.a else "-"
        flag = {"regression": "REGRESSION", "improvement": "improvement", "noise": "noise"}[d.verdict]
        lines.append(f"{d.metric:<18} {d.a:>12.4g} {d.b:>12.4g} {100 * d.change:>+7.1f}% {band:>11}  {flag}")
    regressions = [d.metric for d in diffs if d.verdict == "regression"]
    lines.append(f"{len(regressions)} regressions" + (f": {', '.join(regressions)}" if regressions else "")
                 + f", {sum(d.verdict == 'improvement' for d in diffs)} improvements, "
                 f"{sum(d.verdict == 'noise' for d in diffs)} within noise")
    lines += [f"note: the runs differ in {n}" for n in notes]
    return lines


def plot(diffs: list[MetricDiff], path: str, labels: tuple[str, str]) -> None:
    """Per group a panel of B against A (A = 100%); whiskers span each file's runs."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    groups = [g for g in ("throughput", "latency", "time split") if any(d.group == g for d in diffs)]
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(PLOT_PX[0] / DPI, PLOT_PX[1] / DPI), dpi=DPI,
                             squeeze=False)
    colors = {"regression": "#d62728", "improvement": "#2ca02c", "noise": "#7f7f7f"}
    for ax, group in zip(axes[0], groups):
        rows = [d for d in diffs if d.group == group]
        x = range(len(rows))
        base = [d.a or 1.0 for d in rows]

        def whiskers(values, center, scale):
            return [[100 * (center - min(values)) / scale], [100 * (max(values) - center) / scale]]

        for i, (d, s) in enumerate(zip(rows, base)):
            ax.bar(i - 0.2, 100.0, 0.4, color="#1f77b4", yerr=whiskers(d.a_runs, d.a, s), capsize=3,
                   label=labels[0] if i == 0 else None)
            ax.bar(i + 0.2, 100 * d.b / s, 0.4, color=colors[d.verdict], yerr=whiskers(d.b_runs, d.b, s), capsize=3,
                   label=f"{labels[1]} ({d.verdict})" if d.verdict != "noise" or i == 0 else None)
            ax.text(i + 0.2, 100 * d.b / s, f"{100 * d.change:+.0f}%", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), [d.metric for d in rows], rotation=45, ha="right", fontsize=7)
        ax.set_title(f"{group} ({'higher' if rows[0].higher_is_better else 'lower'} is better)", fontsize=9)
        ax.set_ylabel(f"% of {labels[0]}", fontsize=8)
        handles, names = ax.get_legend_handles_labels()
        unique = dict(zip(names, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.suptitle(f"pagoda perf-diff: {labels[1]} against {labels[0]}", fontsize=10)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.22, top=0.86, wspace=0.3)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def run(args) -> int:
    if not 0 <= args.min_change < 1:
        raise ConfigError("--min-change must be in [0, 1), e.g. 0.02 for 2%")
    a, b = load_result(args.a), load_result(args.b)
    diffs = differences(a, b, args.min_change, (args.a, args.b))
    if not diffs:
        raise ConfigError(f"{args.a} and {args.b} have no metric in common")
    notes = mismatches(a, b)
    if args.json:
        print(json.dumps({"a": args.a, "b": args.b, "notes": notes,
                          "metrics": [dict(asdict(d), change=d.change) for d in diffs]}, indent=2))
    else:
        print("\n".join(format_table(diffs, notes)))
    if args.plot:
        plot(diffs, args.plot, (Path(args.a).stem, Path(args.b).stem))
        if not args.json:
            print(f"wrote {args.plot}")
    regressed = any(d.verdict == "regression" for d in diffs)
    return 1 if regressed and args.fail_on_regression else 0
