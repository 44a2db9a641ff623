"""The control plane: rank 0 tells the other ranks what to run next, over torch.distributed.

Every message is two broadcasts from rank 0 on the gloo control group: a fixed header
``[kind, payload length, mode, argument]`` (int64) and the payload — int64 words for a model step
(``pagoda.engine.executor.step_codec``), pickled bytes for a call. Calls that return something
gather one pickled result per rank back to rank 0.
"""

from __future__ import annotations

import enum
import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pagoda.engine.step_plan import ARGMAX, ON_HOST


class Kind(enum.IntEnum):
    STEP = 1  # run the model on a step (payload: an encoded StepPlan; mode: StepMode)
    CALL = 2  # call a runner method (payload: pickled (name, args, kwargs)); results gathered
    STOP = 3  # leave the loop


class StepMode(enum.IntEnum):
    """What a STEP message asks of the other ranks: ``runner.launch`` with the ``how`` its name ends with (the
    same launch rank 0 makes: ``StepMode.of``/``how``), or ``runner.forward_all_logits`` (scoring)."""

    LAUNCH_ON_HOST = 0  # rank 0 collects and samples: nothing to collect on the others
    ALL_LOGITS = 1
    # the step pipeline; argument: k, the rows fed from the previous launch's tokens, whose (rows, indices) are
    # the payload's last 2k words; each rank feeds its own previous launch's tokens (every rank holds the same
    # full logits, so the same argmax)
    LAUNCH_ARGMAX = 2

    @classmethod
    def of(cls, how: str) -> StepMode:
        """The mode of a launch whose tokens are chosen ``how`` (ON_HOST or ARGMAX)."""
        return _LAUNCHES[how]

    @property
    def how(self) -> str:
        """A launch mode's ``how`` (ON_HOST or ARGMAX)."""
        return _HOWS[self]


_LAUNCHES = {ON_HOST: StepMode.LAUNCH_ON_HOST, ARGMAX: StepMode.LAUNCH_ARGMAX}
_HOWS = {mode: how for how, mode in _LAUNCHES.items()}


class ControlChannel:
    def __init__(self, group: Any, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._header = torch.zeros(4, dtype=torch.int64)

    # ------------------------------------------------------------------ rank 0
    def send(self, kind: Kind, payload: torch.Tensor | None = None, mode: int = 0, arg: int = 0) -> None:
        n = 0 if payload is None else payload.numel()
        self._header[0], self._header[1], self._header[2], self._header[3] = int(kind), n, mode, arg
        dist.broadcast(self._header, src=0, group=self.group)
        if n:
            dist.broadcast(payload, src=0, group=self.group)

    def send_words(self, words: np.ndarray, mode: int, arg: int = 0) -> None:
        self.send(Kind.STEP, torch.from_numpy(words), mode, arg)

    def send_call(self, name: str, args: tuple, kwargs: dict) -> None:
        data = pickle.dumps((name, args, kwargs))
        self.send(Kind.CALL, torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def gather_results(self, own: Any) -> list[Any]:
        """Rank 0's own result first, then ranks 1..N-1 in order."""
        out: list[Any] = [None] * self.world_size
        dist.gather_object(own, out, dst=0, group=self.group)
        return out

    def close(self) -> None:
        """Let go of the control group (``destroy_parallel_state`` then frees it, see there)."""
        self.group = None

    # ------------------------------------------------------------------ ranks > 0
    def receive(self) -> tuple[Kind, int, int, Any]:
        """(kind, mode, argument, payload): payload is the int64 numpy array of a step or the
        unpickled (name, args, kwargs) of a call."""
        dist.broadcast(self._header, src=0, group=self.group)
        kind, n, mode, arg = (int(v) for v in self._header.tolist())
        kind = Kind(kind)
        if kind is Kind.STOP:
            return kind, mode, arg, None
        dtype = torch.int64 if kind is Kind.STEP else torch.uint8
        payload = torch.empty(n, dtype=dtype)
        if n:
            dist.broadcast(payload, src=0, group=self.group)
        if kind is Kind.STEP:
            return kind, mode, arg, payload.numpy()
        return kind, mode, arg, pickle.loads(payload.numpy().tobytes())

    def send_result(self, result: Any) -> None:
        dist.gather_object(result, None, dst=0, group=self.group)
