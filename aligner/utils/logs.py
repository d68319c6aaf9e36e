"""Job logging: one `setup_logging(level)` for every entry script; records of ranks other than 0 are kept only from
ERROR up, so a message that every rank logs alike appears once (a rank's own error still shows)."""

from __future__ import annotations

import logging


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_RankZeroFilter())
    for noisy in ("megatron", "pytriton"):  # their INFO lines (bucket layouts, client patches) drown the job's own
        logging.getLogger(noisy).setLevel(logging.WARNING)
