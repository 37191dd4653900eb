"""Free ports for servers and rendezvous started a moment later (`tokenmill/ports.py`)."""

from __future__ import annotations

import socket

from tokenmill.ports import ephemeral_ports, free_ports


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert not set(ports) & set(ephemeral_ports())  # no outgoing connection is given one of them
    with socket.socket() as s:  # and each is free: bound here now
        s.bind(("127.0.0.1", ports[0]))
