"""The host group (aligner.parallel.launch.host_group): a gloo group of every rank, beside the default group, in
which ranks wait for rank 0's host-side work; the critic job's command channel sends its header there and its
tensors over the default group (real processes; on GPUs the default group is NCCL)."""

from dist import run_ranks


def _channel(rank, world_size):
    import torch
    import torch.distributed as dist

    from aligner.critic.server import CommandChannel
    from aligner.parallel import host_group, initialize, shutdown

    initialize()  # the launcher's default group exists: initialize adds megatron's groups and the host group
    group = host_group()
    assert group is not None and group != dist.group.WORLD
    assert dist.get_backend(group) == "gloo" and dist.get_world_size(group) == world_size
    channel = CommandChannel(torch.device("cpu"))
    got = []
    for op in (7, 9):
        if rank == 0:
            channel.send(op, 2, 3, 0, op * 10, tensors=[torch.full((2, 3), op, dtype=torch.int64)])
            got.append((op, 2, 3, 0, op * 10, op))
        else:
            header = channel.recv()
            got.append((*header, int(channel.recv_tensor((2, 3), torch.int64).sum()) // 6))
    shutdown()
    return got, host_group() is None


def test_command_header_over_the_host_group_and_tensors_over_the_default_group():
    results = run_ranks(_channel, 2)
    assert results[0] == results[1] == ([(7, 2, 3, 0, 70, 7), (9, 2, 3, 0, 90, 9)], True)


def _host_waits(rank, world_size):
    import time

    import torch.distributed as dist

    from aligner.parallel import host_barrier, host_broadcast, host_group, initialize, shutdown

    initialize()
    group = host_group()
    # A gloo barrier on the host group alone: rank 0 enters late, so the others wait in it, and nothing of the
    # default group's sequence is used (the default group's next collective still pairs up below).
    if rank == 0:
        time.sleep(0.5)
    entered = time.monotonic()
    host_barrier()
    waited = time.monotonic() - entered
    answer = host_broadcast({"run": "abc", "from": rank} if rank == 0 else None)
    total = _sum_over_default_group(rank)
    calls = dist.get_world_size(group)
    shutdown()
    return waited, answer, total, calls


def _sum_over_default_group(rank):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t)


def test_host_barrier_and_broadcast_for_waits_on_another_ranks_files():
    """Checkpoint commits, locks, run ids and output files: ranks wait in the host group (host_barrier,
    host_broadcast) and get rank 0's object; the default group's collectives are unaffected."""
    results = run_ranks(_host_waits, 2)
    (w0, a0, s0, n0), (w1, a1, s1, n1) = results
    assert a0 == a1 == {"run": "abc", "from": 0}
    assert s0 == s1 == 3.0 and n0 == n1 == 2
    assert w1 > 0.3, "rank 1 must have waited in the barrier for rank 0"
