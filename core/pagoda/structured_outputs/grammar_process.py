"""xgrammar's matchers in a process of their own, so that their work holds no GIL the engine needs.

On a GPU the engine's host work is what bounds a busy server, and a constrained step added two kinds of it to
the engine process: each sampled token's accept (xgrammar's native call, a few us a row, on the engine thread)
and the next masks' fill, whose worker thread takes the GIL back from the engine thread to start and to end
(docs/benchmarks.md: a py-spy profile of the server on an H100). Here the matchers live in a child process:
the engine thread only queues each accepted token, sends one message a step (``fill_ahead``: the tokens
since the last message, then the rows to fill) and later reads the reply; the child accepts, fills the
rows into shared memory (``_SharedRows``: a file under /dev/shm both processes map) and says which rows allow
no token and which tokens its grammar refused. Used where the engine key ``structured_outputs_process`` says
(default: on platforms whose steps run ahead of the host, i.e. GPUs; docs/serving.md).

    client = GrammarProcess(tokenizer_info_json, batch_threads)
    matcher = RemoteMatcher(client, shipped, stop_ids, words)   # shipped: a compiled grammar's JSON, sent once
    matcher.accept(token)                          # queued; a refusal comes back with the next reply
    job = client.fill_ahead(matchers, turn)         # after a step: accepts, then the fill, in the child
    bitmask, none_left = job.result()              # before the sampler reads the rows
    client.fill_now(matchers, bitmask, rows)       # rows the step needs now (a new request's first mask)

A token the grammar refuses cannot happen through the mask, short of a bug; it is found one reply later and
marks its matcher (``error``): the next fill of that matcher raises it, and the sampler fails its request.
"""

from __future__ import annotations

import itertools
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from pagoda.structured_outputs.backends import GrammarMatcher, _place
from pagoda.structured_outputs.mask_ahead import none_left

ENV_FD = "PAGODA_GRAMMAR_FD"  # the child's end of the socket pair


class ShippedGrammar:
    """A compiled xgrammar grammar as the child receives it (``CompiledGrammar.serialize_json``): sent with
    the first matcher made from it, dropped in the child when this object goes."""

    _ids = itertools.count()

    def __init__(self, text: str):
        self.text = text
        self.gid = next(self._ids)


class RemoteMatcher(GrammarMatcher):
    """A sequence's matcher in the grammar process: accepts are queued, fills asked of the child (``client``:
    ``backends.prepared_fill`` and ``MaskAhead.start`` look for it)."""

    def __init__(self, client: GrammarProcess, grammar: ShippedGrammar, stop_token_ids: set[int], words: int):
        super().__init__(stop_token_ids)
        self.client, self.words = client, words  # words: bitmask words of the tokenizer's ids
        self.slot = client.new_matcher(grammar)
        weakref.finalize(self, client.free, self.slot)

    def _accept(self, token: int) -> bool:
        self.client.accepts.append((self, token))
        return True  # (a refusal comes back with the next reply: ``error``)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.client.fill_now([self], bitmask, [row])


class GrammarProcess:
    """The engine's side of the child: messages out in order, replies read in the same order."""

    def __init__(self, tokenizer_info: str, batch_threads: int | str = "auto"):
        # a fresh interpreter, not a fork (the engine's process holds threads and device contexts) nor
        # multiprocessing's spawn (which reruns the user's script without an ``if __name__`` guard)
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "pagoda.structured_outputs.grammar_process"],
                                      env={**os.environ, ENV_FD: str(theirs.fileno())}, pass_fds=[theirs.fileno()])
        theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self._conn.send((tokenizer_info, batch_threads))
        except OSError as exc:
            raise self._gone(exc) from None
        self._slots = itertools.count()
        self._grammars: set[int] = set()  # gids of the grammars the child has
        self._new: list[tuple] = []  # ("grammar", gid, text) / (slot, gid) to send with the next message
        self._freed: deque[int] = deque()  # slots, and -1 - gid of grammars, that are gone (any thread appends)
        self.accepts: list[tuple[RemoteMatcher, int]] = []  # since the last message
        self._jobs: deque[_RemoteJob] = deque()  # sent, reply not read yet
        self._buffers: dict[int, _SharedRows] = {}  # 0, 1: turns of the fills ahead; 2: fills now
        self._lock = threading.Lock()  # messages go out from the engine thread, or a test's
        self.error: Exception | None = None  # the child is gone
        self._closer = weakref.finalize(self, _close, self._conn, self._proc, self._buffers)

    # ------------------------------------------------------------------ bookkeeping (engine thread)
    def new_matcher(self, grammar: ShippedGrammar) -> int:
        if grammar.gid not in self._grammars:
            self._grammars.add(grammar.gid)
            self._new.append(("grammar", grammar.gid, grammar.text))
            weakref.finalize(grammar, self._forget, grammar.gid)
        slot = next(self._slots)
        self._new.append((slot, grammar.gid))
        return slot

    def free(self, slot: int) -> None:
        self._freed.append(slot)

    def _forget(self, gid: int) -> None:
        self._grammars.discard(gid)
        self._freed.append(-1 - gid)

    # ------------------------------------------------------------------ fills
    def fill_ahead(self, matchers: list[RemoteMatcher], turn: int, pin: Callable | None = None) -> _RemoteJob:
        """Send the queued accepts and a fill of ``matchers``' next masks into buffer ``turn`` (0 or 1);
        the rows of ``job.result()`` follow ``matchers``' order. ``pin``: ``Platform.pin_in_place``, to
        page-lock a new buffer with (the rows then go to the device without a copy: ``job.pinned``)."""
        return self._send(matchers, turn, pin)

    def fill_now(self, matchers: list[RemoteMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill ``bitmask[rows]`` for ``matchers`` now (waits for the child); the ids past the tokenizer's,
        where ``bitmask`` is wider, forbidden. Raises a matcher's refused token or the child's error."""
        for matcher in matchers:
            if matcher.error is not None:
                raise matcher.error
        part, _ = self._send(matchers, 2).result()
        for matcher in matchers:  # (refusals found by this very reply)
            if matcher.error is not None:
                raise matcher.error
        _place(bitmask, rows, part)

    def _send(self, matchers: list[RemoteMatcher], buffer: int, pin: Callable | None = None) -> _RemoteJob:
        with self._lock:
            if self.error is not None:
                raise self.error
            words = matchers[0].words
            rows = self._rows(buffer, len(matchers), words, pin)
            new, self._new = self._new, []
            freed = [self._freed.popleft() for _ in range(len(self._freed))]
            accepts, self.accepts = self.accepts, []
            message = (new, freed, [(m.slot, t) for m, t in accepts], (rows.key, rows.path), words,
                       [m.slot for m in matchers])
            job = _RemoteJob(self, rows, rows.view(len(matchers), words), accepts)
            try:
                self._conn.send(message)
            except OSError as exc:
                raise self._gone(exc) from None
            self._jobs.append(job)
            return job

    def _rows(self, buffer: int, count: int, words: int, pin: Callable | None) -> _SharedRows:
        rows = self._buffers.get(buffer)
        if rows is None or rows.capacity < count * words:  # (a smaller one's rows stay mapped while in use)
            if rows is not None:  # (unpinned: every copy from its rows was waited for, two steps ago at least)
                rows.close()
            rows = self._buffers[buffer] = _SharedRows(max(count, 64) * words, pin)
        return rows

    def _read(self, job: _RemoteJob) -> None:
        """Read replies up to ``job``'s (they come in the order of the messages)."""
        with self._lock:
            while not job.done:
                if self.error is not None:
                    raise self.error
                first = self._jobs.popleft()
                try:
                    reply = self._conn.recv()
                except (EOFError, OSError) as exc:
                    raise self._gone(exc) from None
                first.finish(reply)

    def _gone(self, exc: BaseException) -> Exception:
        try:
            code = self._proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        self.error = RuntimeError(f"the grammar process (structured_outputs_process) is gone (exit code {code}: "
                                  f"{exc or type(exc).__name__})")
        return self.error

    def close(self) -> None:
        self._closer()


class _RemoteJob:
    """One message's reply: the filled rows (a view of shared memory, valid until that buffer's next fill),
    which of them allow no token, and the refusals among the accepts it carried."""

    def __init__(self, client: GrammarProcess, rows: _SharedRows, bitmask: torch.Tensor, accepts: list):
        self.client, self.rows, self.bitmask, self.accepts = client, rows, bitmask, accepts
        self.pinned = rows.pinned  # (else the upload pins a copy)
        self.done = False
        self.none_left: list[bool] = []
        self.failure: str | None = None

    def finish(self, reply: tuple) -> None:
        refused, self.none_left, self.failure = reply
        self.rows.remove()  # (the child has mapped it by now: nothing is left in /dev/shm if a process is killed)
        for i in refused:
            matcher, token = self.accepts[i]
            matcher.error = RuntimeError(f"the structured-output grammar refused token {token}")
        self.accepts, self.done = None, True

    def result(self) -> tuple[torch.Tensor, list[bool]]:
        if not self.done:
            self.client._read(self)
        if self.failure is not None:
            raise RuntimeError(f"the grammar process could not fill the masks: {self.failure}")
        return self.bitmask, self.none_left


class _SharedRows:
    """int32 words in a file under /dev/shm (the system's temporary folder where there is none), mapped by
    both processes; the file is removed once the child has mapped it (both keep their mappings). ``pin``
    (``Platform.pin_in_place``): page-locked in the engine's process, where the platform can."""

    _keys = itertools.count()

    def __init__(self, words: int, pin: Callable | None = None):
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="pagoda-grammar-", dir=folder)
        try:
            os.ftruncate(fd, words * 4)
            self._map = mmap.mmap(fd, words * 4)
        finally:
            os.close(fd)
        self.capacity = words
        self._words = torch.frombuffer(self._map, dtype=torch.int32)
        self._removed = False
        self.key = next(self._keys)  # (the child's key for its mapping: a path may come again once removed)
        self._unpin = pin(self._words) if pin is not None else None
        self.pinned = self._unpin is not None

    def view(self, rows: int, words: int) -> torch.Tensor:
        return self._words[:rows * words].view(rows, words)

    def close(self) -> None:
        """Unpinned (before its memory may go) and removed."""
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin()
        self.remove()

    def remove(self) -> None:
        if not self._removed:
            self._removed = True
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _close(conn: Connection, proc: subprocess.Popen, buffers: dict) -> None:
    try:
        conn.send(None)
    except OSError:
        pass
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    conn.close()
    for rows in buffers.values():
        rows.close()


# ---------------------------------------------------------------------------- the child
def _serve(conn: Connection) -> None:
    """The grammar process: per message, learn new grammars and matchers, forget what is gone, accept the
    queued tokens, fill the asked rows; reply (refused accepts' indices, rows allowing no token, a failure)."""
    import xgrammar as xgr

    tokenizer_info, batch_threads = conn.recv()
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
    batch = xgr.BatchGrammarMatcher(max_threads=batch_threads)
    grammars, matchers, maps = {}, {}, {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        new, freed, accepts, (key, path), words, slots = message
        failure = None
        try:  # (what is new first: a matcher made and dropped between two messages is then dropped too)
            for entry in new:
                if entry[0] == "grammar":
                    grammars[entry[1]] = xgr.CompiledGrammar.deserialize_json(entry[2], info)
                else:
                    matchers[entry[0]] = xgr.GrammarMatcher(grammars[entry[1]])
        except Exception as exc:  # noqa: BLE001 - reported with the reply
            failure = f"{type(exc).__name__}: {exc}"
        for slot in freed:
            if slot < 0:
                grammars.pop(-1 - slot, None)
            else:
                matchers.pop(slot, None)
        refused = []
        for i, (slot, token) in enumerate(accepts):
            matcher = matchers.get(slot)
            if matcher is None or not matcher.accept_token(token):
                refused.append(i)
        empty = []
        if failure is None:
            try:
                if key not in maps:
                    with open(path, "r+b") as f:
                        maps[key] = torch.frombuffer(mmap.mmap(f.fileno(), 0), dtype=torch.int32)
                rows = maps[key][:len(slots) * words].view(len(slots), words)
                batch.batch_fill_next_token_bitmask([matchers[s] for s in slots], rows)
                empty = none_left(rows)
            except Exception as exc:  # noqa: BLE001 - reported with the reply
                failure = f"{type(exc).__name__}: {exc}"
        conn.send((refused, empty, failure))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's Ctrl-C is the engine's to handle; EOF ends this)
    _serve(Connection(int(os.environ[ENV_FD])))
