"""The critic job: value model + reward behind PyTriton, and the client the actor uses.

- `protocol`: endpoint names (`critic_infer`, `critic_train`, `critic_save`, `critic_resume`), tensors, request
  validation; `auth`: the run's shared secret.
- `service.CriticService`: the logic as a plain SPMD class (testable without a server).
- `reward_fn`: rewards from a user's Python function on decoded text.
- `server`: the PyTriton binding on rank 0 and the command loop of the other ranks.
- `client.CriticClient`: non-blocking calls returning futures.
- `remote.RemoteCritic`: the critic job as every rank of the actor job sees it (who sends, answers broadcast).
Importing this package loads no torch, megatron or PyTriton (launchers import `auth` from it): `CriticClient` and
`CriticUnreachableError` load the client module when first used.
"""

from aligner.critic.protocol import ENDPOINTS, INFER, RESUME, SAVE, TRAIN, TRAIN_METRICS, CriticRequestError

__all__ = [
    "CriticClient",
    "CriticUnreachableError",
    "CriticRequestError",
    "ENDPOINTS",
    "INFER",
    "TRAIN",
    "SAVE",
    "RESUME",
    "TRAIN_METRICS",
]


def __getattr__(name: str):
    if name in ("CriticClient", "CriticUnreachableError"):
        from aligner.critic import client

        return getattr(client, name)
    raise AttributeError(f"module 'aligner.critic' has no attribute {name!r}")
