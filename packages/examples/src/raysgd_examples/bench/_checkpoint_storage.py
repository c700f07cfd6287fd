"""Where `bench:checkpoint` writes: a local folder, or moto's S3 server started for the run.

A run of one side gets a new, empty place (`place`) and leaves nothing behind. The S3 server runs in
the benchmark's parent process on 127.0.0.1 with one bucket and dummy credentials, handed to every
client directly (fsspec's options, or pyarrow's S3 file system for Ray Train).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

__all__ = ["BUCKET", "Place", "place", "s3_server"]

BUCKET = "raysgd-bench"
# Dummy credentials of the benchmark's own S3 server, handed to every client directly.
S3_KEY = "raysgd-bench-key-id"
S3_SECRET = "raysgd-bench-secret"
MANIFEST = "raysgd-manifest.json"  # the file a complete raysgd checkpoint folder ends with


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server in this process on 127.0.0.1 and a free port, with the benchmark's bucket;
    yields its endpoint URL and stops it on exit."""
    import logging
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    # Every request would be logged through werkzeug, between the benchmark's lines.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.stop()


@dataclass(frozen=True)
class Place:
    """Where one run writes: `url` (a local folder or ``s3://bucket/prefix``) with the fsspec
    `options` of its server (None for a local folder)."""

    url: str
    options: Optional[dict[str, Any]] = None
    endpoint: Optional[str] = None

    def join(self, name: str) -> str:
        return f"{self.url}/{name}"

    def filesystem(self) -> tuple[Any, str]:
        import fsspec

        return fsspec.core.url_to_fs(self.url, **(self.options or {}))

    def complete_checkpoints(self) -> int:
        """raysgd checkpoint folders here with their manifest (written last)."""
        fs, path = self.filesystem()
        return len(fs.glob(f"{path}/*/{MANIFEST}"))

    def arrow(self) -> tuple[Any, str]:
        """(`pyarrow.fs.S3FileSystem` of the server, ``bucket/prefix``): Ray Train's storage."""
        from pyarrow import fs

        assert self.endpoint is not None
        parts = urlsplit(self.endpoint)
        s3 = fs.S3FileSystem(
            access_key=S3_KEY,
            secret_key=S3_SECRET,
            endpoint_override=parts.netloc,  # host:port; the scheme goes apart
            scheme=parts.scheme,
            region="us-east-1",
        )
        return s3, self.url.removeprefix("s3://")


@contextlib.contextmanager
def place(side: str, args: argparse.Namespace) -> Iterator[Place]:
    """A new, empty place for one run of `side`, removed afterwards."""
    if side.endswith("_s3"):
        if not args.s3_endpoint:
            raise RuntimeError("no S3 server (moto's starts in the parent: is moto installed?)")
        options = {"endpoint_url": args.s3_endpoint, "key": S3_KEY, "secret": S3_SECRET}
        place = Place(f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", options, args.s3_endpoint)
        try:
            yield place
        finally:
            with contextlib.suppress(Exception):  # nothing may have been written
                fs, path = place.filesystem()
                fs.rm(path, recursive=True)
        return
    folder = tempfile.mkdtemp(prefix="raysgd_bench_ckpt_")
    try:
        yield Place(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
