"""One data-parallel replica: a whole ``LLMEngine`` in its own process, fed by the front.

``python -m pagoda.distributed.dp_replica`` is started by ``DataParallelEngine``
(``pagoda.distributed.data_parallel``). It connects back to the front through a
``multiprocessing.connection`` socket (address and key in ``PAGODA_DP_ADDRESS`` /
``PAGODA_DP_AUTHKEY``), receives its engine config, builds the engine (which may itself be
tensor/pipeline parallel and start its own ranks), then serves messages:

- ``("add", request_id, prompt, prompt_token_ids, params, arrival_time, lora_request, images)``: queue a
  request (``images``: the front's processed ``MultiModalInputs`` in ``for_transfer``'s form, or None); an
  error is answered with ``("failed", request_id, message)``;
- ``("lora", "load" | "remove", LoRARequest | adapter id)``: answered ``("done", None | the refusal)``;
- ``("abort", [request ids])``, ``("stats",)`` (answered ``("stats", dict)``, also sent unasked when an abort
  leaves the replica idle), ``("stop",)``;
- ``("mode", finished_only)``: what to send after each step (the server streams every output).

While it has requests it steps and sends ``("outputs", [RequestOutput | delta], stats or None)``
after each step (only finished requests and first tokens when the front asked for
``finished_only``; a request's outputs after its first as what is new since,
``pagoda.distributed.output_deltas``), reading the front's messages between steps.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Client

ENV_ADDRESS = "PAGODA_DP_ADDRESS"
ENV_AUTHKEY = "PAGODA_DP_AUTHKEY"
ENV_INDEX = "PAGODA_DP_INDEX"
STATS_INTERVAL_S = 0.05  # while streaming, the engine's stats go with its outputs at most this often


def serve(conn, engine, finished_only: bool) -> None:
    from pagoda.distributed.output_deltas import OutputSender, is_finished
    from pagoda.multimodal.inputs import arrived

    sender = OutputSender()  # each step's outputs as what is new since the last (the front rebuilds them)
    engine.completion.build_output = sender.output_of  # the deltas made from the requests, not from outputs
    stats_sent = 0.0
    while True:
        # block for the next message when idle; between steps, only read what is there
        while not engine.has_unfinished_requests() or conn.poll(0):
            message = conn.recv()
            kind = message[0]
            if kind == "stop":
                return
            if kind == "add":
                _, rid, prompt, token_ids, params, arrival, lora_request, images = message
                try:
                    engine.add_request(rid, prompt, params, prompt_token_ids=token_ids, arrival_time=arrival,
                                       lora_request=lora_request, mm_inputs=arrived(images) if images else None)
                except Exception as exc:  # the request's own error: the others go on
                    conn.send(("failed", rid, f"{type(exc).__name__}: {exc}"))
            elif kind == "lora":
                conn.send(("done", _lora(engine, message[1], message[2])))
            elif kind == "abort":
                engine.abort_request(message[1])
                sender.forget(message[1])
                if not engine.has_unfinished_requests():  # idle now: no step will send stats, so they go here
                    conn.send(("stats", engine.get_stats()))
            elif kind == "stats":
                conn.send(("stats", engine.get_stats()))
            elif kind == "mode":
                finished_only = message[1]
        outputs = engine.step(finished_only=finished_only)
        if outputs:
            # stats (for the front's load balance and /metrics) at most every STATS_INTERVAL_S while streaming,
            # and whenever a request ends: not every step, where they cost as much as the outputs' pickling
            now = time.monotonic()
            fresh = now - stats_sent >= STATS_INTERVAL_S or any(map(is_finished, outputs))
            if fresh:
                stats_sent = now
            conn.send(("outputs", sender.encode(outputs), engine.get_stats() if fresh else None))


def _lora(engine, op: str, arg) -> str | None:
    """Load (a LoRARequest) or remove (an adapter id) a LoRA adapter; the refusal's message, or None."""
    from pagoda.lora.peft_format import LoRAError

    try:
        engine.load_lora(arg) if op == "load" else engine.remove_lora(arg)
    except LoRAError as exc:
        return str(exc)
    return None


def _travels(exc: BaseException) -> bool:
    """Whether the exception comes back whole through pickle (else the front gets its message only)."""
    import pickle

    try:
        back = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - e.g. an __init__ whose arguments are not the exception's args
        return False
    return type(back) is type(exc) and str(back) == str(exc)


def _choices(engine) -> str | None:
    """What the engine chose where the platform chooses for the user (the CPU: threads, step budget), for
    the front to print as ``pagoda serve`` does for an engine of its own."""
    if engine.platform.name != "cpu" or getattr(engine, "runner", None) is None:
        return None
    from pagoda.cli.serve import cpu_choices

    return cpu_choices(engine)


def main() -> int:
    from pagoda.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine

    logging.basicConfig(level=os.environ.get("PAGODA_LOG_LEVEL", "WARNING").upper(),
                        format="%(levelname)s %(name)s[replica %(process)d]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front handles Ctrl-C and stops the replicas
    host, _, port = os.environ[ENV_ADDRESS].rpartition(":")
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[ENV_AUTHKEY]))
    engine = None
    try:
        conn.send(("hello", int(os.environ[ENV_INDEX]), os.getpid()))
        config_json, finished_only = conn.recv()
        engine = LLMEngine(EngineConfig.model_validate_json(config_json))
        model = getattr(engine.runner, "model", None)
        params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        from pagoda.distributed.replicas import PoolingView

        conn.send(("ready", engine.get_stats(), params, _choices(engine), PoolingView.of(engine)))
        serve(conn, engine, finished_only)
    except (EOFError, ConnectionError):  # the front went away: nothing to report to
        pass
    except BaseException as exc:  # noqa: BLE001 - reported to the front, then the process ends
        from pagoda.errors import PagodaError

        # an error the user can fix (a config key, a model that does not load, a plugin) goes back as it is: the
        # front raises it and `pagoda serve` prints its message, as with the engine in the server's process
        named = exc if isinstance(exc, PagodaError) and engine is None and _travels(exc) else None
        try:
            conn.send(("crashed", f"{type(exc).__name__}: {exc}", traceback.format_exc(), named))
        except Exception:
            pass
        if named is None:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if engine is not None:
            engine.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
