"""Ranks 1..N-1: build this rank's shard of the model, then run what rank 0 sends until it stops.

``serve_rank`` is the loop (used by pagoda's own worker processes and by torchrun ranks > 0);
``python -m pagoda.engine.executor.worker_main`` is the entry of a worker that rank 0 started on
this machine: it reads its rank and the address of rank 0's store from
``PAGODA_WORKER_RANK``/``PAGODA_WORKER_WORLD_SIZE``/``PAGODA_WORKER_STORE`` and the engine
config from the store. Any exception is fatal: reported to rank 0 through the store, then
the process exits, which makes rank 0's pending collective fail.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import numpy as np

from pagoda.engine.executor.control import ControlChannel, Kind, StepMode
from pagoda.engine.executor.step_codec import decode_plan
from pagoda.engine.gc_freeze import freeze_startup_objects
from pagoda.engine.pipeline import StepFeed
from pagoda.engine.step_plan import ARGMAX
from pagoda.kernels.host_upload import upload

logger = logging.getLogger("pagoda")

ENV_RANK = "PAGODA_WORKER_RANK"
ENV_WORLD = "PAGODA_WORKER_WORLD_SIZE"
ENV_STORE = "PAGODA_WORKER_STORE"
CONFIG_KEY, PLATFORM_KEY, DTYPE_KEY = "pagoda/config", "pagoda/platform", "pagoda/dtype"
READY_KEY = "pagoda/ready/{rank}"


class NoSampling:
    """The sampler of ranks > 0: rank 0 chooses the tokens (and keeps the prompt logprobs), the others only run
    their shard (they never collect a step's tokens)."""

    def prompt_logprobs(self, logits, seq, first) -> dict:
        return {}

    def forget(self, seq_id: int) -> None:
        pass


def _feed(launched, fed, k: int):
    """This rank's StepFeed: its own tokens of the previous launch, at the rows rank 0 sent."""
    if launched is None:
        raise RuntimeError("a step fed from the previous launch's tokens, but no step was launched before it")
    host = np.asarray(fed, dtype=np.int64).reshape(2, k)
    both = upload(host, launched.tokens.device)
    return StepFeed(launched.tokens, both[0], both[1], host)


def serve_rank(runner: Any, channel: ControlChannel) -> None:
    """Run steps and calls from rank 0 until it sends STOP."""
    runner.sampler = NoSampling()
    launched = None  # the last ARGMAX launch's PendingStep (its tokens feed the next launch's pending rows)
    stepping = False
    while True:
        kind, mode, arg, payload = channel.receive()
        if kind is Kind.STOP:
            return
        if kind is Kind.STEP:
            if not stepping:  # set-up is over (weights, cache, graphs): as rank 0 does
                freeze_startup_objects()
                stepping = True
            fed = None
            if arg:  # the fed rows' (rows, indices) end the payload (LAUNCH_ARGMAX)
                fed, payload = payload[len(payload) - 2 * arg:], payload[:len(payload) - 2 * arg]
            plan = decode_plan(payload)
            mode = StepMode(mode)
            if mode is StepMode.ALL_LOGITS:
                runner.forward_all_logits(plan)
            else:  # the launch rank 0 made (ON_HOST: rank 0 chooses the tokens, nothing to collect here)
                pending = runner.launch(plan, None if fed is None else _feed(launched, fed, arg), how=mode.how)
                if mode.how == ARGMAX:
                    launched = pending
        else:
            name, args, kwargs = payload
            channel.send_result(getattr(runner, name)(*args, **kwargs))


def main() -> int:
    import torch.distributed as dist

    from pagoda.config import EngineConfig
    from pagoda.distributed.process_group import RankInfo, init_parallel_state
    from pagoda.engine.executor.failures import report_failure
    from pagoda.engine.executor.rank_runner import build_rank_runner
    from pagoda.loader.model_loader import load_config
    from pagoda.loader.source import resolve_source
    from pagoda.selection import select_platform

    logging.basicConfig(level=os.environ.get("PAGODA_LOG_LEVEL", "WARNING").upper(),
                        format="%(levelname)s %(name)s[rank %(process)d]: %(message)s")
    # Ctrl-C reaches the whole terminal process group: rank 0 handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, world = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
    host, _, port = os.environ[ENV_STORE].rpartition(":")
    store = None
    try:
        store = dist.TCPStore(host, int(port), world, is_master=False)
        config = EngineConfig.model_validate_json(store.get(CONFIG_KEY))
        platform = select_platform(store.get(PLATFORM_KEY).decode())
        dtype = store.get(DTYPE_KEY).decode()
        source = resolve_source(config.model, config.revision, config.download_dir)
        hf_config = load_config(source)
        info = RankInfo(rank, world, rank, world, "pagoda")
        store.set(READY_KEY.format(rank=rank), "1")
        channel = init_parallel_state(config, platform, info, store=store)
        runner = build_rank_runner(config, source, hf_config, platform, dtype, info)
        serve_rank(runner, ControlChannel(channel, rank, world))
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the process ends
        report_failure(store, rank, exc)
        sys.stderr.flush()
        os._exit(1)  # no teardown: the group is broken and rank 0 is told by the exit
    # Rank 0 said STOP: leave without a collective teardown (it may block once rank 0 has gone
    # ahead); ending the process releases the devices and the communicators.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
