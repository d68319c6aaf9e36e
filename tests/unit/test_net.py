"""Ports for rendezvous and servers (aligner.utils.net): n consecutive ports free to bind, drawn outside the kernel's
ephemeral range (where another process's outgoing connection could take one between our check and our bind), and
drawn from the OS's entropy, not from the seeded `random`."""

import random
import socket

from aligner.utils import net


def test_ports_are_free_and_outside_the_ephemeral_range():
    lo, hi = net.ephemeral_range()
    for n in (1, 3):
        base = net.free_port_range(n)
        assert all(not lo <= p <= hi for p in range(base, base + n)), (base, lo, hi)
        for port in range(base, base + n):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_returned(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(net, "_pool", lambda n: (taken - 3, taken))  # bases taken-1 and taken would need it
        for _ in range(20):
            base = net.free_port_range(2)
            assert base in (taken - 3, taken - 2)


def test_seeding_random_does_not_repeat_the_draw():
    draws = set()
    for _ in range(5):
        random.seed(1234)  # every job seeds `random` alike: its ports must still differ
        draws.add(net.free_port_range(1))
    assert len(draws) > 1
