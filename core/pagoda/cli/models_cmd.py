"""``pagoda models``: the supported architectures, from the registry (``--markdown`` writes
docs/models.md: ``PAGODA_PLUGINS=models pagoda models --markdown > docs/models.md``).

Native architectures are the ones a plugin registers by name. A model class describes itself
with two optional class attributes: ``FEATURES`` (what of the architecture it implements) and
``TESTED`` (what is proven against transformers); without ``FEATURES`` the first line of its
module's docstring is used. Architectures without a native class are listed "via
transformers" when the fallback (registered as ``"*"``) runs them; its
``TESTED_ARCHITECTURES`` says which of them pagoda's tests compare with transformers.
"""

from __future__ import annotations

MARKDOWN_HEADER = """\
# Supported model architectures

<!-- Generated: `PAGODA_PLUGINS=models pagoda models --markdown > docs/models.md`.
     tests/test_models_docs.py fails when this page and the command's output differ. -->

pagoda picks the model class from the `architectures` list of a checkpoint's `config.json`
(or the GGUF metadata): the class a plugin registers under that name (a native
implementation, below), else the core's transformers fallback, which runs transformers' own
modeling code on pagoda's paged KV cache, scheduler and sampler (the second table). A native
class always wins; `model_impl: pagoda` accepts only a native class, `model_impl: transformers`
always takes the fallback. Model plugins register more architectures through the
`register_models` hook; `pagoda models` lists what is installed.

## Native architectures

Every architecture below is compared with HF transformers on tiny random checkpoints written
by `save_pretrained` (`pagoda.testing.make_tiny_checkpoint`): the logits of every prompt
position agree in float32 within 1e-4 (Llama family: 2e-4), absolute and relative (observed
differences are about 1e-6), and greedy decoding of a batch of prompts of different lengths
gives the same tokens for at least 32 new tokens while the engine chunks prefills and
preempts sequences.

| architecture | provider | features | tested against transformers |
| --- | --- | --- | --- |"""

FALLBACK_HEADER = """
## Through transformers

{features}.

Tested: {tested}. `pagoda check-model ARCH` runs the same conformance checks on any
architecture below (`--model-impl transformers` on a native one); an architecture not marked tested
is one transformers implements and the fallback accepts, not one pagoda's tests prove.

What it cannot run: classes whose attention does not go through transformers' attention
interface (`_supports_attention_backend`), layers that keep state outside the KV cache
(state-space, convolution or linear-attention layers of hybrid models), ALiBi, attention
sinks, encoder-decoder models and custom code (`auto_map`). Under tensor parallelism it splits
a model only by its `base_model_tp_plan` (the "tensor parallel" column, for the config class's defaults);
expert-parallel plans (MoE) run on one device. It is slower than a native class: transformers'
Python code runs every step and CUDA graphs are not captured for it.

| architecture | provider | transformers model type | tensor parallel | tested against transformers |
| --- | --- | --- | --- | --- |"""


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list supported model architectures (native and via transformers)")
    p.add_argument("--markdown", action="store_true", help="print the docs/models.md page")
    p.add_argument("--native", action="store_true", help="list only architectures with a native class")
    p.set_defaults(func=run)


def _describe(cls) -> tuple[str, str]:
    module_doc = (__import__(cls.__module__, fromlist=["x"]).__doc__ or "").strip()
    first = " ".join(module_doc.split("\n\n")[0].split()) if module_doc else ""
    features = getattr(cls, "FEATURES", None) or first or (cls.__doc__ or "").strip().split("\n")[0]
    return features, getattr(cls, "TESTED", "")


def architecture_rows() -> list[dict]:
    """The natively registered architectures."""
    from pagoda.plugins import get_registry
    from pagoda.registry import MODEL_FALLBACK, resolve_lazy

    reg = get_registry()
    rows = []
    for name in reg.models.names():
        if name == MODEL_FALLBACK:
            continue
        entry = reg.models.entries[name]
        try:
            features, tested = _describe(resolve_lazy(entry.obj))
        except Exception as exc:
            features, tested = f"(fails to import: {exc})", ""
        rows.append({"architecture": name, "provider": entry.provider, "features": features, "tested": tested})
    return sorted(rows, key=lambda r: (r["provider"], r["architecture"]))


def fallback_class():
    """(the class registered as ``"*"``, its provider), or (None, None)."""
    from pagoda.plugins import get_registry
    from pagoda.registry import MODEL_FALLBACK, resolve_lazy

    entry = get_registry().models.entries.get(MODEL_FALLBACK)
    return (None, None) if entry is None else (resolve_lazy(entry.obj), entry.provider)


def fallback_rows(native: set[str]) -> list[dict]:
    """Architectures without a native class that the fallback runs."""
    cls, provider = fallback_class()
    if cls is None or not hasattr(cls, "architectures"):
        return []
    tested = getattr(cls, "TESTED_ARCHITECTURES", {})
    return [dict(row, provider=f"{provider} (via transformers)", tested=tested.get(row["architecture"], ""))
            for row in cls.architectures() if row["architecture"] not in native]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def markdown(rows: list[dict], fallback: list[dict], with_fallback: bool = True) -> str:
    lines = [MARKDOWN_HEADER]
    lines += [_row([f"`{r['architecture']}`", r["provider"], r["features"], r["tested"]]) for r in rows]
    cls, _ = fallback_class()
    if cls is not None and with_fallback:
        lines.append(FALLBACK_HEADER.format(features=cls.FEATURES, tested=cls.TESTED))
        lines += [_row([f"`{r['architecture']}`", r["provider"], f"`{r['model_type']}`", r["tensor_parallel"],
                        r["tested"]]) for r in fallback]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    rows = architecture_rows()
    fallback = [] if args.native else fallback_rows({r["architecture"] for r in rows})
    if args.markdown:
        print(markdown(rows, fallback, not args.native), end="")
        return 0
    for r in rows:
        print(f"{r['architecture']:<34} {r['provider']:<14} {r['features']}")
    for r in fallback:
        tested = "tested" if r["tested"] else "untested"
        print(f"{r['architecture']:<34} via transformers ({r['model_type']}; tensor parallel: "
              f"{r['tensor_parallel']}; {tested})")
    return 0
