"""Where checkpoints live: a local folder or any fsspec URL.

`Storage` is one location: a plain path (made absolute; its files are written atomically: a temp
file in the same folder, fsynced, renamed over the target) or a URL (`s3://`, `gs://`, `abfs://`,
`memory://`, `file://`, any protocol fsspec knows) with its `storage_options` (endpoint,
credentials: handed to fsspec as they are). It is small and picklable: the driver sends it to the
workers, and each worker builds its own filesystem client from it on first use and writes its
files straight to the location. What a checkpoint is on a location (its formats, and the rule that
it is complete or invisible) is `format`'s.

Credentials never leave `storage_options`: `repr`, `str`, log lines and error messages name the
URL only, and every error text taken from a client library is stripped of the values of
`storage_options` and of the credential variables of the environment first.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import pickle
import posixpath
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import IO, TYPE_CHECKING, Any, NoReturn, Optional, Union

from raysgd._internal.storage.atomic_files import (
    SCRATCH_PREFIX,
    atomic_local_file,
    atomic_local_folder,
    write_file,
)
from raysgd._internal.storage.errors import StorageError, failure_message

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["Storage", "StorageError", "as_storage", "is_scratch"]

logger = logging.getLogger("raysgd")

#: The extra of raysgd that installs the client library of a protocol fsspec does not bundle.
_EXTRAS = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
    "az": ("adlfs", "azure"),
}
_LOCAL_PROTOCOLS = ("file", "local")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)

PathLike = Union[str, "os.PathLike[str]"]


class Storage:
    """One location: a local folder or an fsspec URL, with the options of its filesystem.

    Args:
        location: a plain path (made absolute; it stays an ordinary local path) or a URL such as
            ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``abfs://container/prefix``,
            ``memory://prefix`` or ``file:///abs/path``.
        storage_options: keyword arguments of the fsspec filesystem (endpoint, credentials,
            client settings). Kept as given, sent to the workers with the location, never shown.

    Raises:
        ImportError: the URL's filesystem library is missing; the message names the raysgd extra
            that installs it (``pip install 'raysgd[s3]'``).
        ValueError: an unknown protocol, a URL without a bucket, or credentials inside the URL.
        TypeError: `storage_options` is not a dict of picklable values with str keys.

    Paths given to the methods are relative to the location, with "/" between names; "" is the
    location itself.
    """

    __slots__ = ("_fs", "_options", "_path", "_protocol")

    def __init__(
        self, location: PathLike, storage_options: Optional[Mapping[str, Any]] = None
    ) -> None:
        text = os.fspath(location)
        if not isinstance(text, str):
            raise TypeError(
                f"a storage location must be a str or a path, got {type(text).__name__}"
            )
        options = _copy_options(storage_options)
        if "::" in text.split("/", 1)[0]:
            raise ValueError("chained fsspec URLs (a::b) are not supported as a storage location")
        match = _URL.match(text)
        if match is None or match.group(1).lower() in _LOCAL_PROTOCOLS:
            # file:// is the local disk too: the same absolute path and the same atomic writes.
            local = text if match is None else _filesystem_class("file")._strip_protocol(text)
            protocol, path = "file", os.path.abspath(local)
        else:
            protocol = match.group(1).lower()
            path = _remote_path(protocol, text, match.group(2))
        self._protocol = protocol
        self._path = path
        self._options = options
        self._fs: Optional[AbstractFileSystem] = None

    @classmethod
    def _rebuilt(cls, protocol: str, path: str, options: dict[str, Any]) -> Storage:
        # The location was checked where it was built; a copy on a worker builds its client only
        # when first used (and says which extra is missing there, if that machine lacks it).
        storage = cls.__new__(cls)
        storage._protocol, storage._path, storage._options = protocol, path, options
        storage._fs = None
        return storage

    def __reduce__(self) -> tuple[Any, ...]:
        # Never the live client: it holds sockets, threads and an event loop.
        return (Storage._rebuilt, (self._protocol, self._path, self._options))

    def __repr__(self) -> str:
        if not self._options:
            return f"Storage({self.url!r})"
        # The option names help to tell two locations apart; their values may be credentials.
        return f"Storage({self.url!r}, storage_options=<{', '.join(sorted(self._options))}>)"

    def __str__(self) -> str:
        return self.url

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Storage):
            return NotImplemented
        return (self._protocol, self._path, self._options) == (
            other._protocol,
            other._path,
            other._options,
        )

    def __hash__(self) -> int:
        return hash((self._protocol, self._path))

    @property
    def protocol(self) -> str:
        """fsspec's protocol: "file" for a local path, else the URL's ("s3", "gs", "memory", ...)."""
        return self._protocol

    @property
    def path(self) -> str:
        """The location without its protocol (a local absolute path, "bucket/prefix", ...)."""
        return self._path

    @property
    def url(self) -> str:
        """The location as text: the absolute path for a local one, else "protocol://path"."""
        return self._path if self.is_local else f"{self._protocol}://{self._path}"

    @property
    def name(self) -> str:
        """The last name of the path (a checkpoint folder's name)."""
        if self.is_local:
            return os.path.basename(self._path)
        return posixpath.basename(self._path.rstrip("/"))

    @property
    def is_local(self) -> bool:
        """Whether this is the local disk (a plain path or file://)."""
        return self._protocol == "file"

    @property
    def storage_options(self) -> dict[str, Any]:
        """A copy of the options, to hand to another fsspec user (e.g. DCP's FsspecWriter).

        They may hold credentials: never log or print them.
        """
        return copy.deepcopy(self._options)

    @property
    def fs(self) -> AbstractFileSystem:
        """The fsspec filesystem, built on first use in this process."""
        if self._fs is None:
            import fsspec

            try:
                # A copy each time: some filesystems rewrite the options they are given (s3fs
                # changes config_kwargs), and ours must stay as the user gave them.
                self._fs = fsspec.filesystem(self._protocol, **copy.deepcopy(self._options))
            except ImportError:
                _raise_missing_library(self._protocol)
        return self._fs

    def join(self, *names: str) -> Storage:
        """The location `names` below this one, with the same options."""
        child = Storage._rebuilt(self._protocol, self._full("/".join(names)), self._options)
        child._fs = self._fs  # one client per location tree, not one per folder
        return child

    def exists(self, relpath: str = "") -> bool:
        """Whether a file or folder is at `relpath`."""
        path = self._full(relpath)
        with self._errors("cannot check", relpath):
            self.fs.invalidate_cache(path)
            return bool(self.fs.exists(path))

    def is_folder(self, relpath: str = "") -> bool:
        """Whether `relpath` is a folder (an object store's prefix with objects under it)."""
        path = self._full(relpath)
        with self._errors("cannot check", relpath):
            self.fs.invalidate_cache(path)
            return bool(self.fs.isdir(path))

    def parent(self) -> Storage:
        """The location one level up, with the same options."""
        up = self._parent(self._path)
        if up is None:
            raise ValueError(f"{self.url} has no parent location")
        parent = Storage._rebuilt(self._protocol, up, self._options)
        parent._fs = self._fs
        return parent

    def write_bytes(self, relpath: str, data: Union[bytes, memoryview]) -> None:
        """Write one file whole (`data` may be any contiguous buffer). A reader sees the old file
        or the new one, never a part: on the local disk through a temp file, fsync and rename; an
        object store's put is atomic."""
        if not relpath:
            raise ValueError("write_bytes needs a file name below the location")
        path = self._full(relpath)
        with self._errors("cannot write", relpath):
            if self.is_local:
                write_file(path, data)
            else:
                self.fs.pipe_file(path, bytes(data))

    def write_stream(self, relpath: str, write: Callable[[IO[bytes]], None]) -> None:
        """Write one file by handing `write` a binary file to stream into: a large part is never
        held in memory a second time as one bytes object (`write_bytes` needs it whole).

        On the local disk the file appears whole or not at all, as with `write_bytes`. Elsewhere
        the upload is committed when `write` returns (an object store shows the object only
        then); when `write` fails, the upload is discarded as far as the store allows (s3fs
        aborts its multipart upload), but a store that shows a file while it is being written
        (memory://) keeps what was written. Meant for a checkpoint folder's parts, which its
        manifest, written last, makes visible.
        """
        if not relpath:
            raise ValueError("write_stream needs a file name below the location")
        path = self._full(relpath)
        with self._errors("cannot write", relpath):
            if self.is_local:
                with atomic_local_file(path, direct=True) as handle:
                    write(handle)
                return
            handle = self.fs.open(path, "wb")
            try:
                write(handle)
            except BaseException:
                _discard(handle)
                raise
            handle.close()

    @contextmanager
    def replaced_folder(self) -> Iterator[Storage]:
        """A local folder to write into that replaces this one whole when the block ends without
        an error (`atomic_files.atomic_local_folder`); nothing changes here when it raises. An
        object store has no rename: there, a folder's writer makes it visible last instead (a
        checkpoint's manifest)."""
        if not self.is_local:
            raise ValueError(f"{self.url}: only a local folder is replaced whole")
        with atomic_local_folder(self.path) as tmp:
            yield as_storage(tmp)

    def read_bytes(self, relpath: str) -> bytes:
        """The whole content of the file at `relpath`."""
        path = self._full(relpath)
        with self._errors("cannot read", relpath):
            return bytes(self.fs.cat_file(path))

    def size(self, relpath: str) -> int:
        """The size of the file at `relpath` in bytes."""
        path = self._full(relpath)
        with self._errors("cannot read", relpath):
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

    def listdir(self, relpath: str = "") -> list[str]:
        """The names directly below `relpath`, files and folders, sorted.

        Raises:
            FileNotFoundError: nothing is there.
        """
        return sorted(name for name, _ in self.entries(relpath))

    def file_sizes(self, relpath: str = "") -> dict[str, int]:
        """Every file below `relpath`, at any depth: its path relative to `relpath` -> its size.

        Empty when nothing is there.
        """
        path = self._full(relpath)
        with self._errors("cannot list", relpath):
            self.fs.invalidate_cache(path)
            found = self.fs.find(path, detail=True)
        base = self._fs_path(path).rstrip("/")
        sizes = {}
        for name, info in found.items():
            if info.get("type") == "directory":
                continue
            rel = name[len(base) :].lstrip("/") if name.startswith(base) else name
            sizes[rel] = int(info.get("size") or 0)
        return sizes

    def remove(self, relpath: str = "") -> None:
        """Remove the file or the folder (with everything in it) at `relpath`; nothing there is
        not an error."""
        path = self._full(relpath)
        with self._errors("cannot remove", relpath):
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

    def check_access(self, *, write: bool = False) -> None:
        """Probe the location cheaply, so that bad credentials, an unreachable endpoint or a
        missing bucket fail here and not in the middle of training.

        Lists the location (or, when nothing is there yet, the nearest folder above it, up to
        the bucket); with `write`, also writes and removes a small probe file in it (which, on
        the local disk, creates the folder).

        Raises:
            StorageError: one line naming the URL and why (not found, access denied, endpoint
                unreachable, ...), never a credential.
        """
        with self._errors("cannot access"):
            path = self._path
            while True:
                try:
                    self.fs.invalidate_cache(path)
                    self.fs.ls(path, detail=False)
                    break
                except FileNotFoundError:
                    # Object stores have no folders: a prefix with nothing under it yet is fine
                    # as long as its bucket is there.
                    parent = self._parent(path)
                    if parent is None:
                        raise
                    path = parent
        if write:
            probe = f"{SCRATCH_PREFIX}access-{uuid.uuid4().hex}"
            self.write_bytes(probe, b"")
            self.remove(probe)

    # -- inside --

    def _full(self, relpath: str) -> str:
        if not relpath:
            return self._path
        names = relpath.split("/")
        if relpath.startswith("/") or any(n in ("", ".", "..") for n in names) or "\\" in relpath:
            raise ValueError(
                f"{relpath!r} is not a relative path below the location (names joined by '/', "
                "none of them empty, '.' or '..')"
            )
        if self.is_local:
            return os.path.join(self._path, *names)
        return f"{self._path.rstrip('/')}/{relpath}"

    def _fs_path(self, path: str) -> str:
        # The form in which the filesystem names its entries in listings.
        return str(self.fs._strip_protocol(path))

    def _parent(self, path: str) -> Optional[str]:
        parent = os.path.dirname(path) if self.is_local else posixpath.dirname(path.rstrip("/"))
        if not parent or parent == path or (not self.is_local and parent == "/"):
            return None
        return parent

    def entries(self, relpath: str = "") -> list[tuple[str, bool]]:
        """(name, is a folder) of what is directly below `relpath`.

        Raises:
            FileNotFoundError: nothing is there.
        """
        path = self._full(relpath)
        with self._errors("cannot list", relpath):
            self.fs.invalidate_cache(path)
            entries = self.fs.ls(path, detail=True)
        base = self._fs_path(path).rstrip("/")
        out = []
        for info in entries:
            name = str(info["name"]).rstrip("/")
            if name == base:  # a file lists itself
                continue
            out.append((posixpath.basename(name), info.get("type") == "directory"))
        return out

    def display(self, relpath: str = "") -> str:
        """How `relpath` below this location is named in messages: a local path, else its URL."""
        if not relpath:
            return self.url
        return self._full(relpath) if self.is_local else f"{self.url.rstrip('/')}/{relpath}"

    @contextmanager
    def _errors(self, action: str, relpath: str = "") -> Iterator[None]:
        """Re-raise a failure with a message of our own: "not there" as FileNotFoundError (what
        local code expects), anything else as one-line StorageError; never a credential."""
        try:
            yield
        except (StorageError, ImportError):
            raise
        except FileNotFoundError as exc:
            where = self.display(relpath)
            if action == "cannot access":
                raise StorageError(self._message(action, where, exc)) from None
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), where) from None
        except Exception as exc:
            raise StorageError(self._message(action, self.display(relpath), exc)) from None

    def _message(self, action: str, where: str, exc: BaseException) -> str:
        return failure_message(action, where, exc, self._options)


def as_storage(
    location: Union[Storage, PathLike], storage_options: Optional[Mapping[str, Any]] = None
) -> Storage:
    """`location` itself when it is a `Storage`, else `Storage(location, storage_options)`."""
    if isinstance(location, Storage):
        if storage_options:
            raise ValueError("storage_options go with a path or URL, not with a Storage")
        return location
    return Storage(location, storage_options)


def _copy_options(options: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"storage_options must be a dict, got {type(options).__name__}")
    bad = [repr(key) for key in options if not isinstance(key, str)]
    if bad:
        raise TypeError(f"storage_options keys must be strings, got {', '.join(bad)}")
    try:
        # Picklable now rather than when the first worker is sent the location.
        return pickle.loads(pickle.dumps(dict(options)))
    except Exception:
        # The message names the keys only: a value may be a credential.
        raise TypeError(
            f"storage_options must be picklable to reach the workers (keys {sorted(options)})"
        ) from None


def _filesystem_class(protocol: str) -> type:
    import fsspec

    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError:
        _raise_missing_library(protocol)
    except ValueError:
        if protocol in _EXTRAS:  # a protocol the library itself registers (adlfs's abfss)
            _raise_missing_library(protocol)
        raise ValueError(
            f"unknown storage protocol {protocol!r}: use a local path or a URL fsspec knows, "
            "such as s3://, gs://, abfs://, memory:// or file://"
        ) from None


def _raise_missing_library(protocol: str) -> NoReturn:
    if protocol in _EXTRAS:
        library, extra = _EXTRAS[protocol]
        raise ImportError(
            f"{protocol}:// storage needs {library}, which is not installed (or does not "
            f"import): pip install 'raysgd[{extra}]'"
        ) from None
    from fsspec.registry import known_implementations

    hint = known_implementations.get(protocol, {}).get("err", "its fsspec implementation")
    raise ImportError(
        f"{protocol}:// storage needs a library that is not installed: {hint}"
    ) from None


def _remote_path(protocol: str, text: str, rest: str) -> str:
    authority = rest.split("/", 1)[0]
    if "@" in authority and ":" in authority.split("@", 1)[0]:
        # The URL would be shown in messages and logs; its credentials with it.
        raise ValueError(
            f"put the credentials of a {protocol}:// URL in storage_options, not in the URL"
        )
    cls = _filesystem_class(protocol)
    path = str(cls._strip_protocol(text))
    if not path:
        path = str(getattr(cls, "root_marker", ""))
    if not path or (path == "/" and protocol != "memory"):
        raise ValueError(
            f"a {protocol}:// location needs a bucket (or container): {protocol}://NAME/..."
        )
    return path.rstrip("/") or "/"


def is_scratch(path: str) -> bool:
    """Whether `path` names one of this module's temp or probe files (never a checkpoint part)."""
    return posixpath.basename(path).startswith(SCRATCH_PREFIX)


def _discard(handle: IO[bytes]) -> None:
    """Give up an fsspec file open for writing without committing what was written: `discard`
    (s3fs aborts its multipart upload), then `close`, which then has nothing left to commit (or
    fails, which leaves the file closed all the same)."""
    with suppress(Exception):
        handle.discard()  # type: ignore[attr-defined]
    with suppress(Exception):
        handle.close()
