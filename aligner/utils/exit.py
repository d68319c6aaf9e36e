"""`exit_after_main(code)`: how a job script ends its process once `main()` has returned.

What is alive then lives until the exit, so it is moved out of the garbage collector's view first (`gc.freeze`): the
interpreter's collections at exit would otherwise walk every object of torch, megatron-core and the models once more
(1.9 s of a CPU-demo actor's exit on two cores, 0.2 s frozen), and a launcher or the next job waits for that.
Destructors, atexit handlers and the flushing of files still run as in a plain `sys.exit`.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_after_main(code: int | None) -> NoReturn:
    gc.freeze()
    sys.exit(code)
