"""Client of the critic job (used by the actor): non-blocking calls that return futures.

Contract
- `CriticClient(url, connect_timeout, infer_timeout, train_timeout, token=None, endpoints=ENDPOINTS)` (or
  `CriticClient.from_config(cfg.critic)` with an `aligner.config.critic.CriticClientConfig`); `endpoints`: the ones
  it uses and waits for (`(INFER,)` for a critic job in reward-only mode, which serves nothing else). Requests go
  out from one worker thread in the order they were submitted, so a `train_async` submitted before an `infer_async`
  reaches the server first (and the server makes that infer wait until the training is done: the next rollout sees
  the updated critic). The caller never blocks on training: it holds a Future and asks for the result when it
  needs it.
- `infer_async(tokens_BT, lengths_B, prompt_lengths_B=None, labels=None) -> Future[(values_BT, rewards_B1)]`,
  `train_async(tokens_BT, lengths_B, returns_BT, prev_values_BT, mask_BT) -> Future[dict of float metrics]`,
  `save(step, run_id) -> checkpoint path` (blocking; `save_async` returns a Future), `resume_async(step, run_id)`
  (see aligner.critic.service.CriticService.resume), `wait_ready(timeout)`. With `token` (the run's secret,
  aligner.critic.auth), every request carries it.
  Inputs are torch tensors or numpy arrays; results are CPU torch tensors (float32).
- Arguments are checked here first (CriticRequestError at the call site); errors from the server come back as
  CriticRequestError (the server's reason first); a server that does not answer within `connect_timeout` gives a
  CriticUnreachableError that names the URL and what to check.
- Who sends (actor side): one client in the whole actor job, on global rank 0 (`aligner.critic.remote.RemoteCritic`
  gathers the rows of every data-parallel slice there first and broadcasts the answers). Send the whole rollout batch
  of a step in one `critic_train` request: the critic splits each request into its own global batches, so
  per-slice requests would each be trained on as a separate batch.
"""

from __future__ import annotations

import http.client
import re
import sys
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from aligner.critic import auth, protocol
from aligner.critic.auth import load_token
from aligner.critic.protocol import CriticRequestError, Limits

# The server checks the real limits (batch, length, vocabulary); here only the structure of the request.
_LOCAL_LIMITS = Limits(
    max_batch_size=sys.maxsize, max_seq_len=sys.maxsize, vocab_size=2**62, max_train_batch_size=sys.maxsize
)


class CriticUnreachableError(ConnectionError):
    pass


def _server_reason(message: str) -> str:
    """The server's own error line out of PyTriton's wrapped traceback, if there is one."""
    found = re.findall(r"(?:CriticRequestError|RewardFunctionError|_ShuttingDown): ([^\n\\]+)", message)
    return found[-1].strip() if found else message


class CriticClient:
    def __init__(
        self,
        url: str,
        connect_timeout: float = 120.0,
        infer_timeout: float = 600.0,
        train_timeout: float = 3600.0,
        token: str | None = None,
        endpoints: tuple[str, ...] = protocol.ENDPOINTS,
    ):
        self.url = url if "://" in url else f"http://{url}"
        self.endpoints = endpoints  # the ones this client uses (and waits for): (INFER,) for a reward-only critic
        self.connect_timeout, self.infer_timeout, self.train_timeout = connect_timeout, infer_timeout, train_timeout
        # One worker: requests leave in submission order (see the module docstring).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic-client")
        self._clients = {}  # endpoint -> ModelClient; used only by the worker thread
        self._parameters = {auth.PARAMETER: token} if token else None
        self._ready = False

    @classmethod
    def from_config(cls, cfg, endpoints: tuple[str, ...] = protocol.ENDPOINTS) -> "CriticClient":
        token = load_token(cfg.token_file)
        return cls(cfg.url, cfg.connect_timeout, cfg.infer_timeout, cfg.train_timeout, token=token, endpoints=endpoints)

    # -- public API --------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every endpoint of `self.endpoints` answers; CriticUnreachableError after `timeout` (default
        connect_timeout)."""
        self._pool.submit(self._wait_ready, timeout).result()

    def infer_async(self, tokens_BT, lengths_B, prompt_lengths_B=None, labels=None) -> Future:
        tokens, lengths, prompt_lengths, labels = protocol.check_infer(
            tokens_BT, lengths_B, prompt_lengths_B, labels, _LOCAL_LIMITS
        )
        inputs = {"tokens": tokens, "lengths": lengths.reshape(-1, 1)}
        if prompt_lengths is not None:
            inputs["prompt_lengths"] = prompt_lengths.reshape(-1, 1)
        if labels is not None:
            inputs["labels"] = np.array([[(x or "").encode("utf-8")] for x in labels], dtype=object)
        return self._pool.submit(self._infer, inputs)

    def train_async(self, tokens_BT, lengths_B, returns_BT, prev_values_BT, mask_BT) -> Future:
        tokens, lengths, returns, prev_values, mask = protocol.check_train(
            tokens_BT, lengths_B, returns_BT, prev_values_BT, mask_BT, _LOCAL_LIMITS
        )
        inputs = {
            "tokens": tokens,
            "lengths": lengths.reshape(-1, 1),
            "returns": returns,
            "prev_values": prev_values,
            "mask": mask,
        }
        return self._pool.submit(self._train, inputs)

    def save_async(self, step: int, run_id: str) -> Future:
        step, run_id = protocol.check_step(step), protocol.check_run_id(run_id)
        return self._pool.submit(self._checkpoint, protocol.SAVE, step, run_id)

    def save(self, step: int, run_id: str) -> str:
        return self.save_async(step, run_id).result()

    def resume_async(self, step: int | None, run_id: str) -> Future:
        """critic_resume: run `run_id` resumes at committed `step` (None: a fresh run); Future[path or '']."""
        step = protocol.check_step(-1 if step is None else step, allow_fresh=True)
        return self._pool.submit(self._checkpoint, protocol.RESUME, step, protocol.check_run_id(run_id))

    def close(self) -> None:
        self._pool.submit(self._close_clients).result()
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    # -- worker thread -----------------------------------------------------------------------------------
    def _unreachable(self, timeout: float, reason) -> CriticUnreachableError:
        return CriticUnreachableError(
            f"cannot reach the critic server at {self.url} within {timeout:g} s ({reason}). Check: (1) is the critic "
            f"job (scripts/serve_ppo_critic.py) running, and did it print 'critic server ready at ...'? (2) are the "
            f"host and port right? The critic job listens on its server.host:server.port (default 127.0.0.1:5567, "
            f"which other machines cannot reach). (3) does the actor config's `critic` section (critic.host, "
            f"critic.port) point there?"
        )

    def _client(self, name: str):
        from pytriton.client import ModelClient
        from pytriton.client.warnings import NotSupportedTimeoutWarning

        # PyTriton warns whenever the wait-for-server timeout differs from the request timeout: expected here.
        warnings.filterwarnings("ignore", category=NotSupportedTimeoutWarning)
        if name not in self._clients:
            timeout = self.infer_timeout if name == protocol.INFER else self.train_timeout
            self._clients[name] = ModelClient(
                self.url, name, init_timeout_s=self.connect_timeout, inference_timeout_s=timeout
            )
        return self._clients[name]

    def _wait_ready(self, timeout: float | None = None) -> None:
        from pytriton.client.exceptions import PyTritonClientError

        timeout = self.connect_timeout if timeout is None else timeout
        for name in self.endpoints:
            try:
                self._client(name).wait_for_model(timeout)
            except (PyTritonClientError, OSError) as exc:
                raise self._unreachable(timeout, f"endpoint {name}: {exc}") from exc
        self._ready = True

    def _call(self, name: str, inputs: dict) -> dict:
        from pytriton.client.exceptions import (
            PyTritonClientError,
            PyTritonClientInferenceServerError,
            PyTritonClientTimeoutError,
        )

        if not self._ready:
            self._wait_ready()
        try:
            return self._client(name).infer_sample(**inputs, parameters=self._parameters)
        except PyTritonClientInferenceServerError as exc:
            reason = _server_reason(str(exc))
            if "is not healthy" in reason:  # Triton's python backend: the endpoint's stub did not run for ~1 s
                reason += (
                    " (the critic job's Triton python stub for this endpoint stopped responding: a frozen or "
                    "starved process on the critic's host; Triton does not recover from this: the "
                    "endpoint's next request brings tritonserver down and the critic job exits 1; see its "
                    "log and docs/CRITIC.md)"
                )
            raise CriticRequestError(f"{name} at {self.url} rejected the request: {reason}") from exc
        except PyTritonClientTimeoutError as exc:
            if "Connection refused" in str(exc):  # PyTriton reports a server that went away as a timeout
                self._ready = False
                raise self._unreachable(self.connect_timeout, f"{name}: connection refused") from exc
            timeout, key = (
                (self.infer_timeout, "infer_timeout")
                if name == protocol.INFER
                else (self.train_timeout, "train_timeout")
            )
            raise TimeoutError(
                f"{name} at {self.url} did not answer within {timeout:g} s (critic.{key}): the "
                f"server is up but busy or stuck; see the critic job's log"
            ) from exc
        except (PyTritonClientError, OSError, http.client.HTTPException) as exc:  # the last: a dropped connection
            self._ready = False
            raise self._unreachable(self.connect_timeout, f"{name}: {exc!r}") from exc

    def _infer(self, inputs: dict):
        out = self._call(protocol.INFER, inputs)
        return torch.from_numpy(out["values"].copy()), torch.from_numpy(out["rewards"].copy())

    def _train(self, inputs: dict) -> dict[str, float]:
        out = self._call(protocol.TRAIN, inputs)
        return {k: float(out[k].reshape(-1)[0]) for k in protocol.TRAIN_METRICS}

    def _checkpoint(self, endpoint: str, step: int, run_id: str) -> str:
        inputs = {"step": np.array([step], dtype=np.int64), "run_id": np.array([run_id.encode()], dtype=object)}
        out = self._call(endpoint, inputs)
        path = out["path"].reshape(-1)[0]
        return path.decode() if isinstance(path, bytes) else str(path)

    def _close_clients(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
