"""Addresses and interfaces for multi-node pools (no process started)."""

from __future__ import annotations

import socket

import pytest

import distnb
from distnb.launching import network
from distnb.launching.remote_nodes import connect_host


def test_loopback_routes_and_interfaces() -> None:
    assert network.source_address("127.0.0.1") == "127.0.0.1"
    assert network.interface_of("127.0.0.1") == "lo"
    assert network.is_local("localhost") and not network.is_local("192.0.2.250")
    assert network.resolve("no-such-host.invalid") == [] and network.source_address("no-such-host.invalid") is None
    # Loopback pools keep gloo's own choice; a user's value always wins.
    assert network.socket_env("127.0.0.1", {}) == {}


def test_socket_env_pins_the_interface_of_a_real_address_unless_set() -> None:
    iface, addr = next(((i, a) for i, addrs in network.interfaces().items() for a in addrs
                        if ":" not in a and not a.startswith("127.")), (None, None))
    if addr is None:
        pytest.skip("no non-loopback IPv4 address here")
    assert network.socket_env(addr, {}) == {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}
    assert network.socket_env(addr, {"NCCL_SOCKET_IFNAME": "ib"}) == {"GLOO_SOCKET_IFNAME": iface}


def test_an_interface_this_machine_lacks_is_named_with_what_to_do() -> None:
    assert network.missing_interface({"GLOO_SOCKET_IFNAME": "lo"}) is None
    assert network.missing_interface({"NCCL_SOCKET_IFNAME": "nosuch"}) is None  # NCCL's prefixes are NCCL's business
    text = network.missing_interface({"GLOO_SOCKET_IFNAME": "nosuch0"}) or ""
    assert f"names an interface {socket.gethostname()} does not have; its interfaces: lo (127.0.0.1" in text
    assert "Drop GLOO_SOCKET_IFNAME from --env" in text


def test_a_name_that_resolves_to_loopback_is_refused_for_other_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda *a: "localhost")
    with pytest.raises(RuntimeError, match=r"this machine's name 'localhost' resolves to 127\.0\.0\.1.*Bind this machine's address"):
        connect_host(distnb.LaunchConfig(nproc=1, nnodes=2, bind="0.0.0.0"))
    assert connect_host(distnb.LaunchConfig(nproc=1, nnodes=2, bind="0.0.0.0", local_nodes=True)) == "localhost"
    assert connect_host(distnb.LaunchConfig(nproc=1, nnodes=2, bind="10.1.2.3")) == "10.1.2.3"


def test_a_port_for_another_process_is_free_and_outside_the_range_outgoing_connections_take() -> None:
    # The multi-node rendezvous' port: one the kernel hands out for bind(0) can be taken by any
    # outgoing connection (gloo opens many) before torchrun binds it.
    low, high = network._ephemeral_range()
    ports = {network.port_for_another("127.0.0.1") for _ in range(20)}
    assert all(p < low or p > high for p in ports) and len(ports) > 1, (ports, low, high)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: it binds


def test_a_port_taken_below_the_range_is_skipped_and_the_kernel_chooses_when_none_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # Only the taken port lies below the range: every try fails, and the kernel's choice comes back.
        monkeypatch.setattr(network, "_ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(network.random.SystemRandom, "randrange", lambda self, a, b: taken)
        port = network.port_for_another("127.0.0.1")
        assert port != taken and port > 0
