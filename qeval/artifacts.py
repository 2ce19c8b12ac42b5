"""Artifact cache: each tier's prepared model (quantized checkpoint, GGUF file), built once.

An artifact lives in ``$QEVAL_CACHE/artifacts/<method>-<key>/`` with a ``manifest.json``:
source checkpoint hash, method, parameters, library versions and the SHA-256 of every
file. The key is a hash of those inputs, so a change in any of them builds a new
artifact. Before reuse the files are checked against the manifest; a corrupt or partial
artifact is rebuilt (and the run says so).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from .results import atomic_write_json
from .hashing import file_sha256
from .paths import artifacts_dir
from .storage import fetch_artifact, publish_artifact


def artifact_key(fields: dict) -> str:
    """First 16 hex digits of SHA-256 over the canonical JSON of ``fields``."""
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def artifact_dir(method: str, key: str) -> Path:
    """Folder of the artifact ``method``/``key`` under the cache root."""
    return artifacts_dir() / f"{method}-{key}"


def hash_files(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` for every file under ``folder`` except the manifest."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            out[str(p.relative_to(folder))] = file_sha256(p)
    return out


def verify(folder: Path) -> tuple[bool, str]:
    """Check an artifact against its manifest: ``(ok, reason)``."""
    mf = folder / "manifest.json"
    if not mf.is_file():
        return False, "no manifest (partial artifact)"
    try:
        manifest = json.loads(mf.read_text())
    except ValueError:
        return False, "manifest is not valid JSON"
    files = manifest.get("files") or {}
    if not files:
        return False, "manifest lists no files"
    for rel, sha in files.items():
        p = folder / rel
        if not p.is_file():
            return False, f"missing file {rel}"
        if file_sha256(p) != sha:
            return False, f"hash mismatch in {rel}"
    return True, "ok"


def get_or_build(method: str, fields: dict, build: Callable[[Path], dict],
                 log: Callable[[str], None] = print, remote: Any = None,
                 fresh: bool = False) -> tuple[Path, dict, bool]:
    """Return ``(folder, manifest, reused)`` for the artifact of ``fields``, building it with
    ``build(tmp_folder) -> info`` when absent or corrupt. The build writes into a temporary
    sibling folder renamed into place only after the manifest is written.

    With ``remote`` (a :class:`qeval.storage.RemoteStorage`), an artifact missing here is
    first fetched from the store (and verified like a local one); a built or local one is
    uploaded when the store lacks it, so other nodes and later runs reuse it.

    ``fresh``: build anew even when a verified copy exists (``qeval run --fresh``); the new
    build replaces it, here and in the store."""
    key = artifact_key(fields)
    folder = artifact_dir(method, key)
    _remove_dead_staging(folder, log)
    if fresh:
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return _build(folder, tmp, key, fields, build, remote, log, replace=True)

    def reuse(where: str) -> dict | None:
        """The manifest when ``folder`` holds a verified artifact; else remove it (None)."""
        if not folder.exists():
            return None
        ok, why = verify(folder)
        if ok:
            return json.loads((folder / "manifest.json").read_text())
        log(f"artifact {folder.name}{where} is unusable ({why}): rebuilding")
        shutil.rmtree(folder, ignore_errors=True)
        return None

    manifest = reuse("")
    remote_bad = False
    if manifest is None and remote is not None:
        try:
            fetched = _fetch(remote, folder)
        except Exception as e:  # a broken store copy is rebuilt like a broken local one
            log(f"artifact {folder.name}: fetching from {remote.url} failed ({e.__class__.__name__}: {e})")
            fetched = False
        if fetched:
            log(f"artifact {folder.name} fetched from {remote.url}")
            manifest = reuse(" from the store")
            remote_bad = manifest is None
    if manifest is not None:
        _publish(remote, folder, log)
        return folder, manifest, True
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return _build(folder, tmp, key, fields, build, remote, log, replace=remote_bad)


def _remove_dead_staging(folder: Path, log: Callable[[str], None]) -> None:
    """Remove the staging folders ``<folder>.tmp<pid>`` of builds or fetches whose process
    no longer runs (killed before its rename: SIGKILL, the OOM killer, a power cut run no
    clean-up). A folder is left alone while its pid is a live process that started before
    the folder's last change (another run building the same artifact now; 2 s of slack for
    the coarse process start times); a pid gone, a zombie, or reused by a process started
    after the folder was last written is a build that was stopped."""
    import psutil  # start-up time: only stages that prepare an artifact need it
    for tmp in folder.parent.glob(folder.name + ".tmp*"):
        pid = tmp.name[len(folder.name) + 4:]
        if not pid.isdigit() or not tmp.is_dir():
            continue
        try:
            proc = psutil.Process(int(pid))
            if proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= tmp.stat().st_mtime + 2.0:
                continue  # its builder still runs
        except psutil.NoSuchProcess:
            pass
        except (psutil.Error, OSError, OverflowError):
            continue  # cannot tell (another user's process): not ours to remove
        log(f"artifact {folder.name}: removing the staging folder of a build that was stopped ({tmp.name})")
        shutil.rmtree(tmp, ignore_errors=True)


def _build(folder: Path, tmp: Path, key: str, fields: dict, build: Callable[[Path], dict], remote: Any,
           log: Callable[[str], None], replace: bool) -> tuple[Path, dict, bool]:
    """Build into ``tmp``, write the manifest, rename over ``folder``; publish to the store."""
    try:
        t0 = time.time()
        info = build(tmp)
        manifest: dict[str, Any] = {"key": key, **fields, "info": info,
                                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "build_seconds": time.time() - t0, "files": hash_files(tmp)}
        atomic_write_json(tmp / "manifest.json", manifest)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(remote, folder, log, replace=replace)
    return folder, manifest, False


def _fetch(remote: Any, folder: Path) -> bool:
    return fetch_artifact(remote, folder.name, folder)


def _publish(remote: Any, folder: Path, log: Callable[[str], None], replace: bool = False) -> None:
    """Upload a verified artifact to the store (when there is one and it lacks it, or its
    copy there was unusable)."""
    if remote is None:
        return
    if publish_artifact(remote, folder.name, folder, replace=replace):
        log(f"artifact {folder.name} uploaded to {remote.url}")
