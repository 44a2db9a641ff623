"""The worker processes rank 0 starts on this machine, and a watch on each of them.

Workers are fresh interpreters (``python -m pagoda.engine.executor.worker_main``), not forks:
the engine's process may hold CUDA contexts and threads, and a fresh interpreter needs no
``if __name__ == "__main__"`` guard in the user's script. They share the parent's terminal
and environment (so ``CUDA_VISIBLE_DEVICES``, ``PAGODA_PLUGINS`` and the log level carry
over) but not torchrun's variables.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from pagoda.distributed.process_group import ENV_VARS
from pagoda.engine.executor.worker_main import ENV_RANK, ENV_STORE, ENV_WORLD

_LAUNCHER_VARS = ENV_VARS + ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


class LocalWorkers:
    def __init__(self, world_size: int, store_address: str):
        self.procs: dict[int, subprocess.Popen] = {}
        self.stopping = False
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
        env.update({ENV_WORLD: str(world_size), ENV_STORE: store_address})
        for rank in range(1, world_size):
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", "pagoda.engine.executor.worker_main"],
                                                env={**env, ENV_RANK: str(rank)})

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def exited(self) -> dict[int, int]:
        """{rank: return code} of the workers that have ended."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def watch(self, on_exit: Callable[[int, int], None]) -> None:
        """Call ``on_exit(rank, returncode)`` from a thread when a worker ends before ``stop``."""
        for rank, proc in self.procs.items():
            def wait(rank=rank, proc=proc) -> None:
                code = proc.wait()
                if not self.stopping:
                    on_exit(rank, code)

            threading.Thread(target=wait, name=f"pagoda-watch-rank{rank}", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the workers to leave (after STOP), then terminate, then kill what is left."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
