"""A client's side of the engine process: the HTTP process's, or one API server's of several."""

import asyncio
import time
from collections.abc import Callable

from tokenspeed.server.channel import FrameProtocol, FrameSocket, connect
from tokenspeed.server.engine_process import EngineProcess
from tokenspeed.api.messages import Abort, EngineFailed, EngineInfo, Finish, Heartbeat, StepReport, Submit

HEARTBEAT_TIMEOUT_S = 1.0    # five beats missed: the engine process is stopped or hung


class EngineClient:
    """Sends the engine work, hands each report to ``on_report`` and ``on_exit(message)``
    once if the engine goes away unasked (its process exited, or its loop failed), both
    on the event loop that ``listen`` ran on; everything else is called on that loop too.
    ``process``: the engine process, where this process owns it."""

    def __init__(self, channel: FrameSocket, info: EngineInfo, on_report: Callable[[StepReport], None],
                 on_exit: Callable[[str], None], process: EngineProcess | None = None):
        self.info, self.on_report, self.on_exit, self.process = info, on_report, on_exit, process
        self._channel = channel
        self._protocol: FrameProtocol | None = None
        self._stopping = self._gone = False

    async def listen(self) -> None:
        """Hand the channel to the running event loop (reports sent meanwhile wait in it).
        The event loop reads it itself: a reader thread handing reports to a busy loop
        waited for the interpreter lock (up to its 5 ms switch interval) at every report,
        the socket filled, and the engine stalled on its sends (served throughput fell by
        a third, at random)."""
        if self._protocol is None and not self._stopping:
            self._protocol = await connect(self._channel.sock, self._receive, self._closed, self._channel.decoder)

    @property
    def alive(self) -> bool:
        return self._protocol is not None and not self._gone and (self.process is None or self.process.alive)

    def responsive(self, within: float = HEARTBEAT_TIMEOUT_S) -> bool:
        """Alive, and heard from (a report or a heartbeat) within the last ``within`` seconds."""
        return self.alive and time.monotonic() - self._protocol.last_heard < within

    def exit_message(self) -> str:
        code = "" if self.process is None else f" (code {self.process.exitcode})"
        return f"the engine process exited{code}"

    def submit(self, key: int, prompt, params, at_end: bool = False) -> None:
        """Queue a checked prompt; its updates will carry ``key`` (the caller's, unique);
        ``at_end``: only once a completion ends (``EngineCore.add``). ``OSError`` once the
        channel has closed."""
        self._sender().send(Submit(key, prompt, params, 0, at_end))   # the engine's relay sets the client

    def abort(self, key: int) -> None:
        self._sender().send(Abort(key, 0))

    def finish(self, key: int, index: int) -> None:
        """Completion ``index`` of ``key`` is final here (a stop string ended it): the
        engine ends it too."""
        self._sender().send(Finish(key, index, 0))

    async def stop(self) -> None:
        """Close this client's end (the engine drops its requests); stop the engine
        process too, if owned, without holding up the event loop."""
        self._stopping = True
        if self._protocol is not None:
            self._protocol.transport.close()
        else:
            self._channel.close()
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)

    def _sender(self) -> FrameProtocol:
        if self._protocol is None or self._gone:
            raise OSError("the engine's channel is closed")
        return self._protocol

    def _receive(self, record) -> None:
        if type(record) is StepReport:
            self.on_report(record)
        elif type(record) is EngineFailed:   # the loop failed: nothing more will come
            self._leave(record.message)
            self._protocol.transport.close()
        elif type(record) is not Heartbeat:
            raise TypeError(f"unexpected record from the engine process: {type(record).__name__}")

    def _closed(self) -> None:
        if not self._gone and self.process is not None:
            self.process.reap()   # its exit code, for the message
        self._leave(self.exit_message())

    def _leave(self, message: str) -> None:
        if not self._gone:
            self._gone = True
            if not self._stopping:
                self.on_exit(message)
