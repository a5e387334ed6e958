"""Where a run directory lives: a local folder or a prefix on an object store (s3://bucket/prefix, or any
URL that pyarrow.fs or fsspec knows), behind the few operations a run directory needs: write an object
whole, read one, list a prefix, test for one. See docs/run-directory.md, "Run directories on object
storage".

Writes are atomic on both: locally a temporary name renamed into place (readers globbing `*.parquet`
never see half a file); on an object store one PUT, which makes the object visible only when complete
(a writer killed mid-upload leaves nothing, not half an object).

S3 credentials come from the AWS SDK's standard chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
AWS_SESSION_TOKEN, AWS_PROFILE and ~/.aws, instance metadata). pyarrow's S3 client does not read
AWS_ENDPOINT_URL (checked with pyarrow 26): we pass AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, as its
endpoint_override, so MinIO, Ceph or a test server work with the variables other AWS tools read.

A trainer whose run directory is a URL keeps its own files (heartbeats, checkpoints) in a local scratch
folder and sets MEGASCOPE_RUN_URL / MEGASCOPE_RUN_SCRATCH for its ranks (`redirect_env`): the tracer
and the manifest functions, given that scratch folder, write to the URL instead.
"""

from __future__ import annotations

import functools
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
ENV_URL = "MEGASCOPE_RUN_URL"
ENV_SCRATCH = "MEGASCOPE_RUN_SCRATCH"
ENV_CACHE = "MEGASCOPE_CACHE_DIR"
TIMEOUT_S = 10.0
"""Connect/request timeout of the S3 client: an unreachable endpoint fails in seconds, not minutes."""


class StorageError(OSError):
    """The store cannot be used (missing bucket, credentials, endpoint); the message is one line."""


def is_url(spec: str | os.PathLike) -> bool:
    """True for an object-store URL (s3://...); a local path or a file:// URL is not one."""
    match = URL_RE.match(os.fspath(spec))
    return match is not None and match.group(1).lower() != "file"


def cache_root() -> Path:
    """$MEGASCOPE_CACHE_DIR, else $XDG_CACHE_HOME/megascope, else ~/.cache/megascope: local mirrors of
    remote runs (readers) and the trainer's scratch folder (writers)."""
    given = os.environ.get(ENV_CACHE)
    if given:
        return Path(given).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megascope"


def local_folder_for(url: str, kind: str) -> Path:
    """A stable local folder for `url` under the cache: cache/<kind>/<scheme>/<bucket>/<prefix>."""
    parsed = urllib.parse.urlparse(url)
    parts = [p for p in (parsed.netloc + "/" + parsed.path).split("/") if p not in ("", ".", "..")]
    return cache_root() / kind / parsed.scheme / Path(*parts) if parts else cache_root() / kind / parsed.scheme


@dataclass(frozen=True)
class Location:
    """A run directory: `root` inside filesystem `fs`; `display` is what the user gave."""

    fs: pafs.FileSystem
    root: str
    display: str
    remote: bool

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def write_bytes(self, rel: str, data: bytes | memoryview) -> None:
        """Write one whole object/file at `rel`, atomically (see the module doc)."""
        target = self.path(rel)
        if not self.remote:
            final = Path(target)
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)  # never leave a half file behind a failed write
                raise
            return
        try:
            # delayed open + no background writes: a small object is one PutObject sent at close(), so
            # a process killed before close() leaves no object at all
            out = self.fs.open_output_stream(target)
            out.write(data)
            out.close()
        except OSError as exc:
            raise self.error(exc) from None

    def read_bytes(self, rel: str) -> bytes:
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                return f.read()
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self.error(exc) from None

    def exists(self, rel: str = "") -> bool:
        try:
            return self.fs.get_file_info(self.path(rel)).type != pafs.FileType.NotFound
        except OSError as exc:
            raise self.error(exc) from None

    def list_files(self, rel: str = "") -> dict[str, int]:
        """Every file/object under `rel` (recursive): path relative to the root -> size in bytes.
        Hidden names (a leading '.', e.g. a local temporary file) are left out."""
        base = self.path(rel)
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except OSError as exc:
            raise self.error(exc) from None
        out: dict[str, int] = {}
        # compared without a leading '/': some fsspec filesystems (memory://) answer '/bucket/key'
        prefix = self.root.strip("/") + "/"
        for info in infos:
            path = info.path.lstrip("/")
            if info.type != pafs.FileType.File or not path.startswith(prefix):
                continue
            name = path[len(prefix):]
            if not any(part.startswith(".") for part in name.split("/")):
                out[name] = int(info.size or 0)
        return out

    def delete_all(self) -> None:
        """Remove every object under the root (simulate --force onto a URL)."""
        try:
            if self.exists():
                self.fs.delete_dir_contents(self.root, missing_dir_ok=True)
        except OSError as exc:
            raise self.error(exc) from None

    def check_reachable(self) -> None:
        """Raise StorageError when the bucket is missing or the store cannot be reached: a listing of a
        missing bucket is just empty, so a reader that finds no run.json asks this for the real reason."""
        if not self.remote:
            return
        bucket = self.root.split("/", 1)[0]
        try:
            info = self.fs.get_file_info(bucket)
        except OSError as exc:
            raise self.error(exc) from None
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"{self.display}: the bucket '{bucket}' does not exist (or these credentials "
                               "cannot see it); create it or check the URL")

    def error(self, exc: BaseException) -> StorageError:
        """One line that says what is wrong with the store, from pyarrow's multi-part AWS message."""
        text = str(exc)
        bucket = self.root.split("/", 1)[0]
        if "NO_SUCH_BUCKET" in text or ("Bucket" in text and "not found" in text):
            return StorageError(f"{self.display}: the bucket '{bucket}' does not exist; create it or check the URL")
        if any(k in text for k in ("ACCESS_DENIED", "INVALID_ACCESS_KEY", "SIGNATURE_DOES_NOT_MATCH", "Forbidden",
                                   "InvalidAccessKeyId", "AccessDenied", "EXPIRED_TOKEN", "credentials")):
            return StorageError(f"{self.display}: access denied by the object store; check AWS_ACCESS_KEY_ID / "
                                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's permissions")
        if any(k in text for k in ("NETWORK_CONNECTION", "curlCode", "Could not resolve", "connect to server")):
            where = endpoint() or "the default AWS endpoint"
            return StorageError(f"{self.display}: cannot reach the object store at {where}; "
                                "check AWS_ENDPOINT_URL and the network")
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        return StorageError(f"{self.display}: {first[:300]}")


def endpoint() -> str | None:
    """The S3 endpoint from the environment (AWS's own precedence: the service-specific one first)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def locate(run_dir: str | os.PathLike) -> Location:
    """The Location of a run directory given as a local path or a URL. The trainer's scratch folder
    (MEGASCOPE_RUN_SCRATCH) stands for its URL (MEGASCOPE_RUN_URL): see the module doc."""
    spec = os.fspath(run_dir)
    if is_url(spec):
        return _remote(spec, endpoint())
    url, scratch = os.environ.get(ENV_URL), os.environ.get(ENV_SCRATCH)
    if url and scratch and os.path.realpath(spec) == os.path.realpath(scratch):
        return _remote(url, endpoint())
    if spec.startswith("file://"):
        spec = urllib.parse.urlparse(spec).path
    return Location(pafs.LocalFileSystem(), os.path.abspath(spec), spec, remote=False)


@functools.lru_cache(maxsize=16)
def _remote(url: str, endpoint_url: str | None) -> Location:
    """One filesystem per URL and endpoint (an S3 client is costly to build; it is thread-safe)."""
    display = url.rstrip("/")
    parsed = urllib.parse.urlparse(display)
    scheme = parsed.scheme.lower()
    if not parsed.netloc:
        raise StorageError(f"{url}: no bucket in the URL; write it as {scheme}://BUCKET/PREFIX")
    root = (parsed.netloc + parsed.path).rstrip("/")
    try:
        if scheme in ("s3", "s3a"):
            options: dict = {}
            if endpoint_url:
                options["endpoint_override"] = endpoint_url
                options["scheme"] = urllib.parse.urlparse(endpoint_url).scheme or "https"
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if region:
                options["region"] = region
            fs: pafs.FileSystem = pafs.S3FileSystem(
                connect_timeout=TIMEOUT_S, request_timeout=TIMEOUT_S, allow_delayed_open=True,
                background_writes=False, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3),
                **options)
        else:
            fs = _other_filesystem(display, scheme)
    except StorageError:
        raise
    except (OSError, ValueError, ImportError) as exc:
        raise StorageError(f"{url}: cannot open this store ({str(exc).splitlines()[0][:200]})") from None
    return Location(fs, root, display, remote=True)


def _other_filesystem(url: str, scheme: str) -> pafs.FileSystem:
    """gs://, hdfs://, abfs:// ... through pyarrow when it knows the scheme, else through fsspec."""
    try:
        fs, _ = pafs.FileSystem.from_uri(url)
        return fs
    except (OSError, ValueError) as exc:
        if "Unrecognized filesystem type" not in str(exc) and "not supported" not in str(exc):
            raise
    try:
        import fsspec
    except ImportError:
        raise StorageError(f"{url}: pyarrow has no '{scheme}' filesystem and fsspec is not installed") from None
    try:
        return pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem(scheme)))
    except (ImportError, ValueError) as exc:
        raise StorageError(f"{url}: no filesystem for '{scheme}://' ({str(exc).splitlines()[0][:160]}); "
                           "install its fsspec package") from None


def redirect_env(url: str, scratch: str | Path) -> dict[str, str]:
    """The environment that makes `scratch` stand for `url` in this process and its children."""
    return {ENV_URL: url, ENV_SCRATCH: str(Path(scratch).resolve())}


def upload_tree(folder: str | Path, location: Location, entries: tuple[str, ...] | None = None,
                threads: int = 8) -> int:
    """Copy every file under local `folder` (or only its top-level `entries`) to `location`, run.json
    last, so a reader never finds a manifest whose data is not there yet; returns the files copied.
    Hidden names (temporaries) are skipped."""
    from concurrent.futures import ThreadPoolExecutor

    root = Path(folder)
    names = sorted(str(p.relative_to(root)).replace(os.sep, "/") for p in root.rglob("*") if p.is_file())
    names = [n for n in names if not any(part.startswith(".") for part in n.split("/"))
             and (entries is None or n.split("/", 1)[0] in entries)]
    first = [n for n in names if n != "run.json"]

    def put(name: str) -> None:
        location.write_bytes(name, (root / name).read_bytes())

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(put, first))  # re-raises the first failure
    if len(first) < len(names):
        put("run.json")
    return len(names)


def stage_for(url: str, overwrite: bool = False, hint: str = "pass a new prefix") -> Path:
    """A new local folder (not yet created) where `megascope simulate`/`import` write a run bound for
    `url`; `publish` uploads it. Raises StorageError when the store cannot be reached, or when the
    prefix already holds objects and not `overwrite` (then they are deleted: the old run goes)."""
    location = locate(url)
    location.check_reachable()
    if location.exists():
        if not overwrite:
            raise StorageError(f"{location.display} already holds objects (a run?); {hint}")
        location.delete_all()
    import uuid

    return local_folder_for(url, "staging") / f"{os.getpid()}-{uuid.uuid4().hex[:8]}" / "run"


def publish(folder: str | Path, url: str) -> int:
    """Upload a staged run to `url` (run.json last), then remove the local copy; returns objects written."""
    import shutil

    written = upload_tree(folder, locate(url))
    shutil.rmtree(Path(folder).parent, ignore_errors=True)
    return written
