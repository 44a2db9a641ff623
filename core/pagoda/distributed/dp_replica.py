"""One data-parallel replica: a whole ``LLMEngine`` in its own process, fed by the front.

``python -m pagoda.distributed.dp_replica`` is started by ``DataParallelEngine``
(``pagoda.distributed.data_parallel``). It connects back to the front through a
``multiprocessing.connection`` socket (address and key in ``PAGODA_DP_ADDRESS`` /
``PAGODA_DP_AUTHKEY``), receives its engine config, builds the engine (which may itself be
tensor/pipeline parallel and start its own ranks), then serves messages:

- ``("add", request_id, prompt, prompt_token_ids, params, arrival_time)``: queue a request; an
  error is answered with ``("failed", request_id, message)``;
- ``("abort", [request ids])``, ``("stats",)`` (answered ``("stats", dict)``), ``("stop",)``;
- ``("mode", finished_only)``: what to send after each step (the server streams every output).

While it has requests it steps and sends ``("outputs", [RequestOutput | OutputDelta], stats)``
after each step (only finished requests and first tokens when the front asked for
``finished_only``; a request's outputs after its first as what is new since,
``pagoda.distributed.output_deltas``), reading the front's messages between steps.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Client

ENV_ADDRESS = "PAGODA_DP_ADDRESS"
ENV_AUTHKEY = "PAGODA_DP_AUTHKEY"
ENV_INDEX = "PAGODA_DP_INDEX"


def serve(conn, engine, finished_only: bool) -> None:
    from pagoda.distributed.output_deltas import OutputSender

    sender = OutputSender()  # each step's outputs as what is new since the last (the front rebuilds them)
    while True:
        # block for the next message when idle; between steps, only read what is there
        while not engine.has_unfinished_requests() or conn.poll(0):
            message = conn.recv()
            kind = message[0]
            if kind == "stop":
                return
            if kind == "add":
                _, rid, prompt, token_ids, params, arrival = message
                try:
                    engine.add_request(rid, prompt, params, prompt_token_ids=token_ids, arrival_time=arrival)
                except Exception as exc:  # the request's own error: the others go on
                    conn.send(("failed", rid, f"{type(exc).__name__}: {exc}"))
            elif kind == "abort":
                engine.abort_request(message[1])
                sender.forget(message[1])
            elif kind == "stats":
                conn.send(("stats", engine.get_stats()))
            elif kind == "mode":
                finished_only = message[1]
        outputs = engine.step(finished_only=finished_only)
        if outputs:
            conn.send(("outputs", sender.encode(outputs), engine.get_stats()))


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
        conn.send(("ready", engine.get_stats(), sum(p.numel() for p in model.parameters()) if model is not None else 0))
        serve(conn, engine, finished_only)
    except (EOFError, ConnectionError):  # the front went away: nothing to report to
        pass
    except BaseException as exc:  # noqa: BLE001 - reported to the front, then the process ends
        try:
            conn.send(("crashed", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        except Exception:
            pass
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
