"""``pagoda attention-map --model DIR --prompt TEXT [--layer L] [--head H] --out map.png|map.html``

Runs the prompt once through the reference attention backend with the debug probe on and
renders each selected layer and head as a heatmap (query rows, key columns) titled with its
statistics: entropy, weight on the first token, mean attention distance. ``.png``: one image,
a grid of layers (rows) by heads (columns), each panel ``PANEL_PX`` pixels square plus a
``HEADER_PX`` title band. ``.html``: one image per layer and a table of every head's
statistics. The statistics are also printed (``--json``: as JSON).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from pagoda.errors import ConfigError

DPI = 100
PANEL_PX = 220  # each heatmap panel, square, in pixels
HEADER_PX = 40  # the title band above the grid
MAX_TICK_TOKENS = 24  # label the axes with the tokens of prompts up to this long


def add_parser(sub) -> None:
    p = sub.add_parser("attention-map", help="render attention heatmaps and statistics of a prompt",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", required=True, help="HF model directory, .gguf file or hub repo id ORG/NAME")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    source.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    p.add_argument("--layer", action="append", default=None, metavar="L",
                   help="attention layer index (repeatable or comma-separated; default: all)")
    p.add_argument("--head", action="append", default=None, metavar="H",
                   help="query head index (repeatable or comma-separated; default: all)")
    p.add_argument("--out", required=True, help="output file: .png or .html")
    p.add_argument("--device", default="cpu", help="platform (default cpu: the reference backend runs there)")
    p.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(func=run)


def parse_indices(values: list[str] | None, count: int, flag: str) -> list[int]:
    """``--layer 0 --layer 2,3`` -> [0, 2, 3]; None -> all; each must be in [0, count)."""
    if not values:
        return list(range(count))
    out: list[int] = []
    for value in values:
        for part in value.split(","):
            try:
                index = int(part)
            except ValueError:
                raise ConfigError(f"{flag} {part!r}: expected an integer index") from None
            if not 0 <= index < count:
                raise ConfigError(f"{flag} {index}: out of range, the model has {count} (0..{count - 1})")
            if index not in out:
                out.append(index)
    return out


def figure_pixels(rows: int, cols: int) -> tuple[int, int]:
    """(width, height) in pixels of the PNG for a grid of ``rows`` layers by ``cols`` heads."""
    return cols * PANEL_PX, rows * PANEL_PX + HEADER_PX


def render_grid(capture, stats: list[dict], layers: list[int], heads: list[int], labels: list[str] | None,
                title: str):
    """A matplotlib figure of layers (rows) x heads (columns) heatmaps, ``figure_pixels`` in size."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.colors import PowerNorm

    width, height = figure_pixels(len(layers), len(heads))
    fig = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    by_key = {(r["layer"], r["head"]): r for r in stats}
    top = 1 - HEADER_PX / height
    fig.suptitle(title, fontsize=9, y=1 - 0.25 * HEADER_PX / height, va="top")
    grid = fig.add_gridspec(len(layers), len(heads), left=0.08, right=0.98, bottom=0.06 * PANEL_PX / height,
                            top=top - 0.12 * PANEL_PX / height, wspace=0.25, hspace=0.45)
    n = len(capture.token_ids)
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = fig.add_subplot(grid[r, c])
            ax.imshow(capture.maps[layer][head].numpy(), cmap="viridis", norm=PowerNorm(0.5, vmin=0.0, vmax=1.0),
                      interpolation="nearest", aspect="auto")
            s = by_key[(layer, head)]
            ax.set_title(f"L{layer} H{head}  H={s['entropy']:.2f}\nfirst {s['first_token']:.2f}  "
                         f"dist {s['mean_distance']:.1f}", fontsize=7)
            if labels is not None and n <= MAX_TICK_TOKENS and len(heads) * len(layers) <= 4:
                ax.set_xticks(range(n), labels, rotation=90, fontsize=6)
                ax.set_yticks(range(n), labels, fontsize=6)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
    return fig


def _png_bytes(fig) -> bytes:
    from matplotlib import pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def write_html(path: Path, capture, stats: list[dict], layers: list[int], heads: list[int],
               labels: list[str] | None, title: str) -> None:
    """One heatmap row per layer (embedded PNG) and a table of every head's statistics."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:1em} table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    if labels is not None:
        parts.append("<p>tokens: " + " ".join(f"<code>{html.escape(t)}</code>" for t in labels) + "</p>")
    keys = ("entropy", "normalized_entropy", "first_token", "mean_distance", "local_share")
    parts.append("<table><tr><th>layer</th><th>head</th>" + "".join(f"<th>{k}</th>" for k in keys) + "</tr>")
    for row in stats:
        cells = "".join(f"<td>{row[k]:.4f}</td>" for k in keys)
        parts.append(f"<tr><td>{row['layer']}</td><td>{row['head']}</td>{cells}</tr>")
    parts.append("</table>")
    for layer in layers:
        fig = render_grid(capture, stats, [layer], heads, labels, f"layer {layer}")
        data = base64.b64encode(_png_bytes(fig)).decode("ascii")
        parts.append(f"<h2>layer {layer}</h2><img alt='layer {layer}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")


def run(args) -> int:
    from pagoda import LLM
    from pagoda.loader.source import resolve_source
    from pagoda.testing.attention import capture_attention, capture_statistics
    from pagoda.tokenizer import load_tokenizer

    out = Path(args.out)
    if out.suffix.lower() not in (".png", ".html"):
        raise ConfigError(f"--out {args.out}: the file must end in .png or .html")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {args.out}: folder {out.parent} does not exist")
    source = resolve_source(args.model)
    tokenizer = load_tokenizer(source, None)
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
    else:
        if tokenizer is None:
            raise ConfigError(f"{args.model} has no tokenizer: give --prompt-ids instead of --prompt")
        ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    if not ids:
        raise ConfigError("the prompt is empty")
    block = 16
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, block_size=block,
              num_kv_blocks=-(-(len(ids) + 1) // block), max_model_len=len(ids) + 1, enable_prefix_caching=False,
              enforce_eager=True)
    capture = capture_attention(llm, ids)
    layers = parse_indices(args.layer, capture.num_layers, "--layer")
    heads = parse_indices(args.head, capture.num_heads, "--head")
    stats = capture_statistics(capture, layers, heads)
    labels = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else None
    title = f"{source.name}: {len(ids)} tokens"
    if out.suffix.lower() == ".png":
        out.write_bytes(_png_bytes(render_grid(capture, stats, layers, heads, labels, title)))
    else:
        write_html(out, capture, stats, layers, heads, labels, title)
    if args.json:
        print(json.dumps({"model": source.name, "tokens": len(ids), "out": str(out), "heads": stats}, indent=2))
    else:
        print(f"{'layer':>5} {'head':>4} {'entropy':>8} {'norm':>6} {'first':>6} {'dist':>6} {'local':>6}")
        for r in stats:
            print(f"{r['layer']:>5} {r['head']:>4} {r['entropy']:>8.3f} {r['normalized_entropy']:>6.3f} "
                  f"{r['first_token']:>6.3f} {r['mean_distance']:>6.2f} {r['local_share']:>6.3f}")
        print(f"wrote {out}")
    return 0
