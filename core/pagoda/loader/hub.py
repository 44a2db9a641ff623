"""Hub repo ids (``ORG/NAME``, ``ORG/NAME:FILE.gguf``, ``ORG/NAME:Q4_K_M``) to local folders, through
huggingface_hub.

Online, the repo's file list decides what to fetch: the config, tokenizer and generation files
at the repo's root and its safetensors weights (the shards its index names, else the root
``*.safetensors``; never ``.bin``/``.pt`` pickles), or one GGUF file; ``snapshot_download``
fetches them into the Hugging Face cache (``download_dir`` or ``HF_HUB_CACHE``/``HF_HOME``)
with a progress bar and returns the snapshot folder. Offline (``HF_HUB_OFFLINE=1``) or when the
Hub cannot be reached, the cached snapshot of the revision is used. ``HF_TOKEN`` opens gated and
private repos. Under tensor parallelism one process per machine downloads
(``pagoda.loader.hub_wait``); the others wait for it and use its folder.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pagoda.errors import ModelLoadError

logger = logging.getLogger("pagoda")

# Root files besides the weights: the model's config, its tokenizer in every format transformers
# reads, the generation config and chat templates.
METADATA_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "*.tiktoken", "vocab.json",
                     "vocab.txt", "merges.txt", "spiece.model", "chat_template.json", "chat_template.jinja",
                     "preprocessor_config.json", "quantization_config.json")
TOKENIZER_PATTERNS = tuple(p for p in METADATA_PATTERNS if p not in ("generation_config.json",
                                                                    "quantization_config.json"))
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")


@dataclass(frozen=True)
class HubReference:
    repo_id: str
    gguf: str | None = None  # a .gguf file name or a quantization tag (e.g. Q4_K_M); None: safetensors

    def __str__(self) -> str:
        return self.repo_id + (f":{self.gguf}" if self.gguf else "")


def parse_hub_reference(model: str) -> HubReference | None:
    """``ORG/NAME`` or ``ORG/NAME:FILE.gguf`` / ``ORG/NAME:TAG``; None when ``model`` is not one (local
    paths are checked first by the caller)."""
    if model.startswith((".", "/", "~")) or "\\" in model:
        return None
    repo, _, gguf = model.partition(":")
    if not _REPO_ID.fullmatch(repo) or ".." in repo or repo.endswith((".", "-")):
        return None
    if ":" in gguf or "/" in gguf:
        return None
    return HubReference(repo, gguf or None)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now, not when huggingface_hub was imported."""
    from huggingface_hub import constants

    raw = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if raw is None:
        return bool(constants.HF_HUB_OFFLINE)
    return raw.strip().lower() in ("1", "true", "yes", "on")


def download(ref: HubReference, revision: str | None = None, cache_dir: str | None = None,
             tokenizer_only: bool = False) -> Path:
    """The local folder (safetensors) or file (GGUF) of ``ref``, downloaded if needed."""
    from pagoda.loader.hub_wait import once_per_machine

    return once_per_machine(f"{ref}@{revision}@{cache_dir}@{tokenizer_only}",
                            lambda: _download(ref, revision, cache_dir, tokenizer_only))


def _download(ref: HubReference, revision: str | None, cache_dir: str | None, tokenizer_only: bool) -> Path:
    from huggingface_hub import snapshot_download

    where = f"{ref}" + (f" (revision {revision})" if revision else "")
    files = None if offline() else _list_files(ref, revision, where)
    if files is None:
        folder = _cached_snapshot(ref, revision, cache_dir, where)
        local = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink())
        chosen = choose_files(ref, local, where, tokenizer_only, folder)
        return _result(ref, folder, chosen, where)
    chosen = choose_files(ref, files, where, tokenizer_only, None, lambda: _fetch_index(ref, revision, cache_dir))
    logger.info("fetching %s from the Hugging Face Hub: %s", where, ", ".join(chosen))
    try:
        folder = Path(snapshot_download(ref.repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=chosen))
    except Exception as exc:
        raise _explain(exc, where) from exc
    return _result(ref, folder, chosen, where)


def _result(ref: HubReference, folder: Path, chosen: list[str], where: str) -> Path:
    missing = [f for f in chosen if not (folder / f).exists()]
    if missing:
        raise ModelLoadError(f"{where}: the cached snapshot {folder} lacks {', '.join(missing)}; download it again "
                             f"online (HF_HUB_OFFLINE=0)")
    return folder / chosen[0] if ref.gguf else folder


def _list_files(ref: HubReference, revision: str | None, where: str) -> list[str] | None:
    """The repo's files, or None when the Hub cannot be reached (then the cache decides)."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        return HfApi().list_repo_files(ref.repo_id, revision=revision)
    except (httpx.ConnectError, httpx.TimeoutException, OfflineModeIsEnabled) as exc:
        logger.warning("the Hugging Face Hub cannot be reached (%s): looking for %s in the local cache", exc, where)
        return None
    except Exception as exc:
        raise _explain(exc, where) from exc


def _cached_snapshot(ref: HubReference, revision: str | None, cache_dir: str | None, where: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref.repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except Exception as exc:
        from huggingface_hub import constants

        cache = cache_dir or constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE is set" if offline() else "it cannot be reached"
        raise ModelLoadError(f"{where} is not in the local Hugging Face cache ({cache}) and the Hub cannot be used "
                             f"({why}): download it once online, or point --download-dir at a cache that holds it "
                             f"({type(exc).__name__})") from exc


def _fetch_index(ref: HubReference, revision: str | None, cache_dir: str | None) -> dict:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(ref.repo_id, INDEX, revision=revision, cache_dir=cache_dir)
    return json.loads(Path(path).read_text())


def choose_files(ref: HubReference, files: list[str], where: str, tokenizer_only: bool = False,
                 folder: Path | None = None, fetch_index=None) -> list[str]:
    """What to download (or what must be cached) of a repo holding ``files``. GGUF: the one file.
    Safetensors: the metadata at the root, then the weights (the index's shards, else the root
    ``*.safetensors``); the first entry is what the caller opens."""
    root = [f for f in files if "/" not in f]
    if ref.gguf:
        return [pick_gguf(ref, files, where)]
    patterns = TOKENIZER_PATTERNS if tokenizer_only else METADATA_PATTERNS
    metadata = [f for f in root if any(fnmatch.fnmatch(f, p) for p in patterns)]
    if tokenizer_only:
        if not metadata:
            raise ModelLoadError(f"{where} has no tokenizer files ({', '.join(TOKENIZER_PATTERNS[:4])}, ...)")
        return metadata
    if "config.json" not in root:
        ggufs = [f for f in files if f.endswith(".gguf")]
        hint = f"; it holds GGUF files: load one as {ref.repo_id}:FILE.gguf ({', '.join(ggufs[:4])})" if ggufs else ""
        raise ModelLoadError(f"{where} has no config.json at its root{hint}")
    weights = _weight_files(root, files, folder, fetch_index)
    if not weights:
        pickles = [f for f in root if f.endswith(PICKLE_SUFFIXES)]
        ggufs = [f for f in files if f.endswith(".gguf")]
        if pickles:
            why = (f"only PyTorch pickle weights ({', '.join(pickles[:3])}), which pagoda never loads (unpickling runs "
                   f"code); use a safetensors copy of the model")
        elif ggufs:
            why = f"no safetensors weights but GGUF files: load one as {ref.repo_id}:FILE.gguf ({', '.join(ggufs[:4])})"
        else:
            why = "no *.safetensors weights"
        raise ModelLoadError(f"{where} has {why}")
    return ["config.json"] + [f for f in metadata if f != "config.json"] + weights


def _weight_files(root: list[str], files: list[str], folder: Path | None, fetch_index) -> list[str]:
    if INDEX in root:
        if folder is not None:
            index = json.loads((folder / INDEX).read_text())
        else:
            index = fetch_index()
        shards = sorted(set(index.get("weight_map", {}).values()))
        return [INDEX] + shards
    weights = [f for f in root if f.endswith(".safetensors")]
    preferred = [f for f in weights if f.startswith("model")]  # not a second copy such as consolidated.safetensors
    return preferred or weights


def pick_gguf(ref: HubReference, files: list[str], where: str) -> str:
    """``ref.gguf`` is a file of the repo, or a quantization tag naming exactly one GGUF file."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if ref.gguf in files:
        return ref.gguf
    if ref.gguf.endswith(".gguf"):
        raise ModelLoadError(f"{where}: the repo has no file {ref.gguf} (GGUF files: {', '.join(ggufs) or 'none'})")
    tag = ref.gguf.lower()
    matches = [f for f in ggufs if re.search(rf"(^|[-._/]){re.escape(tag)}([-._]|$)", f.lower())]
    matches = [f for f in matches if not re.search(r"-0000[2-9]-of-|-000[1-9]\d-of-", f)]  # first split only
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ModelLoadError(f"{where}: no GGUF file matches the quantization tag {ref.gguf!r} (GGUF files: "
                             f"{', '.join(ggufs) or 'none'})")
    raise ModelLoadError(f"{where}: several GGUF files match {ref.gguf!r} ({', '.join(matches)}); name one as "
                         f"{ref.repo_id}:FILE.gguf")


def _explain(exc: Exception, where: str) -> ModelLoadError:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return ModelLoadError(f"{where} is gated: accept its terms on huggingface.co with your account and set "
                              f"HF_TOKEN to a token of that account")
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(f"{where}: the repo has no such revision (branch, tag or commit)")
    if isinstance(exc, RepositoryNotFoundError):
        token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set"
        return ModelLoadError(f"{where}: no local folder of that name exists and the Hugging Face Hub has no such "
                              f"repo, or it is private ({token})")
    if isinstance(exc, LocalEntryNotFoundError):
        return ModelLoadError(f"{where}: the Hub cannot be reached and the files are not cached: {exc}")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, HfHubHTTPError) and status in (401, 403):
        return ModelLoadError(f"{where}: the Hub refused access (HTTP {status}); set HF_TOKEN to a token that may read "
                              f"the repo")
    return ModelLoadError(f"{where}: downloading from the Hugging Face Hub failed: {type(exc).__name__}: {exc}")
