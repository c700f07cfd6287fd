"""Shared fixtures: one local Ray cluster per test process, multi-node clusters on demand.

Starting Ray costs about 3 s, so the tests of one process share one local cluster (told it has 4
CPUs so that 4 workers fit on a 2-core machine); `hatch run test` runs two such processes, each
with its own cluster, so nothing here may count what the whole machine holds. Tests that need several nodes use `ray_multinode`, which stops the shared
cluster, gives the test a `ray.cluster_utils.Cluster`, and leaves Ray stopped afterwards; the next test
asking for `ray_local` starts the shared cluster again.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The tests start hundreds of trainers one after another, each needing worker processes of the
# same kind: a stopped group's workers are kept (`raysgd_core`'s RAYSGD_KEEP_WORKERS_S) for the
# next one instead of starting new processes (seconds of CPU each, most of the suite's).
os.environ.setdefault("RAYSGD_KEEP_WORKERS_S", "10")

LOCAL_CPUS = 4
_mode: dict[str, str | None] = {"kind": None}


def _start_local() -> None:
    import ray

    if _mode["kind"] == "local" and ray.is_initialized():
        return
    from raysgd_core import local_ray_options

    ray.shutdown()
    ray.init(
        # "local" always starts a new cluster: without it ray.init joins whatever cluster
        # /tmp/ray/ray_current_cluster names (another test session's, a leftover Cluster).
        address="local",
        num_cpus=LOCAL_CPUS,
        log_to_driver=True,
        # As the trainer starts its own Ray: no dashboard, no metrics export.
        **local_ray_options(),
        configure_logging=False,
    )
    _mode["kind"] = "local"


#: The modules that take longest (minutes each on 2 cores), longest first. `hatch run test` hands
#: whole modules to its two test processes in collection order (`--dist loadfile`): started
#: first, these end while the short ones fill the other process, instead of one process running
#: a long module alone at the end.
LONGEST_FIRST = (
    "tests/examples/test_examples.py",
    "tests/raysgd/test_recovery_trainer.py",
    "tests/raysgd/test_exact_recovery.py",
    "tests/raysgd/test_preemption.py",
    "tests/packaging/test_install_smoke.py",
    "tests/raysgd/test_fsdp.py",
    "tests/raysgd/test_datasets.py",
    "tests/raysgd/test_failure_bursts.py",
    "tests/raysgd/test_checkpoint_storage.py",
    "tests/tune/test_distributed.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first (`LONGEST_FIRST`), the others in their order; multi-node tests
    last: each one stops the shared cluster, which the next `ray_local` test then starts again
    (seconds each time); together at the end they cost that restart once."""
    root = Path(__file__).resolve().parent.parent
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> tuple[bool, int]:
        module = item.path.resolve().relative_to(root).as_posix()
        multinode = "ray_multinode" in getattr(item, "fixturenames", ())
        return multinode, rank.get(module, len(LONGEST_FIRST))

    items.sort(key=key)


@pytest.fixture
def ray_local() -> Iterator[None]:
    """A running local Ray cluster with LOCAL_CPUS CPUs, shared across tests."""
    _start_local()
    yield


@pytest.fixture(scope="module")
def ray_local_module() -> Iterator[None]:
    """`ray_local` for a module-scoped fixture (one trainer shared by a module's tests)."""
    _start_local()
    yield


def _read_wandb_run(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # a full record, or the first chunk of one
            pending = chunk
        elif kind in (3, 4):  # a middle or the last chunk
            pending += chunk
        if kind in (1, 4):
            records.append(pb.Record.FromString(pending))
        elif kind == 0:  # zeroes: the end of what was written
            break
    return records


@pytest.fixture
def read_wandb_run() -> Callable[[Path], list[Any]]:
    """`read(path)`: the records of a W&B run file (`run-<id>.wandb`), for reading back what W&B
    wrote without a server. The file is W&B's framing (a 7-byte header, then 32 KiB blocks of
    chunks: crc32 4 bytes, length 2, type 1) around protobuf `Record`s of W&B's own schema
    (`wandb.proto.wandb_internal_pb2`)."""
    return _read_wandb_run


@pytest.fixture
def wait_for_cpus() -> Callable[..., float]:
    """`wait(expected, timeout_s=20)`: free CPUs once Ray reports `expected` of them free (or the
    timeout passed); freed resources come back asynchronously."""
    import ray

    def wait(expected: float, timeout_s: float = 20.0) -> float:
        deadline = time.monotonic() + timeout_s
        free = ray.available_resources().get("CPU", 0.0)
        while free < expected and time.monotonic() < deadline:
            time.sleep(0.1)
            free = ray.available_resources().get("CPU", 0.0)
        return free

    return wait


@pytest.fixture
def ray_multinode() -> Iterator[object]:
    """A fresh `ray.cluster_utils.Cluster` (head with 0 CPUs); the test adds its nodes, then connects."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    _mode["kind"] = None
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@dataclass(frozen=True)
class S3Endpoint:
    """An S3 server of the test session (see `s3_server`), with dummy credentials."""

    endpoint_url: str
    bucket: str
    key: str
    secret: str

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs's options for this server: a new dict each time (s3fs rewrites some options it
        is given, and a test may add its own)."""
        return {"endpoint_url": self.endpoint_url, "key": self.key, "secret": self.secret}

    def url(self, *names: str) -> str:
        """`s3://<bucket>/<names...>`."""
        return "/".join([f"s3://{self.bucket}", *names])


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Endpoint]:
    """An S3 endpoint for the session: moto's server in this process on 127.0.0.1 and a free
    port, with one empty bucket; yields an `S3Endpoint` (`endpoint_url`, `bucket`, `key`,
    `secret`, `storage_options`, `url(...)`). The credentials are dummies handed to the clients
    directly, never put into the environment. Tests share the bucket: each writes under a prefix
    of its own. Skipped when moto or s3fs is not installed."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    import logging

    import boto3

    # The server logs every request through werkzeug: noise in a failing test's output.
    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.WARNING)
    with socket.socket() as probe:  # a free port: the OS picks one, the server binds it next
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = S3Endpoint(
            endpoint_url=f"http://127.0.0.1:{port}",
            bucket="raysgd-test",
            key="raysgd-test-key-id",
            secret="raysgd-test-secret",
        )
        boto3.client(
            "s3",
            endpoint_url=endpoint.endpoint_url,
            aws_access_key_id=endpoint.key,
            aws_secret_access_key=endpoint.secret,
            region_name="us-east-1",
        ).create_bucket(Bucket=endpoint.bucket)
        yield endpoint
    finally:
        server.stop()
        werkzeug.setLevel(level)
