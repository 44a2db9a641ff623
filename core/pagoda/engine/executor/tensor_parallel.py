"""The engine's runner when a model spans several ranks, and how the run starts.

``create_executor`` is what ``LLMEngine`` calls: with ``tensor_parallel_size: 1`` (and no
torchrun) it returns a plain ``ModelRunner`` — today's path, nothing in between. Otherwise
it starts or joins the ranks (``pagoda.distributed.process_group``) and rank 0 gets a
``TensorParallelExecutor``: the same interface as the runner (``launch``/``collect``,
``forward_all_logits``, ``allocate_kv_cache``, ``capture_graphs``, ``forget``, and rank 0's runner
attributes such as ``model``, ``graphs`` and ``expert_counts``; a runner method it does not know
raises instead of running on rank 0 alone). Each step, rank 0 broadcasts the step's plan, then
runs its own shard; every rank runs the same ``ModelRunner.launch`` and meets the others in the
layers' collectives; only rank 0 chooses tokens (ARGMAX steps of the step pipeline: every rank
takes the argmax of the same gathered logits, so that each can feed the next step its own copy).

A failed rank stops the engine with a ``WorkerError`` naming the rank and its exception (or
how its process ended); the executor then tears the run down, and later calls raise the
same error. Under torchrun, ranks > 0 never return from ``create_executor``: they serve
rank 0 until it stops, then leave the process (``SystemExit``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.distributed import parallel_state
from pagoda.distributed.process_group import (
    RankInfo,
    abort_parallel_state,
    check_world,
    destroy_parallel_state,
    init_parallel_state,
    launcher_env,
)
from pagoda.engine.executor.control import ControlChannel, Kind, StepMode
from pagoda.engine.executor.failures import (
    WorkerError,
    describe_exit,
    exception_summary,
    is_communication_error,
    read_failure,
    release_frames,
    report_failure,
)
from pagoda.engine.executor.rank_runner import build_rank_runner
from pagoda.engine.executor.step_codec import encode_plan
from pagoda.engine.step_plan import ARGMAX, ON_HOST
from pagoda.errors import ConfigError
from pagoda.interfaces import Platform

logger = logging.getLogger("pagoda")
STARTUP_TIMEOUT_S = 600.0  # for workers to import torch and reach the rendezvous
FAILURE_GRACE_S = 5.0  # after a failed collective, how long to wait for the culprit's report or exit
# Runner methods that only read rank 0's state (anything else must go through the executor).
LOCAL_METHODS = frozenset({"spec_summary", "kv_bytes_per_token", "kv_layer_bytes", "bytes_per_block",
                           "kv_cache_dtype"})


def create_executor(config: EngineConfig, source: Any, hf_config: Any, platform: Platform, dtype: str) -> Any:
    info = launcher_env()
    if config.expert_placement and not (config.enable_expert_parallel and config.tensor_parallel_size > 1):
        raise ConfigError(f"expert_placement {config.expert_placement!r} places experts on expert-parallel ranks: "
                          f"it needs enable_expert_parallel and tensor_parallel_size > 1")
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1 and info is None:
        from pagoda.engine.model_runner import ModelRunner

        device = platform.device(0)
        platform.set_device(0)
        torch.manual_seed(config.seed)
        if parallel_state.get_tp_size() == 1 and parallel_state.get_pipeline_stage()[1] == 1:
            return ModelRunner(config, source, hf_config, platform, dtype, device)
        with parallel_state.single_process():  # a tensor-parallel engine also lives in this process
            return ModelRunner(config, source, hf_config, platform, dtype, device)
    check_world(config, platform, info)
    if info is None:
        return _start_local_run(config, source, hf_config, platform, dtype)
    return _join_launched_run(config, source, hf_config, platform, dtype, info)


# ---------------------------------------------------------------------------- starting
def _start_local_run(config, source, hf_config, platform, dtype) -> TensorParallelExecutor:
    from pagoda.engine.executor.local_workers import LocalWorkers
    from pagoda.engine.executor.worker_main import CONFIG_KEY, DTYPE_KEY, PLATFORM_KEY, READY_KEY

    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if dist.is_initialized():  # before starting anything: the group in place belongs to someone else
        raise ConfigError("torch.distributed is already initialised in this process (another tensor-parallel "
                          "engine?): one tensor-parallel engine per process; shut the other down first "
                          "(LLM.shutdown())")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    # a hub model is fetched once, by rank 0 (already done): the workers read its local copy
    local = config.model_copy(update={"model": str(source.path)}) if getattr(source, "repo_id", None) else config
    store.set(CONFIG_KEY, local.model_dump_json())
    store.set(PLATFORM_KEY, platform.name)
    store.set(DTYPE_KEY, dtype)
    workers = LocalWorkers(world, f"127.0.0.1:{store.port}")
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        keys = [READY_KEY.format(rank=r) for r in range(1, world)]
        while not store.check(keys):
            exited = workers.exited()
            if exited:
                rank, code = min(exited.items())
                report = read_failure(store, rank)
                raise WorkerError(f"tensor-parallel worker rank {rank} (pid {workers.pid(rank)}) "
                                  f"{describe_exit(code)} while starting" + (f": {report}" if report else ""),
                                  [rank])
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel workers did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        info = RankInfo(0, world, 0, world, "pagoda")
        control = init_parallel_state(config, platform, info, store=store)
        runner = build_rank_runner(config, source, hf_config, platform, dtype, info)
    except BaseException:
        workers.stop(timeout=0.0)
        destroy_parallel_state()
        raise
    return TensorParallelExecutor(runner, _Run(ControlChannel(control, 0, world), store, workers,
                                               platform.dist_backend, config.tensor_parallel_size))


def _join_launched_run(config, source, hf_config, platform, dtype, info: RankInfo) -> Any:
    control = init_parallel_state(config, platform, info)
    store = _default_store()
    channel = ControlChannel(control, info.rank, info.world_size)
    if info.rank == 0:
        try:
            runner = build_rank_runner(config, source, hf_config, platform, dtype, info)
        except BaseException:
            destroy_parallel_state()
            raise
        return TensorParallelExecutor(runner, _Run(channel, store, None, platform.dist_backend,
                                                   config.tensor_parallel_size))
    from pagoda.engine.executor.worker_main import serve_rank

    try:
        serve_rank(build_rank_runner(config, source, hf_config, platform, dtype, info), channel)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this rank leaves
        report_failure(store, info.rank, exc)
        os._exit(1)
    channel.close()
    destroy_parallel_state()
    logger.info("rank %d: rank 0 stopped the run; leaving", info.rank)
    raise SystemExit(0)


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API: without it, failures are reported without the peer's exception
        return None


# ---------------------------------------------------------------------------- the run
class _Run:
    """What the executor shares with the watch threads and its finalizer (never the executor
    itself, so that dropping the engine tears the run down)."""

    def __init__(self, channel: ControlChannel, store: Any, workers: Any, backend: str, tp_size: int = 1):
        self.channel, self.store, self.workers, self.backend = channel, store, workers, backend
        self.world_size = channel.world_size
        self.tp_size = tp_size  # ranks per pipeline stage (global rank = stage x tp_size + tensor rank)
        self.exits: dict[int, int] = {}  # ranks whose process ended unexpectedly -> return code
        self.error: WorkerError | None = None
        self.closed = False
        self.lock = threading.RLock()
        if workers is not None:
            workers.watch(self.on_worker_exit)

    def on_worker_exit(self, rank: int, code: int) -> None:
        self.exits[rank] = code
        if self.backend != "gloo":  # gloo notices the closed sockets; NCCL would wait for ever
            abort_parallel_state()

    def failed_ranks(self) -> dict[int, str]:
        """{rank: what happened} from the reports in the store and the local exit codes."""
        found: dict[int, str] = {}
        exited = dict(self.exits)
        if self.workers is not None:
            exited.update(self.workers.exited())
        for rank in range(1, self.world_size):
            report = read_failure(self.store, rank)
            code = exited.get(rank)
            if report is None and code is None:
                continue
            details = [f"pid {self.workers.pid(rank)}"] if self.workers is not None else []
            if self.world_size > self.tp_size:  # pipeline parallel: name the stage too
                details.append(f"pipeline stage {rank // self.tp_size} of {self.world_size // self.tp_size}, "
                               f"tensor rank {rank % self.tp_size}")
            who = f"rank {rank}" + (f" ({'; '.join(details)})" if details else "")
            found[rank] = f"{who} raised {report}" if report else f"{who} {describe_exit(code)}"
        return found

    def close(self, graceful: bool = True) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if graceful and self.error is None and not self.exits:
                try:
                    self.channel.send(Kind.STOP)
                except Exception:
                    graceful = False
            if self.workers is not None:
                self.workers.stop(timeout=10.0 if graceful else 0.0)
            self.channel.close()
            destroy_parallel_state()


def _secondary(text: str) -> bool:
    """A report that only says the rank lost its peers (not the root cause)."""
    low = text.lower()
    return any(w in low for w in ("distbackenderror", "distnetworkerror", "connection closed", "connection reset",
                                  "broken pipe"))


class TensorParallelExecutor:
    """Rank 0's runner for a model split over ``world_size`` ranks (see the module docstring)."""

    def __init__(self, driver: Any, run: _Run):
        self.driver = driver
        self.run = run
        self.world_size = run.world_size
        self._finalizer = weakref.finalize(self, run.close)

    # ------------------------------------------------------------------ the runner's interface
    # ON_DEVICE steps are not launched here: the other ranks could not feed the next step the tokens
    # rank 0 drew (the step pipeline then runs such steps one at a time)
    launch_modes = frozenset({ARGMAX, ON_HOST})

    @torch.inference_mode()
    def launch(self, plan, feed=None, how: str = ON_HOST):
        """Every rank launches the step (graphs or eager). ARGMAX steps (the step pipeline,
        ``pagoda.engine.pipeline``): fed rows take each rank's own tokens of the previous launch, which
        agree because every rank argmaxes the same gathered logits."""
        if how not in self.launch_modes:
            raise ValueError(f"a tensor-parallel step cannot choose its tokens {how!r}")
        words = encode_plan(plan)
        k = 0 if feed is None else feed.host.shape[1]
        if k:
            words = np.concatenate([words, feed.host.reshape(-1)])
        with self._collective("a model step"):
            self.run.channel.send_words(words, StepMode.of(how), k)
            return self.driver.launch(plan, feed, how=how)

    def collect(self, pending):
        with self._collective("a model step"):
            return self.driver.collect(pending)

    @torch.inference_mode()
    def forward_all_logits(self, plan) -> torch.Tensor:
        words = encode_plan(plan)
        with self._collective("scoring a prompt"):
            self.run.channel.send_words(words, StepMode.ALL_LOGITS)
            return self.driver.forward_all_logits(plan)

    def allocate_kv_cache(self) -> int:
        """Every rank allocates the same number of blocks: the least any rank can hold."""
        num_blocks = min(self.call("available_kv_blocks"))
        self.call("allocate_kv_cache", num_blocks)
        return num_blocks

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, step_tokens: int | None = None) -> None:
        self.call("capture_graphs", max_num_seqs, max_model_len, step_tokens)

    def forget(self, seq_id: int) -> None:
        self.driver.forget(seq_id)

    @property
    def sampler(self):
        """Rank 0 samples (the other ranks run their shard)."""
        return self.driver.sampler

    def call(self, name: str, *args, **kwargs) -> list[Any]:
        """Run ``runner.<name>(*args, **kwargs)`` on every rank; the results, rank 0's first."""
        with self._collective(f"{name}()"):
            self.run.channel.send_call(name, args, kwargs)
            own = getattr(self.driver, name)(*args, **kwargs)
            return self.run.channel.gather_results(own)

    def worker_pid(self, rank: int) -> int:
        """The process id of a worker this process started (tests, diagnostics)."""
        if self.run.workers is None:
            raise ValueError("the ranks were started by torchrun, not by this process")
        return self.run.workers.pid(rank)

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (also done when the engine is dropped).

        Captured graphs hold the collectives of this group: they are released, and the device
        drained, before the communicators go (not left to the interpreter's exit)."""
        self.driver.graphs = None
        try:
            self.driver.platform.synchronize()
        except Exception:  # a broken device or group: tear down anyway
            pass
        self._finalizer()

    def __getattr__(self, name: str) -> Any:
        driver = self.__dict__.get("driver")
        if driver is None:
            raise AttributeError(name)
        value = getattr(driver, name)
        if callable(value) and hasattr(value, "__self__") and value.__self__ is driver \
                and name not in LOCAL_METHODS:
            raise AttributeError(f"ModelRunner.{name}() would run on rank 0 only; under tensor parallelism "
                                 f"it must go through TensorParallelExecutor (pagoda.engine.executor.tensor_parallel)")
        return value

    # ------------------------------------------------------------------ failures
    def _collective(self, what: str):
        return _Collective(self, what)

    def _check(self, what: str) -> None:
        run = self.run
        if run.error is not None:
            raise WorkerError(str(run.error), run.error.ranks)
        if run.closed:
            raise WorkerError("this tensor-parallel engine was shut down; create a new one")
        if run.exits:
            self._fail(None, what)

    def _fail(self, exc: BaseException | None, what: str) -> None:
        """Tear the run down and raise the error that explains ``exc`` (or a worker's death)."""
        run = self.run
        communication = exc is None or is_communication_error(exc)
        deadline = time.monotonic() + (FAILURE_GRACE_S if communication else 0.0)
        found = run.failed_ranks()
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
            found = run.failed_ranks()
        if found:
            ordered = sorted(found.items(), key=lambda kv: (_secondary(kv[1]), kv[0]))
            kind = "pipeline-parallel" if run.world_size > run.tp_size else "tensor-parallel"
            error = WorkerError(f"{kind} worker failed during {what}: "
                                + "; ".join(text for _, text in ordered)
                                + ". The engine has stopped; create a new one.", [r for r, _ in ordered])
        elif communication:
            error = WorkerError(f"lost contact with the other ranks during {what}: {exception_summary(exc)}. "
                                f"The engine has stopped; create a new one.")
        else:
            error = None  # rank 0's own error: the others wait in a collective, so the run is over too
        run.error = error or WorkerError(f"rank 0 failed during {what}: {exception_summary(exc)}; the engine "
                                         f"has stopped")
        if exc is not None:
            release_frames(exc)  # (so that closing the run frees the failed collective's group now)
        run.close(graceful=False)
        if error is None:
            raise exc
        raise error from exc


class _Collective:
    """``with``: check the run is healthy, hold its lock, turn failures into WorkerError."""

    def __init__(self, executor: TensorParallelExecutor, what: str):
        self.executor, self.what = executor, what

    def __enter__(self) -> None:
        self.executor.run.lock.acquire()
        try:
            self.executor._check(self.what)
        except BaseException:
            self.executor.run.lock.release()
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if isinstance(exc, Exception) and not isinstance(exc, WorkerError):
                self.executor._fail(exc, self.what)
            elif exc is not None and not isinstance(exc, Exception):  # e.g. Ctrl-C between collectives
                run = self.executor.run
                run.error = WorkerError(f"interrupted during {self.what}; the engine has stopped")
                run.close(graceful=False)
        finally:
            self.executor.run.lock.release()
        return False
