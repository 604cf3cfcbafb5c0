"""Unblock a rank whose main thread waits in a gloo collective that will never complete.

A Python signal handler can't run while the main thread waits inside gloo (C++, GIL released),
and on torch 2.13 ``ProcessGroupGloo.abort()`` (or ``_abort_process_group``) called from another
thread returns at once without waking that wait: the collective only ends at its timeout. gloo's
pairs are TCP connections between the ranks, though, and a wait on one fails at once — a
``RuntimeError`` ("Connection closed by peer") in the main thread, the process unharmed — when the
socket is shut down under it. Every peer blocked in the same collective gets the same error as its
side of the pair closes, so one rank's shutdown unblocks them all. The group is unusable afterwards,
and is replaced (``worker/torch_hooks/regroup.py``) once the cell has ended on every rank.

Which of the process's sockets are gloo's is read from ``/proc``: the process's established TCP
connections whose local address is that of one of its own listeners (gloo's device listener: a
specific address, a port the kernel picked), and that are either accepted by that listener or
connected to a listener on a kernel-picked port elsewhere (a peer's gloo listener) — never the
controller's ZMQ connections or the rendezvous store's, nor anything to a well-known port. The
sockets are shut down, not closed: gloo still owns the descriptors and closes them itself when the
group is destroyed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from typing import Iterable
from urllib.parse import urlsplit

__all__ = ["Connection", "gloo_connections", "open_gloo", "shut_down", "store_and_controller_ports"]

_ESTABLISHED, _LISTEN = "01", "0A"


@dataclass(frozen=True)
class Connection:
    fd: int
    inode: int
    local: tuple[str, int]
    remote: tuple[str, int]

    def __str__(self) -> str:
        return f"{self.local[0]}:{self.local[1]} -> {self.remote[0]}:{self.remote[1]}"


def _address(field: str) -> tuple[str, int]:
    """``0100007F:1F90`` (/proc/net/tcp, 32-bit words in host order) as ``("127.0.0.1", 8080)``;
    an IPv4-mapped IPv6 address as its IPv4 form."""
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    raw = b"".join(int.from_bytes(raw[i:i + 4], "big").to_bytes(4, sys.byteorder) for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(hex_port, 16)



def _tcp_table() -> list[tuple[int, tuple[str, int], tuple[str, int], str]]:
    """Every TCP socket of this network namespace: (inode, local, remote, state)."""
    rows = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9:
                rows.append((int(parts[9]), _address(parts[1]), _address(parts[2]), parts[3]))
    return rows


def _own_sockets() -> dict[int, int]:
    """This process's socket descriptors: inode -> fd."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (listdir's own descriptor too)
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(name)
    return out


def _ephemeral() -> range:
    """The ports the kernel hands to a socket bound to port 0 (what gloo's listeners are)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def store_and_controller_ports(controller: str) -> set[int]:
    """The remote ports of the connections distnb and torchrun keep outside gloo: the controller's
    ZMQ endpoint (``tcp://host:port``) and the rendezvous store (MASTER_PORT)."""
    ports = set()
    try:
        port = urlsplit(controller).port
        if port:
            ports.add(port)
    except ValueError:
        pass
    for var in ("MASTER_PORT", "TORCHELASTIC_MASTER_PORT"):
        value = os.environ.get(var, "")
        if value.isdigit():
            ports.add(int(value))
    return ports


def gloo_connections(keep_ports: Iterable[int]) -> list[Connection]:
    """This process's TCP connections that are gloo pairs (see the module's docstring); none to
    or from ``keep_ports`` (the controller's, the store's)."""
    keep = set(keep_ports)
    mine = _own_sockets()
    table = _tcp_table()
    ephemeral = _ephemeral()
    # gloo's listeners: our own, bound to one address (not a wildcard) on a kernel-picked port.
    listeners = {local for inode, local, _, state in table
                 if state == _LISTEN and inode in mine and local[1] in ephemeral and not ipaddress.ip_address(local[0]).is_unspecified}
    if not listeners:
        return []
    # Ports this process serves on otherwise (a user's server, perhaps on every address): what
    # they accepted is not gloo's.
    served = {local[1] for inode, local, _, state in table if state == _LISTEN and inode in mine and local not in listeners}
    listen_ips = {ip for ip, _ in listeners}
    machine_listeners = {local for _, local, _, state in table if state == _LISTEN}
    machine_ips = {local[0] for _, local, _, _ in table} | {"127.0.0.1", "::1"}
    out = []
    for inode, local, remote, state in table:
        if state != _ESTABLISHED or inode not in mine or local[0] not in listen_ips:
            continue
        if remote[1] in keep or local[1] in keep or local[1] in served:
            continue
        if local in listeners:
            pass  # accepted by gloo's listener
        elif remote[1] not in ephemeral:
            continue  # a well-known or configured port: a service, not a peer's gloo listener
        elif remote[0] in machine_ips and remote not in machine_listeners:
            continue  # on this machine, but to no listener bound to that address: not a gloo peer
        out.append(Connection(mine[inode], inode, local, remote))
    return out


def shut_down(connections: Iterable[Connection]) -> int:
    """Shut each connection down (both directions) without closing its descriptor, which gloo
    still owns; skipped if the descriptor no longer holds that socket. Returns how many."""
    done = 0
    for conn in connections:
        try:
            if os.readlink(f"/proc/self/fd/{conn.fd}") != f"socket:[{conn.inode}]":
                continue
            sock = socket.socket(fileno=conn.fd)
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass  # already shut down or reset by the peer: closed for gloo either way
        finally:
            sock.detach()  # the descriptor stays gloo's
    return done


def open_gloo(limit: int = 3) -> str:
    """The gloo collectives of this rank not completed, in words (``all_reduce #2 on group 0``),
    oldest first; ``""`` when none (or the recorder can't be read)."""
    from distnb.worker.torch_hooks.flight_recorder import _completed, dump_recorders

    dumps, _ = dump_recorders()
    entries = [e for e in dumps.get("fr", {}).get("entries", [])
               if str(e.get("profiling_name", "")).startswith("gloo:") and not _completed(e)]
    words = [f"{str(e.get('profiling_name', '?')).split(':')[-1]} #{e.get('collective_seq_id')} on group {e['process_group'][0]}"
             for e in sorted(entries, key=lambda e: int(e["record_id"]))[:limit]]
    return ", ".join(words) + (" …" if len(entries) > limit else "")
