"""Where stage outputs, specs and checkpoints lie: the local workdir, or shared storage by fsspec URL.

    execution:
      storage: s3://coevo-runs/team-a      # or a shared filesystem path; null: the workdir

MLflow's SQLite store and the embedded trajectory store stay in the local workdir (a shared store is a
Postgres catalog with its data under `<storage>/store/`: components/store/lake.py); every attempt folder,
spec, heartbeat and checkpoint goes to `<storage>/<experiment>/r<round>/<stage>/a<attempt>/`, where a job
on any worker reads and writes it.

Code works on local paths: a URL's local mirror is `local(url)`, a folder under the cache
(`COEVO_CACHE_DIR`, default `~/.cache/coevo/storage`) named after the URL. A job writes its attempt
into the mirror and `push`es it, the manifest last, so a manifest in storage means every part is
there. A reader `fetch`es what it reads into its own mirror. Published attempts are never overwritten,
so a mirror once fetched stays right; readers re-hash every part against the committed manifest anyway.

Credentials never enter a config, the store or MLflow: fsspec takes them from the environment
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL` for an S3-compatible endpoint, or a
profile), as the AWS SDKs do.

>>> join("s3://b/exp", "r1", "generate", "a1")
's3://b/exp/r1/generate/a1'
>>> normjoin("s3://b/exp/r1/generate/a1", "../a1.shard0/part-x.parquet")
's3://b/exp/r1/generate/a1.shard0/part-x.parquet'
>>> is_remote("/tmp/w"), is_remote("s3://b/w")
(False, True)
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"  # the marker a push writes last (as components.manifest.MANIFEST)


class StorageError(RuntimeError):
    """Shared storage refused the credentials the environment gave, or (`transient`) could not be reached."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def is_remote(uri: str | Path) -> bool:
    """A URL of a filesystem other than this machine's (`s3://…`, `gs://…`); plain and `file://` paths are local."""
    s = str(uri)
    return "://" in s and not s.startswith("file://")


def _split(uri: str) -> tuple[str, str]:
    scheme, rest = uri.split("://", 1)
    return scheme + "://", rest


def join(base: str | Path, *parts: str) -> str:
    if is_remote(base):
        return posixpath.join(str(base), *parts)
    return os.path.join(str(base).removeprefix("file://"), *parts)


def normjoin(base: str | Path, rel: str) -> str:
    """`base/rel` with `..` resolved: a sharded manifest lists its shards' parts beside its folder."""
    if is_remote(base):
        scheme, rest = _split(str(base))
        return scheme + posixpath.normpath(posixpath.join(rest, rel))
    return os.path.normpath(os.path.join(str(base).removeprefix("file://"), rel))


def cache_root() -> Path:
    return Path(os.environ.get("COEVO_CACHE_DIR") or Path.home() / ".cache" / "coevo" / "storage")


def local(uri: str | Path) -> Path:
    """Where `uri` lies on this machine: a local path as it is, a URL's mirror under `cache_root()`."""
    if not is_remote(uri):
        return Path(str(uri).removeprefix("file://"))
    scheme, rest = _split(str(uri))
    return cache_root() / scheme.removesuffix("://") / posixpath.normpath(rest).lstrip("/")


@lru_cache(maxsize=None)
def _fs(scheme: str) -> Any:
    import fsspec

    try:
        # No listing cache: another process (a worker) writes what this one looks for.
        return fsspec.filesystem(scheme.removesuffix("://"), use_listings_cache=False, skip_instance_cache=True)
    except (ImportError, ValueError) as e:
        raise StorageError(f"no filesystem for {scheme}: {e}") from None


def filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) of a URL."""
    scheme, rest = _split(uri)
    return _fs(scheme), rest


def _calling(uri: str, what: str, fn, *args):
    """Run one storage call; what the backend raises on missing or wrong credentials becomes a StorageError."""
    try:
        return fn(*args)
    except FileNotFoundError:
        raise
    except Exception as e:
        name = type(e).__name__
        if isinstance(e, PermissionError) or "Credential" in name or "AccessDenied" in str(e):
            raise StorageError(f"{what} {uri}: storage refused the credentials ({name}: {e}). They come from the "
                               "environment only: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                               "and AWS_ENDPOINT_URL for an S3-compatible endpoint") from None
        if isinstance(e, OSError) or "Endpoint" in name or "Connect" in name:
            raise StorageError(f"{what} {uri}: storage is unreachable ({name}: {e})", transient=True) from None
        raise


def exists(uri: str | Path) -> bool:
    if not is_remote(uri):
        return local(uri).exists()
    fs, path = filesystem(str(uri))
    return bool(_calling(str(uri), "looking for", fs.exists, path))


def read_text(uri: str | Path) -> str:
    if not is_remote(uri):
        return local(uri).read_text()
    fs, path = filesystem(str(uri))
    return _calling(str(uri), "reading", fs.cat_file, path).decode()


def write_text(uri: str | Path, text: str) -> None:
    """Write a small file whole: a reader sees the old content or the new, never a part."""
    if not is_remote(uri):
        p = local(uri)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, p)
        return
    fs, path = filesystem(str(uri))
    _calling(str(uri), "writing", fs.pipe_file, path, text.encode())  # one PUT: atomic in S3


def put_file(src: Path, uri: str) -> None:
    """Copy the local file `src` to `uri` (a new name: nothing reads it until the copy is whole), to disk."""
    if is_remote(uri):
        fs, path = filesystem(uri)
        _calling(uri, "writing", fs.put_file, str(src), path)
        return
    dest = local(uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    with open(dest, "rb+") as f:
        os.fsync(f.fileno())


def remove(uri: str) -> None:
    """Delete the file at `uri`, if it is there."""
    if is_remote(uri):
        fs, path = filesystem(uri)
        with contextlib.suppress(FileNotFoundError):
            _calling(uri, "removing", fs.rm_file, path)
        return
    local(uri).unlink(missing_ok=True)


def fetch(uri: str | Path) -> Path:
    """The local copy of a file or folder, downloaded into the mirror where it is not there yet."""
    dest = local(uri)
    if not is_remote(uri) or dest.exists():
        return dest
    fs, path = filesystem(str(uri))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.fetch-{uuid.uuid4().hex[:8]}")
    try:
        if _calling(str(uri), "reading", fs.isdir, path):
            for f in _calling(str(uri), "listing", fs.find, path):
                target = tmp / posixpath.relpath(f, path)
                target.parent.mkdir(parents=True, exist_ok=True)
                _calling(str(uri), "reading", fs.get_file, f, str(target))
        else:
            _calling(str(uri), "reading", fs.get_file, path, str(tmp))
        try:
            os.replace(tmp, dest)  # two jobs of one machine may fetch the same checkpoint at once
        except OSError:
            if not dest.exists():
                raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
    return dest


def push(src: Path, uri: str) -> None:
    """Upload the folder `src` to `uri`, its manifest last: a manifest in storage means the rest is there."""
    if not is_remote(uri):
        return  # the job wrote there itself: a local path is its own mirror
    fs, path = filesystem(uri)
    files = sorted(p for p in Path(src).rglob("*") if p.is_file())
    for p in sorted(files, key=lambda p: p.name == MANIFEST):
        _calling(uri, "writing", fs.put_file, str(p), posixpath.join(path, p.relative_to(src).as_posix()))


def writable_mirror(uri: str) -> Path:
    """The mirror a job writes `uri`'s attempt into. A mirror whose manifest never reached storage is the
    leftover of a try that died while pushing: it is cleared, so the retry writes afresh."""
    dest = local(uri)
    if is_remote(uri) and dest.exists() and not exists(join(uri, MANIFEST)):
        shutil.rmtree(dest)
    return dest


def check(uri: str) -> None:
    """Fail early, naming the URL, where storage cannot be written with the environment's credentials:
    before a stage runs, so nothing is committed. Writes and removes one small object."""
    if not is_remote(uri):
        return
    fs, path = filesystem(join(uri, f".coevo-probe-{uuid.uuid4().hex[:8]}"))
    try:
        _calling(uri, "writing to", fs.pipe_file, path, b"ok")
    except FileNotFoundError as e:
        raise StorageError(f"writing to {uri}: no such bucket or folder ({e}); create it first") from None
    _calling(uri, "writing to", fs.rm_file, path)
