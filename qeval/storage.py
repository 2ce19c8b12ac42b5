"""Run storage at an fsspec URL (``s3://``, ``gs://``, ``az://``, ``file://``, ...).

A recipe's ``storage`` is either a path every node mounts (results and the artifact cache
simply live there) or an fsspec URL. With a URL nothing is assumed shared: every machine
works in a local staging folder and copies through the store, whose layout mirrors the
mounted one::

    <url>/results/<recipe name>/<UTC timestamp>/   the run folder (run.json, stages/, tiers/,
                                                    reference/, logs/, table.md, report.html)
    <url>/cache/artifacts/<method>-<key>/           prepared models; manifest.json last
    <url>/cache/sources/<sha256[:16]>/              the source checkpoint; source.json last

Object stores have no atomic rename, so a folder is complete only when its marker file
(written last) exists; readers ignore folders without one. Within a run every file has
one writer (the driver for run-wide stages and outputs, one tier task for its tier's
files), so no two machines write the same key.

Library checked: fsspec does the transport (``url_to_fs``, ``put_file``, ``get_file``,
``find``); its ``put``/``get`` with ``recursive=True`` were not used because their
trailing-slash rules differ between implementations. Credentials come from each node's
usual chain (environment, instance role) or the recipe's ``storage_options``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

from .bounded import safe_join
from .errors import QevalInputError
from .hashing import checkpoint_sha256
from .paths import cache_root
from .results import RUN_SCOPE, RunLayout, read_stage, write_stage


def is_url(storage: str | None) -> bool:
    """True when ``storage`` is an fsspec URL (has ``://``) rather than a mounted path."""
    return bool(storage) and "://" in str(storage)


def check_protocol(url: str) -> None:
    """Check (offline) that fsspec knows the URL's protocol and its package is installed.

    Raises:
        QevalInputError: unknown protocol, or the implementation (s3fs, gcsfs, adlfs) is missing.
    """
    import fsspec  # start-up time: only storage URLs need fsspec
    protocol, _, rest = url.partition("://")
    if not rest.strip("/"):
        raise QevalInputError(f"{url}: give a bucket or folder after {protocol}:// (e.g. {protocol}://my-bucket/qeval)",
                              field="storage")
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        raise QevalInputError(f"{url}: {str(e).splitlines()[0]} (pip install 'qeval[storage]' "
                              f"installs s3fs)", field="storage") from None
    except ValueError:
        raise QevalInputError(f"{url}: fsspec does not know the protocol {protocol!r}",
                              field="storage") from None


class RemoteStorage:
    """A folder at an fsspec URL, addressed by ``/``-separated relative paths.

    Args:
        url: e.g. ``s3://bucket/qeval``.
        options: keyword arguments for the fsspec filesystem (``endpoint_url``, ``profile``,
            ``key``/``secret``, ``client_kwargs`` ...), the recipe's ``storage_options``.

    Raises:
        QevalInputError: unknown protocol or missing implementation package.
    """

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        import fsspec  # start-up time: only storage URLs need fsspec
        check_protocol(url)
        self.url = url.rstrip("/")
        self.options = dict(options or {})
        self.fs, root = fsspec.core.url_to_fs(self.url, **self.options)
        self.root = root.rstrip("/")

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel.strip('/')}" if rel.strip("/") else self.root

    def url_of(self, rel: str) -> str:
        """The full URL of ``rel``."""
        return f"{self.url}/{rel.strip('/')}"

    def probe(self) -> None:
        """Write, read back and delete a small file: the store is reachable and writable.

        Raises:
            QevalInputError: naming the URL and the error (credentials, missing bucket, network).
        """
        rel = f".qeval-probe-{os.getpid()}"
        try:
            self.fs.pipe_file(self._p(rel), b"ok")
            got = self.fs.cat_file(self._p(rel))
            self.fs.rm_file(self._p(rel))
        except Exception as e:  # credentials, missing bucket, network: the user's setup
            raise QevalInputError(f"{self.url} is not writable: {e.__class__.__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}", field="storage") from None
        if got != b"ok":
            raise QevalInputError(f"{self.url}: a probe file read back wrong", field="storage")

    def exists(self, rel: str) -> bool:
        """Whether the file ``rel`` exists (listing caches are dropped first)."""
        self.fs.invalidate_cache()
        return bool(self.fs.exists(self._p(rel)))

    def read_json(self, rel: str) -> Any:
        """Parse the JSON file ``rel``. Raises FileNotFoundError when absent."""
        return json.loads(self.read_bytes(rel))

    def read_bytes(self, rel: str) -> bytes:
        """The bytes of file ``rel`` (listing caches dropped first). Raises FileNotFoundError."""
        self.fs.invalidate_cache()
        return self.fs.cat_file(self._p(rel))

    def write_json(self, rel: str, obj: Any) -> None:
        """Write ``obj`` as JSON to ``rel`` (one PUT: readers see the old or the new file)."""
        self.fs.pipe_file(self._p(rel), json.dumps(obj, indent=1, default=str).encode())

    def upload_file(self, local: str | Path, rel: str) -> None:
        """Copy one local file to ``rel``."""
        self.fs.put_file(str(local), self._p(rel))

    def list(self, rel: str) -> list[str]:
        """Relative paths (below ``rel``) of every file under ``rel``; empty when absent."""
        self.fs.invalidate_cache()
        base = self._p(rel)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        out = []
        for f in found:
            f = f.rstrip("/")
            if f.startswith(base + "/"):
                out.append(f[len(base) + 1:])
        return sorted(out)

    def upload_dir(self, local: str | Path, rel: str, marker: str | None = None,
                   include: Callable[[str], bool] = lambda r: True,
                   seen: dict[str, tuple[int, int]] | None = None) -> int:
        """Copy every file under ``local`` (relative path passing ``include``) to ``rel``;
        ``marker`` (a relative path) is copied last, so its presence means complete.
        ``seen`` (``{relative path: (size, mtime_ns)}``, updated) skips files unchanged since
        an earlier call. Returns the number of files copied."""
        local = Path(local)
        files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        files = [f for f in files if include(f) and ".tmp" not in f]
        ordered = [f for f in files if f != marker] + ([marker] if marker in files else [])
        n = 0
        for f in ordered:
            st = (local / f).stat()
            stamp = (st.st_size, st.st_mtime_ns)
            if seen is not None and seen.get(f) == stamp:
                continue
            self.upload_file(local / f, f"{rel}/{f}")
            n += 1
            if seen is not None:
                seen[f] = stamp
        return n

    def download_dir(self, rel: str, local: str | Path,
                     include: Callable[[str], bool] = lambda r: True) -> int:
        """Copy every file under ``rel`` (relative path passing ``include``) into ``local``,
        each through a temporary name and ``os.replace``. Returns the number copied.

        Raises:
            QevalInputError: a stored name that would land outside ``local`` (``../``).
        """
        local = Path(local)
        n = 0
        for f in self.list(rel):
            if not include(f):
                continue
            dst = safe_join(local, *[part for part in f.split("/") if part], what="stored file name",
                            file=self.url_of(f"{rel}/{f}"))  # a key with '..' never writes outside
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + f".part{os.getpid()}")
            self.fs.get_file(self._p(f"{rel}/{f}"), str(tmp))
            os.replace(tmp, dst)
            n += 1
        return n


_SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential", "sas", "signature", "auth")


def redact_options(options: Any) -> Any:
    """A copy of ``storage_options`` fit to store: values under secret-looking keys
    (key, secret, token, password, credential, sas, auth ...; nested dicts too) become
    ``"***"``. Endpoint, region and profile names are kept: they say where results went."""
    if isinstance(options, dict):
        return {k: ("***" if any(w in str(k).lower() for w in _SECRET_WORDS) and not isinstance(v, dict)
                    else redact_options(v)) for k, v in options.items()}
    if isinstance(options, list):
        return [redact_options(v) for v in options]
    return options


OPTIONS_ENV = "QEVAL_STORAGE_OPTIONS"  # the real options, for stage processes (run.json holds a redacted copy)


def storage_for(recipe) -> RemoteStorage | None:
    """The recipe's :class:`RemoteStorage`, or None when ``storage`` is unset or a mounted path."""
    if not is_url(recipe.storage):
        return None
    return RemoteStorage(recipe.storage, recipe.storage_options)


# ---- the run folder ---------------------------------------------------------------------

def run_rel(run_dir: Path) -> str:
    """The run folder's place in the store: ``results/<recipe name>/<timestamp>``."""
    run_dir = Path(run_dir)
    return f"results/{run_dir.parent.name}/{run_dir.name}"


# ---- artifacts and sources --------------------------------------------------------------

def fetch_artifact(remote: RemoteStorage, name: str, folder: Path) -> bool:
    """Download artifact ``name`` (``<method>-<key>``) into ``folder`` when the store holds a
    complete one (its manifest exists). Returns whether it did; the caller verifies hashes."""
    rel = f"cache/artifacts/{name}"
    if not remote.exists(f"{rel}/manifest.json"):
        return False
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    remote.download_dir(rel, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return True


def publish_artifact(remote: RemoteStorage, name: str, folder: Path, replace: bool = False) -> bool:
    """Upload a verified local artifact unless the store already has it (``replace``: its
    copy there is unusable), manifest last. Returns whether it uploaded."""
    rel = f"cache/artifacts/{name}"
    if remote.exists(f"{rel}/manifest.json"):
        if not replace:
            return False
        remote.fs.rm_file(remote._p(f"{rel}/manifest.json"))  # incomplete until re-uploaded
    remote.upload_dir(folder, rel, marker="manifest.json")
    return True


def _source_files(folder: Path) -> Iterable[str]:
    return [str(p.relative_to(folder)) for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".qeval")]


def publish_source(remote: RemoteStorage, folder: str | Path, sha256: str) -> str:
    """Upload the source checkpoint folder to ``cache/sources/<sha256[:16]>/`` unless present;
    ``source.json`` (sha256 and file list) goes last. Returns the relative path."""
    rel = f"cache/sources/{sha256[:16]}"
    if remote.exists(f"{rel}/source.json"):
        return rel
    folder = Path(folder)
    files = list(_source_files(folder))
    for f in files:
        remote.upload_file(folder / f, f"{rel}/{f}")
    remote.write_json(f"{rel}/source.json", {"sha256": sha256, "files": files})
    return rel


def fetch_source(remote: RemoteStorage, sha256: str, cache: Path) -> Path:
    """The source checkpoint of ``sha256`` as a local folder under ``cache/sources/``:
    reused when already downloaded and its hash matches, else downloaded and checked.

    Raises:
        RuntimeError: the store lacks it, or the downloaded files hash differently.
    """
    rel = f"cache/sources/{sha256[:16]}"
    out = cache / "sources" / f"remote-{sha256[:16]}"
    if (out / "config.json").is_file() and checkpoint_sha256(out) == sha256:
        return out
    if not remote.exists(f"{rel}/source.json"):
        raise RuntimeError(f"the source checkpoint {sha256[:16]} is not in {remote.url_of(rel)}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    remote.download_dir(rel, tmp, include=lambda f: f != "source.json")
    got = checkpoint_sha256(tmp)
    if got != sha256:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"source checkpoint from {remote.url_of(rel)} hashes to {got[:16]}, not {sha256[:16]}")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def localize_source(remote: RemoteStorage, run_dir: Path) -> Path:
    """Point a copied run folder's source stage (``stages/_run.source.json``) at a checkpoint
    on this machine: the recorded path when it exists here with the same hash, else the
    store's copy (:func:`fetch_source`). Returns the local checkpoint folder.

    Raises:
        RuntimeError: the store lacks the checkpoint or it hashes differently.
    """
    layout = RunLayout(run_dir)
    src = read_stage(layout, RUN_SCOPE, "source")
    here = Path(src.path)
    if (here / "config.json").is_file() and checkpoint_sha256(here) == src.sha256:
        return here
    local = fetch_source(remote, src.sha256, cache_root())
    src.path = str(local)
    write_stage(layout, RUN_SCOPE, "source", src)
    return local
