"""Host arrays to the device without waiting for the device.

A copy from pageable host memory may wait for all the work queued before it on the stream
(inside a model's first layer, or the whole previous step when the engine launches steps
ahead); from pinned memory it is queued like a kernel. The device's platform pins
(``Platform.pin``; the CPU's copies need nothing). Used for each step's inputs (``pagoda.engine.inputs``) and by kernels
that build per-step index tensors on the host (pagoda-cuda's prefill tile maps).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch


def upload(array: np.ndarray, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``array`` (optionally converted to ``dtype``) on ``device``, copied without waiting."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None:
        host = host.to(dtype)
    return _pin_for(getattr(device, "type", device))(host).to(device, non_blocking=True)


@cache
def _pin_for(device_type: str):
    from pagoda.errors import PluginError
    from pagoda.selection import platform_of  # (imported here: selection loads the plugins, which load kernels)

    try:
        return platform_of(device_type).pin
    except PluginError:  # no platform's device ("meta" in tests): nothing to pin
        return lambda host: host
