"""Metrics reduced by name over micro-batches and ranks: one convention for the actor and the critic.

A statistic is named; its reduction is part of its name, never its position in a stacked tensor:
- `sum_by_name({name: value})` sums each name over the ranks of `group`; `max_by_name` takes the max.
- Loss statistics (`aligner.rl.losses`) are dicts per micro-batch of `tokens` (valid tokens), `<name>_sum` (sum over
  valid tokens) and `<name>_max`; `reduce_stats(list_of_dicts, group)` turns them into `<name>` = total sum / total
  tokens, `<name>_max` and `tokens`.
Values may be 0-d tensors or floats. `group=None` means no collective (aligner.rl._dist); every rank of `group` must
pass the same names. Each call makes at most one collective per reduction op, however many names there are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from aligner.rl._dist import all_reduce_, collective_device


def _reduce(values: Mapping, group, op) -> dict[str, float]:
    if not values:
        return {}
    names = sorted(values)
    t = torch.stack([torch.as_tensor(values[k], dtype=torch.float64).reshape(()).cpu() for k in names])
    t = all_reduce_(t.to(collective_device(group, values.values())), group, op=op)
    return dict(zip(names, t.tolist(), strict=True))


def sum_by_name(values: Mapping, group=None) -> dict[str, float]:
    """{name: sum over the ranks of `group`} as floats."""
    return _reduce(values, group, dist.ReduceOp.SUM)


def max_by_name(values: Mapping, group=None) -> dict[str, float]:
    """{name: max over the ranks of `group`} as floats."""
    return _reduce(values, group, dist.ReduceOp.MAX)


def reduce_stats(stats: Mapping | Sequence[Mapping], group=None) -> dict[str, float]:
    """Combine the loss statistics of several micro-batches (and of all ranks of `group`) into plain floats:
    `tokens`, `<name>` = sum / tokens (NaN with no token) and `<name>_max`."""
    if isinstance(stats, Mapping):
        stats = [stats]
    if not stats:
        return {}
    sums, maxes = {}, {}
    for s in stats:
        for k, v in s.items():
            v = torch.as_tensor(v, dtype=torch.float64)
            if k.endswith("_max"):
                maxes[k] = torch.maximum(maxes[k], v) if k in maxes else v
            else:
                sums[k] = sums[k] + v if k in sums else v
    totals = sum_by_name(sums, group)
    tokens = totals.pop("tokens", None)
    out = {"tokens": tokens}
    for key, total in totals.items():
        out[key.removesuffix("_sum")] = total / tokens if tokens else float("nan")
    out.update(max_by_name(maxes, group))
    return out
