"""Letting this process out of collectives that wait for a lost peer: the abort of a group.

A rank blocked in a collective stays blocked until the peer it waits for answers or its
connection to that peer fails. A lost peer's own connections fail at once, but only for the
ranks that were talking to it: the others wait for those ranks, which are themselves blocked, and
so on around the group. Aborting the group on every rank ends all of those waits:

- NCCL: `ProcessGroup.abort()` aborts the communicators; a collective waiting on them raises.
- gloo: `abort()` and `shutdown()` return at once but leave an operation in progress blocked
  (torch 2.13), and destroying the group closes its connections only when nothing else holds it
  (a DDP wrapper and FSDP's state do). So the connections themselves are shut down
  (``shutdown(2)``, never closed: gloo still owns the descriptors): the operation waiting on them
  raises here at once ("Connection closed"), and so does the peer at the other end, whose own
  abort then releases its other peers. A rank that fails in a collective aborts its group, so one
  lost rank releases every rank within milliseconds, and the driver aborts the survivors too as
  soon as Ray reports the loss.

A rank can also wait in the group's rendezvous store rather than in a collective: a subgroup being
made (`new_group`, whose every member must write its address there) waits for a peer that is gone
until the store's bound. So an abort also shuts down this process's connection to the store of
the group's generation: that wait raises at once too. Each generation has its own store (rank 0
makes a new one when the group forms), so nothing later needs the connection.

Which sockets are the group's: every connection has one end on a gloo listener, one per group a
process is in. They are the connections accepted on this process's listeners opened since the
group formed (subgroups made later included), and the connections this process opened to its
peers' listeners, which the ranks tell each other when the group forms. Never a listener itself
(gloo's accept loop cannot handle a listener shut under it, and ends the process) and no other
connection (Ray's own). The sockets are read from ``/proc`` (Linux); elsewhere an abort leaves the
connections as they are and the waits end at their bound (`raysgd_core.set_collective_timeout`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import NamedTuple, Optional

__all__ = ["Endpoint", "GroupConnections", "listening_endpoints", "shut_down_connections_to"]

logger = logging.getLogger("raysgd_core")

_LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket


class Endpoint(NamedTuple):
    """An address and port, as the kernel reports them (IPv4-mapped IPv6 shown as IPv4)."""

    ip: str
    port: int

    def serves(self, other: Endpoint) -> bool:
        """Whether a connection whose end is `other` reached this listener (a listener on the
        wildcard address serves every address of its port)."""
        if self.port != other.port:
            return False
        return self.ip == other.ip or ipaddress.ip_address(self.ip).is_unspecified


class _Socket(NamedTuple):
    local: Endpoint
    remote: Endpoint
    listening: bool


def _decode(field: str) -> Endpoint:
    """An endpoint of /proc/net/tcp{,6}: hex address in host-order 32-bit words, hex port."""
    address, port = field.split(":")
    raw = bytes.fromhex(address)
    # Each 32-bit word is printed in the host's byte order (little-endian on every platform
    # torch runs on), so the bytes of each word come reversed.
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return Endpoint(str(ip), int(port, 16))


def _tcp_sockets() -> dict[str, _Socket]:
    """Every TCP socket of this network namespace, by inode."""
    found: dict[str, _Socket] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)  # the header
                for line in lines:
                    cols = line.split()
                    found[cols[9]] = _Socket(_decode(cols[1]), _decode(cols[2]), cols[3] == _LISTEN)
        except OSError:
            continue
    return found


def _socket_fds() -> dict[int, str]:
    """This process's socket descriptors: fd -> inode."""
    fds: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            fds[int(name)] = target[8:-1]
    return fds


def _own_sockets() -> list[tuple[int, str, _Socket]]:
    """This process's TCP sockets: (fd, inode, socket)."""
    table = _tcp_sockets()
    return [(fd, inode, table[inode]) for fd, inode in _socket_fds().items() if inode in table]


def listening_endpoints() -> frozenset[Endpoint]:
    """Where this process listens for TCP connections now."""
    return frozenset(s.local for _, _, s in _own_sockets() if s.listening)


def _shut_down(fd: int, inode: str) -> bool:
    """Shut down the socket behind `fd` if it is still the socket `inode`.

    Works on a duplicate of the descriptor: gloo may close `fd` meanwhile, and the number may
    then be reused by another socket, which must not be touched. The duplicate keeps the socket
    it refers to; its inode says whether that is still the one that was found."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if str(os.fstat(dup).st_ino) != inode:
            return False
        sock = socket.socket(fileno=dup)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            return False
        finally:
            sock.detach()
        return True
    finally:
        os.close(dup)


@dataclass(frozen=True)
class GroupConnections:
    """What this process needs to abort the group it formed (see the module docstring).

    Attributes:
        backend: The group's backend.
        before: Where this process listened before the group formed: not the group's.
        peers: The other ranks' gloo listeners (empty for NCCL).
        store: Where the group's rendezvous store listens (None: its connection is left open).
    """

    backend: str
    before: frozenset[Endpoint] = frozenset()
    peers: frozenset[Endpoint] = frozenset()
    store: Optional[Endpoint] = None

    @classmethod
    def gather(
        cls, backend: str, before: frozenset[Endpoint], store: Optional[Endpoint] = None
    ) -> GroupConnections:
        """Right after this process joined a group (a collective over it): learn the other
        ranks' gloo listeners. `before`: `listening_endpoints()` before it joined; `store`: the
        group's rendezvous store."""
        if backend != "gloo":
            return cls(backend, store=store)
        import torch.distributed as dist

        everyone = _all_gather_bytes(_pack(sorted(listening_endpoints() - before)))
        rank = dist.get_rank()
        peers = frozenset(
            e for r, packed in enumerate(everyone) if r != rank for e in _unpack(packed)
        )
        return cls(backend, before, peers, store)

    def connections(self) -> list[tuple[int, str]]:
        """The gloo connections of this process's groups: (fd, inode) of each socket."""
        own = listening_endpoints() - self.before
        found = []
        for fd, inode, sock in _own_sockets():
            if sock.listening:
                continue
            ours = any(listener.serves(sock.local) for listener in own)
            theirs = any(peer.serves(sock.remote) for peer in self.peers)
            if ours or theirs:
                found.append((fd, inode))
        return found

    def abort(self) -> int:
        """Abort every collective of the group in progress here, and every wait in its store,
        and make later ones raise; the number of connections shut down (the store's; gloo's)."""
        shut = shut_down_connections_to(self.store) if self.store is not None else 0
        if self.backend == "nccl":
            return shut + _abort_nccl()
        return shut + sum(_shut_down(fd, inode) for fd, inode in self.connections())


# Endpoints travel as bytes in a tensor collective, not in an object collective
# (`all_gather_object`): torch reads an object collective's bytes back through NumPy, which neither
# Ray nor raysgd-core installs, and unpickles what a peer sent. Each endpoint is 18 bytes: its
# address as IPv6 (IPv4 as IPv4-mapped) and its port, big-endian.
_PACKED = 18


def _pack(endpoints: list[Endpoint]) -> bytes:
    packed = bytearray()
    for endpoint in endpoints:
        ip = ipaddress.ip_address(endpoint.ip)
        if isinstance(ip, ipaddress.IPv4Address):
            ip = ipaddress.IPv6Address(f"::ffff:{ip}")
        packed += ip.packed + endpoint.port.to_bytes(2, "big")
    return bytes(packed)


def _unpack(packed: bytes) -> list[Endpoint]:
    endpoints = []
    for i in range(0, len(packed), _PACKED):
        ip = ipaddress.IPv6Address(packed[i : i + 16])
        port = int.from_bytes(packed[i + 16 : i + _PACKED], "big")
        endpoints.append(Endpoint(str(ip.ipv4_mapped or ip), port))
    return endpoints


def _all_gather_bytes(mine: bytes) -> list[bytes]:
    """Every rank's `mine`, in rank order (a collective of the default group, on the CPU)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    size = torch.tensor([len(mine)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    if longest == 0:  # every rank sees the same sizes: none goes on to the second collective
        return [b""] * world
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [bytes(t[:n].tolist()) for t, n in zip(gathered, lengths)]


def shut_down_connections_to(store: Endpoint) -> int:
    """Shut down this process's connections to the rendezvous store at `store`: a wait in it
    raises at once (also while a group is still forming, before its connections are known).
    The number shut down."""
    return sum(
        _shut_down(fd, inode)
        for fd, inode, sock in _own_sockets()
        if not sock.listening and store.serves(sock.remote)
    )


def _abort_nccl() -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    try:
        dist.group.WORLD.abort()
    except Exception:  # already aborted or destroyed: nothing left to wait on
        logger.debug("aborting the NCCL group failed", exc_info=True)
        return 0
    return 1
