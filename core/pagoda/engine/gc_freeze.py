"""Keeping Python's cyclic garbage collector off the serving path."""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move every object start-up made (modules, the Python side of parameters, graphs,
    configs) out of the cyclic collector's view (``gc.freeze``), after collecting what is
    already garbage. Collections then scan only what serving allocates: on a 2-core CPU a full
    collection otherwise cost about 4 ms of an 8,192-token prefill step's host time, time the
    device waits for."""
    gc.collect()
    gc.freeze()
