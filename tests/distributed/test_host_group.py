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
