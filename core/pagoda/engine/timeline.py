"""When the device works and when it waits, step by step (``pagoda bench throughput --profile``).

The step pipeline (``pagoda.engine.pipeline``) marks each step it launches: a mark before the
launch and one after it. On a device that queues work (CUDA) a mark is an event in the step's
stream (``Platform.record_event``), so the first completes when the device reaches the step
(when the previous work is done, or when the host launched it if the device was idle) and the
second when the step's work is done; on synchronous devices a mark is the host clock. From the marks: each step's device
time and the device's idle time before it, which is host time the pipeline did not hide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StepTimeline:
    platform: object  # pagoda.interfaces.Platform
    steps: list = field(default_factory=list)  # (kind, tokens, begin mark, end mark)
    origin: object = None
    closing: object = None

    @property
    def events(self) -> bool:
        return self.platform.supports_async_steps

    def mark(self):
        return self.platform.record_event(timing=True) if self.events else time.perf_counter()

    def start(self) -> None:
        self.origin = self.mark()

    def stop(self) -> None:
        self.closing = self.mark()

    def add(self, out, begin, end) -> None:
        kind = "decode" if out.num_decodes == len(out.scheduled) else "prefill"
        self.steps.append((kind, out.num_batched_tokens, begin, end))

    def _ms(self, mark) -> float:
        if self.events:
            return self.origin.elapsed_time(mark)
        return (mark - self.origin) * 1e3

    def summary(self, top: int = 5) -> dict:
        """Milliseconds from ``start`` to ``stop``: device time per step kind, idle time before
        the first step, between steps (by the kinds on either side) and after the last one."""
        if self.events:
            self.closing.synchronize()
        wall = self._ms(self.closing)
        busy: dict[str, list] = {}
        idle: dict[str, float] = {}
        gaps = []
        previous_end, previous_kind = 0.0, "start"
        for i, (kind, tokens, begin, end) in enumerate(self.steps):
            b, e = self._ms(begin), self._ms(end)
            gap = max(0.0, b - previous_end)
            between = f"{previous_kind} -> {kind}"
            idle[between] = idle.get(between, 0.0) + gap
            gaps.append((gap, i, between))
            entry = busy.setdefault(kind, [0, 0, 0.0])
            entry[0] += 1
            entry[1] += tokens
            entry[2] += e - max(b, previous_end)
            previous_end, previous_kind = max(previous_end, e), kind
        idle[f"{previous_kind} -> end"] = max(0.0, wall - previous_end)
        return {"wall_ms": wall,
                "busy_ms": {k: {"steps": n, "tokens": t, "ms": ms} for k, (n, t, ms) in busy.items()},
                "idle_ms": idle,
                "largest_gaps_ms": [[round(g, 3), i, where] for g, i, where in sorted(gaps, reverse=True)[:top]]}
