"""Storage for checkpoints: local paths and fsspec URLs (S3 through moto's server, memory://,
file://), credentials kept out of every text, and the "complete or invisible" checkpoint folders."""

from __future__ import annotations

import importlib.util
import logging
import os
import pickle
import socket
import subprocess
import sys
import uuid

import pytest

from raysgd._internal.storage.catalog import (
    ABANDONED_NAME,
    abandon,
    abandoned,
    checkpoint_name,
    complete_checkpoints,
    newest_complete,
    prune,
    reclaim,
    resolve_checkpoint,
)
from raysgd._internal.storage.errors import redact
from raysgd._internal.storage.format import (
    MANIFEST_NAME,
    Manifest,
    checkpoint_position,
    gathered,
    gathered_files,
    read_manifest,
    write_manifest,
    write_state,
)
from raysgd._internal.storage.location import Storage, StorageError

pytestmark = pytest.mark.timeout(30)

BACKENDS = ["local", "file-url", "memory", "s3"]


@pytest.fixture(params=BACKENDS)
def root(request, tmp_path) -> Storage:
    """An empty location of each kind, unique to the test."""
    kind = request.param
    if kind == "local":
        return Storage(tmp_path / "root")
    if kind == "file-url":
        return Storage(f"file://{tmp_path}/root")
    if kind == "memory":
        location = Storage(f"memory://raysgd-tests/{uuid.uuid4().hex}")
        request.addfinalizer(location.remove)
        return location
    s3 = request.getfixturevalue("s3_server")
    return Storage(s3.url(uuid.uuid4().hex), s3.storage_options)


def attempt(root: Storage, epoch: int, step: int, parts=None) -> Storage:
    """A new attempt's folder with its parts written, as the workers write them (no manifest)."""
    folder = root.join(checkpoint_name(epoch, step))
    for part, data in (parts or {}).items():
        folder.write_bytes(part, data)
    return folder


def write_checkpoint(root: Storage, epoch: int, step: int, parts=None, **meta):
    parts = parts or {"state.pt": b"x" * (epoch + 1)}
    folder = attempt(root, epoch, step, parts)
    sizes = {part: len(data) for part, data in parts.items()}
    return write_manifest(folder, "state", epoch, step, expected=sizes, meta=meta)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- Storage --


def test_a_whole_state_is_written_without_record_checksums(tmp_path):
    """A whole state's file loads back whole, and its records carry no CRC-32 (torch.load never
    checks one; computing it costs a background checkpoint most of its CPU). Fails when torch's
    serialization config stops taking `compute_crc32`, which would bring that cost back."""
    import zipfile

    import torch

    state = {"epoch": 3, "models": [{"w": torch.arange(1000.0)}], "optimizers": [{}]}
    write_state(Storage(tmp_path), "state.pt", state)
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded["epoch"] == 3 and torch.equal(loaded["models"][0]["w"], torch.arange(1000.0))
    with zipfile.ZipFile(tmp_path / "state.pt") as archive:
        records = [i for i in archive.infolist() if i.file_size]
        assert records and all(info.CRC == 0 for info in records)


def _accepts_direct_writes(folder) -> bool:
    probe = os.path.join(folder, "probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    return hasattr(os, "O_DIRECT")


def test_a_streamed_local_part_is_written_around_the_page_cache(tmp_path):
    """Checkpoint parts go to local disk with direct writes where the file system takes them (not
    through the page cache, whose copies and writeback take CPU from the training), byte for byte
    what was written, whatever the sizes of the writes."""
    pieces = [b"", b"a", os.urandom(4095), os.urandom(4096), os.urandom((8 << 20) + 123), b"z"]
    seen = {}

    def write(handle):
        seen["direct"] = handle.direct
        for piece in pieces:
            assert handle.write(piece) == len(piece)

    Storage(tmp_path).write_stream("part.bin", write)
    # Exact: the padding of the last block is cut off, and no temp file is left.
    assert (tmp_path / "part.bin").read_bytes() == b"".join(pieces)
    assert os.listdir(tmp_path) == ["part.bin"]
    assert seen["direct"] == _accepts_direct_writes(tmp_path)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no direct writes on this system")
def test_a_refused_direct_write_goes_on_through_the_page_cache(tmp_path):
    """A file system may take the direct-write flag at open and refuse the writes themselves
    (here: a file position off the block boundary, which no direct write accepts): the bytes go
    through the cache instead, none lost."""
    import fcntl

    from raysgd._internal.storage.direct_writes import DirectFile

    path = tmp_path / "part.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"#")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        handle = DirectFile(fd)
        body = os.urandom((8 << 20) + 5)
        handle.write(body)
        handle.close()
        assert not handle.direct
    finally:
        os.close(fd)
    assert path.read_bytes() == b"#" + body


def test_file_operations(root):
    assert not root.exists()
    root.write_bytes("a.bin", b"1234")
    root.write_bytes("sub/deeper/b.bin", b"xy")
    assert root.exists() and root.exists("a.bin") and root.exists("sub/deeper")
    assert root.read_bytes("a.bin") == b"1234"
    assert root.read_bytes("sub/deeper/b.bin") == b"xy"
    assert root.size("a.bin") == 4
    assert root.listdir() == ["a.bin", "sub"]
    assert root.file_sizes() == {"a.bin": 4, "sub/deeper/b.bin": 2}
    assert root.join("sub").file_sizes() == {"deeper/b.bin": 2}
    root.write_bytes("a.bin", b"replaced")
    assert root.read_bytes("a.bin") == b"replaced"
    root.remove("sub")
    assert not root.exists("sub")
    root.remove("sub")  # nothing there: not an error
    with pytest.raises(FileNotFoundError, match=r"missing\.bin"):
        root.read_bytes("missing.bin")
    root.check_access(write=True)
    assert root.listdir() == ["a.bin"]  # the probe is gone
    root.remove()
    assert not root.exists()
    assert root.file_sizes() == {}


def test_relative_paths_stay_below_the_location(root):
    for bad in ("../x", "/abs", "a//b", "a/./b", "a\\b"):
        with pytest.raises(ValueError, match="relative path"):
            root.read_bytes(bad)
        with pytest.raises(ValueError, match="relative path"):
            root.join(bad)
    assert root.join("a", "b").url == root.join("a/b").url
    assert Storage(root.join("a").url, root.storage_options) == root.join("a")


def test_plain_path_is_an_ordinary_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    location = Storage("ckpts")
    assert location.is_local and location.protocol == "file"
    assert location.url == location.path == str(tmp_path / "ckpts") == str(location)
    assert Storage(f"file://{tmp_path}/ckpts") == location
    location.write_bytes("state.pt", b"data")
    assert (tmp_path / "ckpts" / "state.pt").read_bytes() == b"data"
    assert repr(location) == f"Storage({str(tmp_path / 'ckpts')!r})"


def test_local_write_is_atomic(tmp_path, monkeypatch):
    location = Storage(tmp_path)
    location.write_bytes("state.pt", b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StorageError, match="disk full"):
        location.write_bytes("state.pt", b"new content")
    monkeypatch.undo()
    assert location.read_bytes("state.pt") == b"old"
    assert sorted(os.listdir(tmp_path)) == ["state.pt"]  # no temp file left


def test_a_local_folder_is_replaced_whole_or_not_at_all(tmp_path):
    folder = Storage(tmp_path / "ckpt")
    with folder.replaced_folder() as new:
        new.write_bytes("a", b"first")
    assert folder.listdir() == ["a"]

    with pytest.raises(RuntimeError, match="cut short"):
        with folder.replaced_folder() as new:
            new.write_bytes("b", b"second")
            raise RuntimeError("cut short")
    assert folder.listdir() == ["a"] and folder.read_bytes("a") == b"first"
    with folder.replaced_folder() as new:
        new.write_bytes("b", b"second")
    assert folder.listdir() == ["b"]  # the older folder went whole, once the new one was there
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no scratch folder left


def test_a_streamed_write_is_whole_or_keeps_the_old_file(root):
    chunk = os.urandom(1 << 20)

    def three_chunks(handle):
        for _ in range(3):
            handle.write(chunk)

    root.write_stream("part.bin", three_chunks)
    assert root.read_bytes("part.bin") == chunk * 3

    def fails_midway(handle):
        handle.write(b"partial")
        raise RuntimeError("the state could not be pickled")

    with pytest.raises(StorageError, match=r"cannot write .*part\.bin.*could not be pickled"):
        root.write_stream("part.bin", fails_midway)
    if root.protocol != "memory":  # memory:// shows a file while it is written
        assert root.read_bytes("part.bin") == chunk * 3
        assert root.listdir() == ["part.bin"]  # no temp file or stray object left


def test_remote_locations(s3_server):
    s3 = Storage(s3_server.url("a/b/"), s3_server.storage_options)
    assert (s3.protocol, s3.path, s3.url, s3.is_local) == (
        "s3",
        f"{s3_server.bucket}/a/b",
        s3_server.url("a/b"),
        False,
    )
    assert s3.name == "b" and not s3.is_local
    memory = Storage("memory://x/y")
    assert (memory.path, memory.url) == ("/x/y", "memory:///x/y")
    assert Storage(memory.url) == memory
    with pytest.raises(ValueError, match="needs a bucket"):
        Storage("s3://")


def test_unknown_protocol():
    with pytest.raises(ValueError, match=r"unknown storage protocol 'nosuchfs'.*s3://"):
        Storage("nosuchfs://bucket/x")
    with pytest.raises(ValueError, match="chained"):
        Storage("simplecache::s3://bucket/x")


@pytest.mark.parametrize(
    ("url", "library", "extra"),
    [
        ("gs://bucket/ckpts", "gcsfs", "gcs"),
        ("gcs://bucket/ckpts", "gcsfs", "gcs"),
        ("abfs://container/ckpts", "adlfs", "azure"),
        ("az://container/ckpts", "adlfs", "azure"),
        ("abfss://container/ckpts", "adlfs", "azure"),
    ],
)
def test_missing_client_library_names_the_extra(url, library, extra):
    if importlib.util.find_spec(library) is not None:
        pytest.skip(f"{library} is installed here")
    with pytest.raises(ImportError, match=rf"needs {library}.*pip install 'raysgd\[{extra}\]'"):
        Storage(url)


def test_storage_options_are_checked():
    with pytest.raises(TypeError, match="dict"):
        Storage("memory://x", storage_options=[("key", "v")])
    with pytest.raises(TypeError, match=r"picklable.*'token'"):
        Storage("memory://x", storage_options={"token": lambda: "secret-value"})
    with pytest.raises(ValueError, match="storage_options, not in the URL"):
        Storage("s3://user:hunter22@bucket/x")


def test_pickled_storage_reaches_the_same_files(s3_server):
    location = Storage(s3_server.url(uuid.uuid4().hex), s3_server.storage_options)
    location.write_bytes("from-driver", b"1")  # the original has built its client
    data = pickle.dumps(location)
    assert b"S3FileSystem" not in data and len(data) < 1000  # no live client inside
    copy = pickle.loads(data)
    assert copy == location and copy.storage_options == location.storage_options
    copy.write_bytes("from-worker", b"22")
    assert copy.read_bytes("from-driver") == b"1"
    assert location.file_sizes() == {"from-driver": 1, "from-worker": 2}


def test_options_given_stay_as_given(s3_server):
    options = {**s3_server.storage_options, "config_kwargs": {"retries": {"max_attempts": 2}}}
    location = Storage(s3_server.url(uuid.uuid4().hex), options)
    location.write_bytes("x", b"1")  # s3fs rewrites the config_kwargs it is given
    assert location.storage_options == options
    options["key"] = "changed"
    assert location.storage_options["key"] == s3_server.key


# -- credentials and reachability --


def assert_no_secret(texts, secrets):
    for text in texts:
        for secret in secrets:
            assert secret not in text, (secret, text)


def test_check_access_wrong_bucket(s3_server, caplog):
    caplog.set_level(logging.DEBUG)
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    options = {**s3_server.storage_options, "secret": secret}
    location = Storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ckpts", options)
    with pytest.raises(StorageError) as info:
        location.check_access()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"cannot access {location.url}: not found")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert_no_secret([message, repr(location), str(location), caplog.text], [secret])
    assert "secret" in repr(location)  # the option's name, not its value
    # The bucket that is there, with nothing under the prefix yet, is fine.
    Storage(s3_server.url(uuid.uuid4().hex, "ckpts"), options).check_access(write=True)


@pytest.mark.parametrize("endpoint_from", ["storage_options", "environment"])
def test_check_access_unreachable_endpoint(s3_server, monkeypatch, caplog, endpoint_from):
    caplog.set_level(logging.DEBUG)
    dead = f"http://127.0.0.1:{free_port()}"
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    options = {
        "key": s3_server.key,
        "secret": secret,
        # One attempt: botocore and s3fs would otherwise retry for about 12 s.
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    if endpoint_from == "environment":
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)  # botocore reads it when no endpoint_url
    else:
        options["endpoint_url"] = dead
    location = Storage(s3_server.url("ckpts"), options)
    with pytest.raises(StorageError) as info:
        location.check_access()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"cannot access {location.url}: endpoint unreachable")
    assert "EndpointConnectionError" in message
    # The client's text names the endpoint; it is a value of storage_options or of a variable
    # of the environment that clients read, so it is left out like a credential would be.
    assert_no_secret([message, repr(location), str(location)], [secret, dead])
    # botocore's own debug lines name the endpoint, never the secret.
    assert_no_secret([caplog.text], [secret])
    with pytest.raises(StorageError, match=r"cannot write .*endpoint unreachable") as info:
        location.write_bytes("x", b"1")
    assert_no_secret([str(info.value)], [secret, dead])


def test_error_texts_lose_environment_credentials(monkeypatch):
    secret = f"from-env-{uuid.uuid4().hex}"
    monkeypatch.setenv("AZURE_STORAGE_KEY", secret)
    monkeypatch.setenv("MY_SERVICE_TOKEN", secret + "2")
    text = redact(f"failed with {secret} and {secret}2", {"a": "xyz12"})
    assert secret not in text and text == "failed with *** and ***"


# -- checkpoint folders --


def test_manifest_is_written_last_and_a_folder_without_it_is_invisible(root):
    folder = attempt(root, 1, 10, {"state.pt": b"abc"})
    assert not folder.exists(MANIFEST_NAME)
    assert newest_complete(root) is None and complete_checkpoints(root) == []
    with pytest.raises(FileNotFoundError, match="no complete raysgd checkpoint"):
        resolve_checkpoint(root)
    checkpoint = write_manifest(folder, "state", 1, 10, meta={"world_size": 2})
    assert folder.exists(MANIFEST_NAME)
    assert checkpoint.manifest.parts == {"state.pt": 3}
    assert (checkpoint.epoch, checkpoint.step, checkpoint.kind) == (1, 10, "state")
    found = newest_complete(root)
    assert found == checkpoint and found.manifest.meta == {"world_size": 2}


def test_the_manifest_refuses_missing_parts(root):
    folder = attempt(root, 0, 5, {"__0_0.distcp": b"rank0"})
    # A worker that never wrote its part.
    with pytest.raises(ValueError, match=r"'__1_0\.distcp' was not written"):
        write_manifest(folder, "sharded", 0, 5, expected={"__1_0.distcp": None})
    assert not folder.exists(MANIFEST_NAME)
    folder.write_bytes("__1_0.distcp", b"r1")
    with pytest.raises(ValueError, match="has 2 bytes, expected 5"):
        write_manifest(folder, "sharded", 0, 5, expected={"__1_0.distcp": 5})
    assert not folder.exists(MANIFEST_NAME)
    with pytest.raises(ValueError, match="no part"):
        write_manifest(attempt(root, 0, 6), "state", 0, 6)
    with pytest.raises(TypeError, match="not JSON serializable"):  # before anything is written
        write_manifest(folder, "sharded", 0, 5, meta={"bad": object()})
    assert not folder.exists(MANIFEST_NAME)


def test_workers_write_parts_through_a_pickled_location(root):
    folder = attempt(root, 2, 40)
    for rank in range(2):
        worker_copy = pickle.loads(pickle.dumps(folder))
        worker_copy.write_bytes(f"__{rank}_0.distcp", b"p" * (rank + 1))
    folder.write_bytes(".metadata", b"meta")
    checkpoint = write_manifest(folder, "sharded", 2, 40)
    assert checkpoint.manifest.parts == {".metadata": 4, "__0_0.distcp": 1, "__1_0.distcp": 2}
    assert resolve_checkpoint(root) == checkpoint


# What a worker does with the location it is sent: a process of its own, with no client yet.
WORKER = """
import pickle, sys
location = pickle.loads(sys.stdin.buffer.read())
assert location._fs is None
location.write_bytes("__1_0.distcp", b"from another process")
print(location.read_bytes("__0_0.distcp").decode())
"""


@pytest.mark.timeout(90)
def test_a_worker_process_writes_its_part_through_the_location(s3_server):
    root = Storage(s3_server.url(uuid.uuid4().hex), s3_server.storage_options)
    folder = attempt(root, 0, 1, {"__0_0.distcp": b"rank 0"})
    out = subprocess.run(
        [sys.executable, "-c", WORKER],
        input=pickle.dumps(folder),
        capture_output=True,
        check=True,
        timeout=80,
    )
    assert out.stdout.decode().strip() == "rank 0"
    sizes = {"__0_0.distcp": 6, "__1_0.distcp": len(b"from another process")}
    checkpoint = write_manifest(folder, "sharded", 0, 1, expected=sizes)
    assert resolve_checkpoint(root) == checkpoint


def test_newest_complete_follows_training_progress(root):
    later = write_checkpoint(root, 3, 300)
    write_checkpoint(root, 1, 100)  # written after, but earlier in training
    attempt(root, 4, 400, {"state.pt": b"partial"})  # unfinished
    assert newest_complete(root) == later
    assert [c.step for c in complete_checkpoints(root)] == [100, 300]
    # Two complete attempts at one step: the later one.
    again = write_checkpoint(root, 3, 300)
    assert again.manifest.created >= later.manifest.created
    assert newest_complete(root) == max([later, again], key=lambda c: (c.manifest.created, c.name))


def test_torn_checkpoint_is_invisible(root):
    older = write_checkpoint(root, 0, 10)
    torn = write_checkpoint(root, 1, 20, parts={"model.pt": b"m", "optim.pt": b"oo"})
    torn.location.remove("optim.pt")
    assert newest_complete(root) == older
    with pytest.raises(ValueError, match=r"incomplete: .*optim\.pt is missing"):
        resolve_checkpoint(torn.location)
    torn.location.write_bytes("optim.pt", b"ooo")  # another size than the manifest's
    with pytest.raises(ValueError, match="has 3 bytes, the manifest says 2"):
        resolve_checkpoint(torn.location)
    assert newest_complete(root) == older


def test_a_retry_writes_a_new_folder(root):
    first = attempt(root, 5, 50, {"state.pt": b"interrupted"})
    checkpoint = write_checkpoint(root, 5, 50, {"state.pt": b"done"})
    assert checkpoint.location != first
    assert first.read_bytes("state.pt") == b"interrupted"
    assert newest_complete(root) == checkpoint
    assert checkpoint_name(5, 50) != checkpoint_name(5, 50)
    assert checkpoint.name.startswith("ckpt-e000005-s000000050-")
    # A name derived from the attempt's token: every worker of the attempt finds the same folder.
    assert checkpoint_name(5, 50, token="a1") == checkpoint_name(5, 50, token="a1")


def test_resolve_checkpoint(root):
    with pytest.raises(FileNotFoundError, match=r"no complete raysgd checkpoint.*" + root.name):
        resolve_checkpoint(root)
    old = write_checkpoint(root, 0, 1)
    new = write_checkpoint(root, 0, 2)
    assert resolve_checkpoint(root) == new
    assert resolve_checkpoint(old.location) == old  # a folder given itself
    # By URL and options, as a user gives them.
    assert resolve_checkpoint(old.url, root.storage_options or None) == old
    assert read_manifest(new.location) == new.manifest
    assert read_manifest(root) is None


def test_prune(root):
    stale = attempt(root, 0, 5, {"state.pt": b"s"})  # an interrupted attempt
    assert prune(root, keep=1) == []  # nothing complete: nothing removed
    done = [write_checkpoint(root, 0, step) for step in (10, 20, 30, 40)]
    torn = write_checkpoint(root, 0, 25)
    torn.location.remove("state.pt")
    same_step = attempt(root, 0, 40, {"state.pt": b"?"})  # maybe in flight
    in_flight = attempt(root, 0, 50, {"state.pt": b"?"})
    root.write_bytes("user-notes/readme.txt", b"not ours")
    foreign = root.join(checkpoint_name(0, 1))
    foreign.write_bytes(MANIFEST_NAME, b"{not json")

    removed = prune(root, keep=2)

    assert removed == sorted([done[0].name, done[1].name, stale.name, torn.name])
    assert [c.step for c in complete_checkpoints(root)] == [30, 40]
    left = set(root.listdir())
    assert {same_step.name, in_flight.name, "user-notes", foreign.name} <= left
    assert not left & set(removed)
    assert prune(root, keep=2) == []
    with pytest.raises(ValueError, match="keep must be a positive int"):
        prune(root, keep=0)


def test_a_load_that_went_back_abandons_the_checkpoints_past_it(root, caplog):
    # A run reached step 40, then a load went back to step 20 and wrote one checkpoint since.
    before = [write_checkpoint(root, 0, step) for step in (10, 20, 30, 40)]
    assert abandon(root, 20) == {before[2].name, before[3].name}
    since = write_checkpoint(root, 0, 25)
    assert newest_complete(root) == since  # not step 40, of the timeline the load replaced
    assert resolve_checkpoint(root) == since
    assert resolve_checkpoint(before[3].location) == before[3]  # still loads by its path
    # Pruning counts this timeline's alone, and leaves the abandoned where they are.
    assert prune(root, keep=1) == sorted([before[0].name, before[1].name])
    assert set(root.listdir()) >= {since.name, before[2].name, before[3].name}
    # A second load that goes back adds to what was abandoned before.
    assert abandon(root, 10) == {since.name, before[2].name, before[3].name}
    assert abandoned(root) == {since.name, before[2].name, before[3].name}
    assert newest_complete(root) is None
    # A checkpoint outside the periodic names (the "auto" one) is abandoned by its own
    # counters, past the step only, until it is written anew.
    write_state(root, "auto.pt", {"models": [], "epoch": 0, "step": 50})
    assert abandon(root, 50, also=("auto.pt", "absent.pt")) == frozenset()
    assert abandon(root, 45, also=("auto.pt", "absent.pt")) == {"auto.pt"}
    assert "auto.pt" in abandoned(root)
    reclaim(root, "auto.pt")
    assert abandoned(root) == {since.name, before[2].name, before[3].name}
    # A list that cannot be read abandons nothing, and says so.
    root.write_bytes(ABANDONED_NAME, b"{not a list")
    with caplog.at_level(logging.WARNING, logger="raysgd"):
        assert abandoned(root) == frozenset()
    assert ABANDONED_NAME in caplog.text and newest_complete(root) == before[3]


def test_manifest_format():
    manifest = Manifest("state", 2, 30, {"state.pt": 12, "sub/x": 0}, meta={"a": [1]})
    assert Manifest.from_bytes(manifest.to_bytes()) == manifest
    for data, match in [
        (b"\xff", "not JSON"),
        (b"[]", "format"),
        (b'{"format": "raysgd-checkpoint", "version": 1}', "kind"),
        (manifest.to_bytes().replace(b'"path": "sub/x"', b'"path": "../x"'), "bad part"),
    ]:
        with pytest.raises(ValueError, match=match):
            Manifest.from_bytes(data, source="m.json")
    newer = manifest.to_bytes().replace(b'"version": 1', b'"version": 99')
    with pytest.raises(ValueError, match="newer raysgd"):
        Manifest.from_bytes(newer)


@pytest.mark.parametrize("root", BACKENDS, indirect=True)
def test_a_checkpoints_position_and_a_gathered_sharded_state_are_read_by_the_format(
    root: Storage,
) -> None:
    import torch

    # A file: its own counters (its tensors' bytes are not read); a folder: its manifest's.
    weights = {"w": torch.arange(4096, dtype=torch.float32)}
    write_state(root, "ckpt.pt", {"models": [weights], "epoch": 2, "step": 17})
    assert checkpoint_position(root.join("ckpt.pt")) == (2, 17)
    root.write_bytes("junk.pt", b"not a checkpoint")
    with pytest.raises(ValueError, match="not a raysgd checkpoint"):
        checkpoint_position(root.join("junk.pt"))
    folder = attempt(root, 3, 40, {"part": b"x"})
    write_manifest(folder, "sharded", 3, 40)
    assert checkpoint_position(folder) == (3, 40)
    # A sharded state in one process: its files round-trip; a whole state's dict is not one.
    files = {"__0_0.distcp": b"a", ".metadata": b"b"}
    assert gathered_files(gathered(files)) == files
    assert gathered_files({"models": [], "epoch": 0}) is None
    for bad in ("../escape", "sub/part", ".."):
        with pytest.raises(ValueError, match="bad file name"):
            gathered_files(gathered({bad: b"x"}))
    with pytest.raises(ValueError, match="must hold"):
        gathered_files({"format": gathered({})["format"], "files": {"part": "not bytes"}})
