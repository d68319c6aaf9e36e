"""The run's shared secret between the actor job and the critic job.

The critic's endpoints change its state (critic_train, critic_save, critic_resume), so a process that can reach its
port must not be able to use them without the run's secret. The launchers generate one secret per run
(`new_token()`) and give it to both jobs in the environment variable `ALIGNER_CRITIC_TOKEN` (never on a command
line, which `ps` shows); a job started by hand may instead name a file holding it (`server.token_file` for the
critic, `critic.token_file` for the actor; the file should be readable by its owner only).

Rules (CriticServer checks them): with a secret, every request must carry it as the request parameter `token`
(compared in constant time); without one the critic job starts only when it listens on a loopback address, where
only processes of this machine can reach it.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket

TOKEN_ENV = "ALIGNER_CRITIC_TOKEN"
PARAMETER = "token"


class AuthError(ValueError):
    pass


def new_token() -> str:
    return secrets.token_hex(24)


def load_token(token_file: str | None) -> str | None:
    """The secret from `token_file` if given, else from ALIGNER_CRITIC_TOKEN, else None."""
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise AuthError(f"token file {token_file!r} cannot be read ({exc.strerror})") from exc
        if not token:
            raise AuthError(f"token file {token_file!r} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def is_loopback(host: str) -> bool:
    """True when `host` (a name or address) resolves only to loopback addresses."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def authorised(parameters: dict | None, token: str | None) -> bool:
    """Whether a request's parameters carry the secret (always True without one)."""
    if token is None:
        return True
    given = (parameters or {}).get(PARAMETER)
    return isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())
