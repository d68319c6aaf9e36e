"""Helpers for the critic job's tests: the tiny demo-shaped models, checkpoints, a real server as a subprocess.

`ServerProcess` runs scripts/serve_ppo_critic.py (or a launcher around it) in its own session, collects its output,
waits for the one `critic server ready at URL` line, and stops it by a signal; `descendants()` lists every process
it started (tritonserver, python stubs, workers) so a test can check that none outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import torch

from aligner.config.schema import ModelConfig
from aligner.utils.net import free_port_range

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "serve_ppo_critic.py")
READY = "critic server ready at "

# The CPU demo's shape (conf/ppo_critic_demo.yaml).
TINY = dict(
    arch="llama",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=48,
    make_vocab_size_divisible_by=16,
    max_position_embeddings=128,
    params_dtype="float32",
)


def tiny_model(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def model_yaml(indent: str = "  ", **overrides) -> str:
    return "".join(f"{indent}{k}: {v}\n" for k, v in {**TINY, **overrides}.items())


def free_ports(n: int = 3) -> int:
    """A base port p with p, ..., p+n-1 free (HTTP, gRPC, metrics)."""
    return free_port_range(n)


def init_single_process() -> None:
    """A world of one in this (pytest) process, for direct forwards and checkpoints."""
    import torch.distributed as dist

    from aligner.parallel import initialize

    if not dist.is_initialized():
        initialize(1, 1, master_port=free_ports(1))
    else:
        initialize(1, 1)


def seeded_scalar_model(cfg: ModelConfig, seed: int):
    """A scalar-head GPT slice (world of one) with weights drawn from `seed` (larger than the init, so the
    outputs vary visibly between tokens)."""
    from aligner.models.gpt import build_gpt

    model = build_gpt(cfg, head="scalar")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "layernorm" in name else 0.2 * noise)
    model.eval()
    return model


def save_weights(model, root: str) -> str:
    from aligner.checkpoint import dist_ckpt

    return dist_ckpt.save(root, 0, [model])


def load_weights(cfg: ModelConfig, path: str):
    from aligner.checkpoint import dist_ckpt
    from aligner.models.gpt import build_gpt

    model = build_gpt(cfg, head="scalar")
    dist_ckpt.load_model_weights(path, [model])
    model.eval()
    return model


@torch.no_grad()
def direct_values(model, tokens_BT: torch.Tensor) -> torch.Tensor:
    """The scalar head at every position, [B, T] float32 (a plain forward, no service, no server)."""
    from aligner.models.gpt import forward

    return forward(model, tokens_BT).squeeze(-1).float()


def sample_batch(batch: int, seq: int, seed: int = 0, vocab: int = 48, min_len: int = 2):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (batch, seq), generator=gen)
    lengths = torch.randint(min_len, seq + 1, (batch,), generator=gen)
    lengths[0] = seq
    tokens[torch.arange(seq)[None, :] >= lengths[:, None]] = 0  # right padding
    return tokens, lengths


class ServerProcess:
    def __init__(
        self, args: list[str], launcher: list[str] | None = None, ignore_sigint: bool = False, env: dict | None = None
    ):
        full_env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("LD_LIBRARY_PATH", "MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")
        }
        full_env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        cmd = (launcher or [sys.executable]) + [SCRIPT, *args]

        def preexec():
            if ignore_sigint:  # what a shell does to a job started in the background
                signal.signal(signal.SIGINT, signal.SIG_IGN)

        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=preexec,
        )
        self.lines: list[str] = []
        self.url = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(READY):
                self.url = line[len(READY) :].split()[0]
                self._ready.set()
        self._ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 120.0) -> str:
        self._ready.wait(timeout)
        if self.url is None:
            self.kill()
            raise AssertionError(
                f"server not ready after {timeout} s (exit code {self.proc.poll()}):\n" + self.output[-6000:]
            )
        return self.url

    def wait_exit(self, timeout: float = 90.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit within {timeout} s:\n" + self.output[-4000:]) from None
        self._reader.join(5)
        return code

    def descendants(self):
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """Last resort for a failed test: SIGKILL the server and everything it started (by pid)."""
        for p in [*self.descendants()]:
            try:
                p.kill()
            except Exception:  # noqa: BLE001
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def triton_workspaces(procs) -> set[str]:
    """PyTriton workspace directories of the tritonserver processes among `procs`."""
    out = set()
    for p in procs:
        try:
            # the executable's path, not argv[0]: just after exec the name is already the new one while the command
            # line is still empty (the kernel sets the name first)
            exe = p.exe()
        except Exception:  # noqa: BLE001 - gone already
            continue
        if exe.endswith("/tritonserver/bin/tritonserver"):
            out.add(exe[: -len("/tritonserver/bin/tritonserver")])
    return out


def stub_model_folders(procs) -> set[str]:
    """The temporary model folders of the Triton python stubs among `procs` (a stub killed mid-unload leaves its
    folder behind)."""
    out = set()
    for p in procs:
        try:
            args = p.cmdline()
        except Exception:  # noqa: BLE001 - gone already
            continue
        if args and args[0].endswith("triton_python_backend_stub") and len(args) > 1:
            out.add(os.path.dirname(os.path.dirname(args[1])))  # <folder>/1/model.py
    return out


def alive(procs) -> list:
    """Those of `procs` (psutil.Process) still running (zombies count as gone)."""
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(procs, timeout: float = 20.0) -> list:
    deadline = time.monotonic() + timeout
    left = alive(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = alive(left)
    return left
