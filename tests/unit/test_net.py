"""Ports for rendezvous and servers (aligner.utils.net): n consecutive ports free to bind, drawn outside the kernel's
ephemeral range (where another process's outgoing connection could take one between our check and our bind), and
drawn from the OS's entropy, not from the seeded `random`."""

import random
import socket

import pytest

from aligner.utils import net


def test_ports_are_free_and_outside_the_ephemeral_range_and_the_slurm_launchers_ports():
    lo, hi = net.ephemeral_range()
    slurm_lo, slurm_hi = net.SLURM_PORTS
    room_above = 65535 - hi >= 1003  # true for the kernel's default range (32768-60999), and on this machine
    for n in (1, 3):
        base = net.free_port_range(n)
        assert all(not lo <= p <= hi for p in range(base, base + n)), (base, lo, hi)
        if room_above:
            assert all(not slurm_lo <= p <= slurm_hi for p in range(base, base + n)), base
        for port in range(base, base + n):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_returned(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(net, "_pool", lambda n: (taken - 3, taken))  # bases taken-1 and taken would need it
        monkeypatch.setattr(net, "HOLD_S", 0.0)  # every draw may repeat the last one's port
        for _ in range(20):
            base = net.free_port_range(2)
            assert base in (taken - 3, taken - 2)


def test_a_port_handed_out_is_not_handed_out_again_while_it_may_still_be_unbound(monkeypatch):
    """Two draws before either port is bound (a launcher's critic ports, then a job's rendezvous port) both find the
    same port free: the second must not get it, until HOLD_S has passed."""
    monkeypatch.setattr(net, "_all_free", lambda host, base, n: True)  # nothing is bound: only the record counts
    monkeypatch.setattr(net, "_HANDED", {})
    monkeypatch.setattr(net, "_pool", lambda n: (40000, 40001))  # two possible bases
    first = net.free_port_range(1)
    other = 80001 - first
    assert net.free_port_range(1) == other
    with pytest.raises(RuntimeError, match="no 1 consecutive free ports"):
        net.free_port_range(1, tries=50)
    monkeypatch.setattr(net, "_pool", lambda n: (40000 - n + 1, 40001))  # every base of 3 ports holds a handed one
    with pytest.raises(RuntimeError, match="no 3 consecutive free ports"):
        net.free_port_range(3, tries=50)
    monkeypatch.setattr(net, "HOLD_S", 0.0)  # the hold is over: both are drawn again
    monkeypatch.setattr(net, "_pool", lambda n: (40000, 40001))
    assert {net.free_port_range(1), net.free_port_range(1)} <= {40000, 40001}


def test_the_pool_avoids_the_slurm_launchers_ports(monkeypatch):
    """Above the ephemeral range where it leaves room; else between the launchers' ports and it; else below it."""
    monkeypatch.delenv(net.SLICE_ENV, raising=False)  # the whole pool (a pytest worker has its own part)
    for (lo, hi), first in (((32768, 60999), 61000), ((40000, 65000), 32700), ((25000, 65000), 20000)):
        monkeypatch.setattr(net, "ephemeral_range", lambda lo=lo, hi=hi: (lo, hi))
        pool = net._pool(3)
        assert pool[0] == first and pool[1] + 2 <= (65535 if first > hi else lo - 1), (lo, hi, pool)
    # the Slurm launchers' formula stays inside SLURM_PORTS
    assert 20000 + 1269 * 10 + 5 <= net.SLURM_PORTS[1] and net.SLURM_PORTS[0] == 20000


def test_seeding_random_does_not_repeat_the_draw():
    draws = set()
    for _ in range(5):
        random.seed(1234)  # every job seeds `random` alike: its ports must still differ
        draws.add(net.free_port_range(1))
    assert len(draws) > 1


def test_port_slices_are_disjoint_parts_of_the_pool(monkeypatch):
    """ALIGNER_PORT_SLICE=k/n: n concurrent drawers (pytest workers) each draw inside their own part of the pool."""
    monkeypatch.setattr(net, "ephemeral_range", lambda: (32768, 60999))
    monkeypatch.delenv(net.SLICE_ENV, raising=False)
    assert net._pool(3) == (61000, 65533)
    parts = []
    for k in range(2):
        monkeypatch.setenv(net.SLICE_ENV, f"{k}/2")
        first, last = net._pool(3)
        parts.append((first, last + 2))  # the ports the draws can take
        for _ in range(20):
            base = net.free_port_range(3)
            assert first <= base <= last
    assert parts == [(61000, 63267), (63268, 65535)]


def test_a_bad_port_slice_names_the_variable(monkeypatch):
    for value in ("2/2", "1", "a/b", "-1/2"):
        monkeypatch.setenv(net.SLICE_ENV, value)
        with pytest.raises(ValueError, match=f"{net.SLICE_ENV}=.*k/n"):
            net.free_port_range(1)
