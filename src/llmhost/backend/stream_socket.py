"""The engine socket: a Unix socket per model instance, served on the engine's own
event loop, through which the gateway on the same host streams generations.

Triton's decoupled response path costs one synchronous round trip from the Python
stub to tritonserver per response, then the gRPC hop; on a GPU host under load
that bunched many engine steps into one streamed event (docs/performance.md). On
this socket each engine step is one line, written by the engine loop itself the
moment vLLM hands the step out. Triton keeps its own HTTP and gRPC API, unchanged.

Where: ``$LLMHOST_ENGINE_SOCKET_DIR/<model>/<version>-<instance>.sock`` (folder
0750, socket 0660: the gateway reads it through the group, nobody else can). Without that
variable the backend serves no socket.

Protocol, one request per connection, UTF-8 JSON lines:

- the client sends ``{"inputs": {name: value}, "parameters": {...}, "id": "..."}``:
  the backend's inputs (``text_input`` or ``messages``, ``sampling_parameters``,
  the BOOL inputs, ``image`` a list of base64 text) and the request parameters, the
  same that Triton's request carries, validated by the same ``parse_request``;
- the backend answers one line per response, ``{"outputs": {name: [values]},
  "final": bool, "t": unix time}``, with the outputs of Triton's responses
  (``outputs.response_outputs``), or one error line ``{"error": message,
  "kind": "invalid" | "unavailable" | "internal"}`` (unavailable: the model is
  stopping or its engine died; retry elsewhere);
- hanging up cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmhost.backend.config import BackendSettings
from llmhost.backend.engine import Active, Chunk, EngineRunner
from llmhost.backend.errors import RequestError, safe_message
from llmhost.backend.failures import ENGINE_DEAD, ENGINE_ERROR, INVALID_REQUEST, SHUTTING_DOWN, SHUTTING_DOWN_MESSAGE
from llmhost.backend.lora import find_adapter
from llmhost.backend.metrics import RESPONSE_DELAY
from llmhost.backend.outputs import response_outputs
from llmhost.backend.request import BOOL_INPUTS, PROMPT_TOKEN_IDS, client_id, client_label, parse_request

SOCKET_DIR_ENV = "LLMHOST_ENGINE_SOCKET_DIR"
# The largest request line: a prompt at the largest max_prompt_bytes, JSON-escaped,
# or a few images (the gateway's own body limit is lower).
MAX_REQUEST_BYTES = 64 * 1024 * 1024
# Connections waiting to be accepted: asyncio's default (100) refused connections when
# 256 streams started at once.
LISTEN_BACKLOG = 4096
# Error kinds on the line, by vllm:request_failed_total's reason.
KINDS = {INVALID_REQUEST: "invalid", SHUTTING_DOWN: "unavailable", ENGINE_DEAD: "unavailable"}
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def error_line(message: str, reason: str) -> bytes:
    """The line that ends a request with an error; REASON is vllm:request_failed_total's label."""
    return _encode({"error": message, "kind": KINDS.get(reason, "internal")}).encode("utf-8", "surrogatepass") + b"\n"


def socket_path(directory: Path, model: str, version: str, instance: str) -> Path:
    """Where one model instance's socket lives."""
    return directory / model / f"{version}-{instance}.sock"


def make_socket_folder(path: Path) -> None:
    """The folders of the socket PATH (the sockets', the model's), 0750."""
    for folder in (path.parent.parent, path.parent):
        folder.mkdir(mode=0o750, exist_ok=True)
        os.chmod(folder, 0o750)  # whatever the umask (the unit's is 0077): the group must get in


def request_inputs(raw: dict[str, Any]) -> dict[str, Any]:
    """The line's inputs in parse_request's shape (one-element lists; ``image`` and
    ``prompt_token_ids`` lists)."""
    inputs: dict[str, Any] = {}
    for name, value in raw.items():
        if name == PROMPT_TOKEN_IDS:
            inputs[name] = value
        elif name == "image":
            inputs[name] = value if isinstance(value, list) else [value]
        elif value is not None:
            if name in BOOL_INPUTS and not isinstance(value, bool):
                raise RequestError(f"input '{name}' must be a BOOL, got {value!r}")
            inputs[name] = [value]
    return inputs


class SocketSink:
    """One request's responses, written as lines by the engine loop itself."""

    __slots__ = ("active", "counted", "flags", "server", "writer")

    def __init__(self, writer: asyncio.StreamWriter, flags: frozenset[str], server: StreamSocketServer) -> None:
        self.writer = writer
        self.flags = flags
        self.server = server  # its delays are observed into the metrics in batches
        self.counted = False
        self.active: Active | None = None

    def _write(self, line: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(line)

    def send(self, chunk: Chunk) -> None:
        outputs = response_outputs(chunk, self.flags, self.counted)
        self.counted = self.counted or "num_input_tokens" in outputs
        line = _encode({"outputs": outputs, "final": chunk.final, "t": time.time()}).encode("utf-8", "surrogatepass")
        # Counted before the write: once written, the client may have it (and a test
        # reading the metrics may look) before this thread goes on.
        self.server.delays.append(time.monotonic() - chunk.made)
        self._write(line + b"\n")

    def fail(self, message: str, reason: str = ENGINE_ERROR) -> None:
        self._write(error_line(message, reason))

    def cancelled(self) -> None:
        """The client hung up: nobody is left to answer."""


class StreamSocketServer:
    """Serves one model instance's engine socket on the engine's loop."""

    def __init__(self, runner: EngineRunner, settings: BackendSettings, path: Path,
                 log: Callable[[str], None], adapters: Any = None) -> None:
        self.runner = runner
        self.settings = settings
        self.path = path
        self.log = log
        self.adapters = adapters
        self.delays: list[float] = []
        self._server: asyncio.AbstractServer | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    # -- lifecycle (any thread) ------------------------------------------------
    def open(self) -> bool:
        """Bind the socket (from Triton's thread); False, logged, when it cannot be."""
        try:
            self._prepare()
        except OSError as exc:
            self.log(f"engine socket {self.path} not served: {exc}")
            return False
        done: asyncio.Future[Any] = asyncio.run_coroutine_threadsafe(self._start(), self.runner.loop())
        try:
            done.result(timeout=30)
        except Exception as exc:  # noqa: BLE001 - the model serves through Triton without it
            self.log(f"engine socket {self.path} not served: {exc}")
            return False
        self.log(f"engine socket {self.path} serving")
        return True

    def close(self) -> None:
        """Stop accepting and remove the socket (requests in flight go on; the runner drains them)."""
        loop = self.runner.loop()
        if self._server is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._stop(), loop).result(timeout=10)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _prepare(self) -> None:
        """The folder (0750) and no socket left at the path; a live one (another
        instance of this name) is not taken over."""
        make_socket_folder(self.path)
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise FileExistsError(f"{self.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink()  # left by a process that is gone
            return
        finally:
            probe.close()
        raise FileExistsError(f"{self.path} is served by another process")

    async def _start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_REQUEST_BYTES,
                                                       backlog=LISTEN_BACKLOG)
        os.chmod(self.path, 0o660)
        self._flusher = asyncio.create_task(self._flush_delays())

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._flusher is not None:
            self._flusher.cancel()
            self._flush()

    async def _flush_delays(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self._flush()

    def _flush(self) -> None:
        delays, self.delays = self.delays, []  # on the engine's loop, as the sinks that append to it
        if delays:
            self.runner.metrics.observe(RESPONSE_DELAY, delays)

    # -- one connection (the engine's loop) ----------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away before its request was whole
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _refuse(self, writer: asyncio.StreamWriter, message: str, reason: str) -> None:
        self.runner.metrics.inc("vllm:request_failed_total", label=reason)
        writer.write(error_line(message, reason))

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            self._refuse(writer, f"the request is larger than {MAX_REQUEST_BYTES} bytes", INVALID_REQUEST)
            return
        runner = self.runner
        if not runner.accepting:
            dead = runner.engine_dead_message()
            self._refuse(writer, dead or SHUTTING_DOWN_MESSAGE,
                         ENGINE_DEAD if dead else SHUTTING_DOWN)
            return
        cid = ""
        try:
            request = json.loads(line)
            if not isinstance(request, dict) or not isinstance(request.get("inputs"), dict):
                raise RequestError("the request line must be a JSON object with an 'inputs' object")
            cid = client_id(str(request.get("id") or ""))
            params = request.get("parameters") or {}
            if not isinstance(params, dict):
                raise RequestError("'parameters' must be a JSON object")
            job = parse_request(request_inputs(request["inputs"]), params, self.settings, runner.limits)
            job.client_id = cid
            if job.lora_name is not None:
                find_adapter(job.lora_name, self.adapters)
        except ValueError as exc:  # RequestError is one; json's errors too
            message = str(exc) if isinstance(exc, RequestError) else f"the request line is not JSON: {exc}"
            self._refuse(writer, safe_message(message), INVALID_REQUEST)
            return
        except Exception as exc:  # noqa: BLE001 - no exception may reach a client with its traceback
            self.log(f"a request ({client_label(cid)}) on the engine socket failed: {type(exc).__name__}: {exc}")
            self._refuse(writer, f"internal error: {type(exc).__name__}; the server log has the details",
                         ENGINE_ERROR)
            return
        sink = SocketSink(writer, job.returns(), self)
        active = runner.submit_here(job, sink)
        task = active.task
        assert task is not None
        hangup = asyncio.ensure_future(reader.read(1))  # b"" (or an error) when the client hangs up
        try:
            await asyncio.wait((task, hangup), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
            await asyncio.wait((task,))
            if not writer.is_closing():
                await writer.drain()
        finally:
            hangup.cancel()
