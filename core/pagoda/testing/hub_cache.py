"""A Hugging Face cache folder in the hub's own layout, for tests that load repo ids offline.

    <cache>/models--ORG--NAME/blobs/<sha256 of the file>        the bytes (or a link to a file)
                             /snapshots/<commit>/<path>          relative links to the blobs
                             /refs/<branch or tag>               the commit it points at

which is what ``huggingface_hub.snapshot_download`` writes and reads.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def repo_folder(cache_dir: str | Path, repo_id: str) -> Path:
    return Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def add_to_hub_cache(cache_dir: str | Path, repo_id: str, files: dict[str, str | Path | bytes],
                     revision: str = "main", commit: str | None = None, link: bool = False) -> Path:
    """Put ``files`` (repo path -> a local file or bytes) into the cache as commit ``commit`` (default:
    a hash of the contents) and point ``refs/<revision>`` at it. ``link``: blobs link to local files
    instead of copying them (large files). Returns the snapshot folder."""
    repo = repo_folder(cache_dir, repo_id)
    digests = {}
    for name, content in sorted(files.items()):
        data = content if isinstance(content, bytes) else None
        digest = hashlib.sha256(data if data is not None else _file_digest_key(Path(content))).hexdigest()
        digests[name] = digest
        blob = repo / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        if blob.exists() or blob.is_symlink():
            continue
        if data is not None:
            blob.write_bytes(data)
        elif link:
            blob.symlink_to(Path(content).resolve())
        else:
            shutil.copyfile(content, blob)
    commit = commit or hashlib.sha1("".join(f"{n}:{d}" for n, d in sorted(digests.items())).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, digest in digests.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.symlink_to(os.path.relpath(repo / "blobs" / digest, target.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def add_directory_to_hub_cache(cache_dir: str | Path, repo_id: str, directory: str | Path, revision: str = "main",
                               commit: str | None = None) -> Path:
    """Every file of ``directory`` (e.g. a ``save_pretrained`` output) as one commit of ``repo_id``."""
    directory = Path(directory)
    files = {str(p.relative_to(directory)): p for p in sorted(directory.rglob("*")) if p.is_file()}
    return add_to_hub_cache(cache_dir, repo_id, files, revision, commit)


def _file_digest_key(path: Path) -> bytes:
    """Contents of small files; path, size and mtime of large ones (cheap, unique enough for tests)."""
    stat = path.stat()
    if stat.st_size <= (64 << 20):
        return path.read_bytes()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
