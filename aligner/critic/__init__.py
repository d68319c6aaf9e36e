"""The critic job: value model + reward behind PyTriton, and the client the actor uses.

- `protocol`: endpoint names (`critic_infer`, `critic_train`, `critic_save`), tensors, request validation.
- `service.CriticService`: the logic as a plain SPMD class (testable without a server).
- `reward_fn`: rewards from a user's Python function on decoded text.
- `server`: the PyTriton binding on rank 0 and the command loop of the other ranks.
- `client.CriticClient`: non-blocking calls returning futures.
- `remote.RemoteCritic`: the critic job as every rank of the actor job sees it (who sends, answers broadcast).
Importing this package loads neither megatron nor PyTriton: the service and the transport load when used.
"""

from aligner.critic.client import CriticClient, CriticUnreachableError
from aligner.critic.protocol import ENDPOINTS, INFER, SAVE, TRAIN, TRAIN_METRICS, CriticRequestError

__all__ = [
    "CriticClient",
    "CriticUnreachableError",
    "CriticRequestError",
    "ENDPOINTS",
    "INFER",
    "TRAIN",
    "SAVE",
    "TRAIN_METRICS",
]
