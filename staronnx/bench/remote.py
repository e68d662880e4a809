"""``staronnx sweep --url``: the sweep's open-loop points driven over the network, through tritonclient.

    rows = remote_sweep("plan/", "http://127.0.0.1:8000", [50, 100], spec=SweepSpec(out_dir="wire/"))

The same :func:`~staronnx.bench.sweep.sweep`, with a ``staronnx serve`` between the generator
and the runtime: :class:`RemoteRuntime` is the model as a client sees it (warm-up batches are
sent whole), :class:`RemoteServer` replaces :class:`~staronnx.serving.Server` per point and
sends each sample as a batch-1 request at its scheduled time, on the asynchronous tritonclient's
own event loop, so the generator keeps the offered rate whatever the server does. Records are on
the client's clock (latencies include the network and both ends' encoding); the server names
each sample's batch (``staronnx_batch_id``/``_size``/``_placement``), so the papers' latency and
the CPU share come from the very same :func:`~staronnx.serving.summarize`.

Over HTTP (``http://HOST:PORT``, binary tensors, tritonclient.http.aio) or gRPC
(``grpc://HOST:PORT``, tritonclient.grpc.aio): the sweep reads the server's batching from
Triton's model configuration, which ``staronnx serve`` answers on both (KServe v2's own gRPC
service has no such call; Triton's, which ``staronnx serve`` implements, has). Batch size, max
delay, runtime settings and plan hash are the server's: a value that disagrees is refused
rather than measured under a wrong label.

The served model's batching contract comes from the configuration too: ``max_batch_size`` 0
with ``batching: false`` in its ``parameters`` is a model served one request per task (a sweep
then measures batch 1 only, and says so), and ``batch_axes`` names each tensor's batch axis,
so the one-sample requests carry their sample on each input's own axis (a state
``[2, batch, 64]`` is sent as ``[2, 1, 64]``) and a scalar whole.

A request that fails is a failed request wherever it is counted: its record says so and why
(the server's message), and the point is ``failed``; with ``check=`` (``sweep --check``) so is
an answer that is not plain ONNX Runtime's to that request's own inputs (:class:`AnswerCheck`):
what shows that concurrent clients with different inputs each get their own answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np

from staronnx.bench.simulator import mean_rate
from staronnx.bench.spec import FrontEnd, SweepSpec
from staronnx.bench.sweep import Progress, sweep
from staronnx.contract import parse_batch_axes
from staronnx.errors import StaronnxError
from staronnx.plan import Plan
from staronnx.serving.records import BatchRecord, RequestRecord, RunRecords, error_line
from staronnx.serving.server import ServerClosed
from staronnx.serving.spec import ServeSpec
from staronnx.verify import compare
from staronnx.workers.layout import MachineSpec

#: HTTP connections the client may open at once: requests beyond them wait in the client,
#: which would hide server queueing behind client queueing (perf_analyzer opens one per request
#: in flight too); aiohttp opens them as needed
CONNECTIONS = 512
#: seconds a request may take before the client gives up on it (it then counts as failed)
REQUEST_TIMEOUT_S = 120.0

T = TypeVar("T")


class RemoteError(StaronnxError):
    """The server at ``--url`` cannot be swept as asked (unreachable, other plan, other batching)."""


def _url_error(url: str, why: str) -> RemoteError:
    return RemoteError(f"url {url!r}: {why}", cli=f"--url {url}: {why}")


def parse_url(url: str) -> tuple[str, str]:
    """The protocol (``"http"`` or ``"grpc"``) and ``host:port`` (what tritonclient takes) of an
    ``http://host:port`` or ``grpc://host:port`` URL, or one clear line."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in PROTOCOLS:
        raise _url_error(url, "expected http://HOST:PORT or grpc://HOST:PORT (a staronnx serve address: it prints "
                              "them as 'HTTP (KServe v2) on ...' and 'gRPC (KServe v2) on ...')")
    if parts.path not in ("", "/") or parts.query or not parts.hostname:
        raise _url_error(url, f"expected {parts.scheme}://HOST:PORT with no path; the model is named separately")
    try:
        port = parts.port
    except ValueError:
        raise _url_error(url, "the port is not a number") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return parts.scheme, f"{host}:{port or 80}"


#: the protocols a remote sweep speaks, by URL scheme: what ``results.json`` records of each
PROTOCOLS = {
    "http": {"protocol": "KServe v2 HTTP, binary tensors", "client": "tritonclient.http.aio",
             "overloaded": "503", "not_found": "404"},
    "grpc": {"protocol": "KServe v2 gRPC (Triton's service)", "client": "tritonclient.grpc.aio",
             "overloaded": "StatusCode.UNAVAILABLE", "not_found": "StatusCode.NOT_FOUND"},
}


def _client_module(protocol: str) -> Any:
    """tritonclient's asynchronous client for ``protocol``, or one line saying what to install."""
    try:
        if protocol == "grpc":
            import tritonclient.grpc.aio as aio_client
        else:
            import tritonclient.http.aio as aio_client
    except ImportError as exc:
        raise RemoteError(f"a sweep over the network needs tritonclient ({exc.name} is missing): "
                          f"pip install 'tritonclient[{protocol}]'") from None
    return aio_client


def _parameters(result: Any, protocol: str) -> dict[str, Any]:
    """The response parameters of an answer, as plain values (gRPC's are typed messages)."""
    if protocol != "grpc":
        return result.get_response().get("parameters") or {}
    out: dict[str, Any] = {}
    for key, param in result.get_response().parameters.items():
        kind = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, kind) if kind else None  # a oneof: the field set is named at run time
    return out


@dataclass(frozen=True)
class ServedModel:
    """How the server batches and runs the model, from its configuration."""

    name: str
    batch_size: int
    max_delay: float  # seconds
    plan_hash: str
    queue_capacity: int | None
    runtime: dict[str, str]  # policy, groups, cuda_streams, cuda_devices, engine as the server reports them
    #: whether requests share tasks (False: Triton's ``max_batch_size: 0``, one request per task)
    batching: bool = True
    #: each tensor's batch axis as the server reads it (None: none); empty when it does not say
    batch_axes: Mapping[str, int | None] = dataclasses.field(default_factory=dict)
    #: why requests are not batched, or batched along axes Triton's config cannot say
    batching_reason: str | None = None

    @property
    def cuda_streams(self) -> int:
        """The server's CUDA streams per GPU (0 where it reports none)."""
        streams = str(self.runtime.get("cuda_streams", "0"))
        return int(streams) if streams.isdigit() else 0

    @property
    def cuda_devices(self) -> tuple[int, ...]:
        """The GPUs the server's configuration names (``staronnx serve --cuda-devices``: "0,1"),
        GPU 0 when it names none (an older server, or one on GPU 0 alone), so the bound and the
        results of a sweep over the network are those of the GPUs it serves from."""
        text = self.runtime.get("cuda_devices")
        try:
            devices = tuple(int(d) for d in str(text).split(",") if d.strip()) if text else ()
        except ValueError:
            devices = ()
        return devices or (0,)

    @classmethod
    def from_config(cls, url: str, config: Mapping[str, Any]) -> ServedModel:
        params = {k: str((v or {}).get("string_value", "")) for k, v in (config.get("parameters") or {}).items()}
        if "plan_hash" not in params:
            raise RemoteError(f"{url}: model {config.get('name')!r} is not served by staronnx serve "
                              "(its configuration names no plan): the sweep needs staronnx's batch records")
        delay_us = (config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0)
        capacity = params.get("queue_capacity")
        max_batch = int(config.get("max_batch_size") or 0)
        # max_batch_size 0: Triton's "no batching", or (staronnx serve) batch axes its config
        # cannot say; the parameters tell which, and the batch size the server forms
        batching = params["batching"] == "true" if "batching" in params else max_batch > 0
        size = params.get("batch_size", "")
        batch_size = int(size) if size.isdigit() and int(size) > 0 else max(max_batch, 1)
        try:
            axes = parse_batch_axes([params["batch_axes"]]) if params.get("batch_axes") else {}
        except StaronnxError:
            raise RemoteError(f"{url}: model {config.get('name')!r} names batch axes this sweep cannot read: "
                              f"{params['batch_axes']!r}") from None
        return cls(
            name=str(config.get("name")), batch_size=batch_size if batching else 1,
            max_delay=float(delay_us) / 1e6, plan_hash=params["plan_hash"],
            queue_capacity=int(capacity) if capacity and capacity.isdigit() else None,
            runtime={k: params[k] for k in ("policy", "groups", "cuda_streams", "cuda_devices", "engine")
                     if k in params},
            batching=batching, batch_axes=axes, batching_reason=params.get("batching_reason") or None)

    def contract_of(self, plan: Plan) -> Plan:
        """``plan`` with the batching the server serves it with: the plan itself where they
        agree, else a fresh load of it with the server's batch axes and batching (a server
        started with ``--batch-axis``/``--no-batching``), so the requests this sweep sends have
        the shapes the server expects."""
        contract = plan.contract
        ours = {**contract.inputs, **contract.outputs}
        axes = {n: a for n, a in self.batch_axes.items() if n in ours}
        if contract.batchable == self.batching and all(ours[n] == a for n, a in axes.items()):
            return plan
        return Plan.load(plan.root).set_batching(axes, batching=self.batching)


class AnswerCheck:
    """What plain ONNX Runtime answers to a request's own inputs, to hold a served answer against
    (``sweep --check MODEL.onnx``).

    One CPU session of the whole model; each request's expected answer is computed once per
    request object (a sweep reuses a pool of them) off the client's event loop, and compared
    as ``staronnx plan verify`` compares (relative tolerance on floats, exact on integers)."""

    def __init__(self, model: str | Path, plan: Plan) -> None:
        import onnxruntime as ort

        from staronnx.ortutil import QUIET, make_session

        def refused(why: str, hint: str = "") -> RemoteError:
            return RemoteError(f"check={str(model)!r}: {why}", cli=f"--check {model}: {why}{hint}")

        path = Path(model)
        if not path.is_file():
            raise refused("no such model file", " (give the .onnx the plan was cut from)")
        options = ort.SessionOptions()
        options.log_severity_level = QUIET
        options.intra_op_num_threads = 1  # the client's host also runs the generator
        try:
            self.session = make_session(path, options=options)
        except Exception as exc:  # noqa: BLE001 - ORT's refusal of the file, as one line
            raise refused(f"onnxruntime cannot load it: {error_line(exc)}") from None
        have = {i.name for i in self.session.get_inputs()}
        outs = {o.name for o in self.session.get_outputs()}
        if have != set(plan.input_names) or not set(plan.output_names) <= outs:
            raise refused(f"its inputs {sorted(have)} and outputs {sorted(outs)} are not the plan's "
                          f"({plan.input_names} -> {plan.output_names}): give the model the plan was cut from")
        self.path = path
        self.outputs = list(plan.output_names)
        self._lock = threading.Lock()
        self._expected: dict[int, tuple[Mapping[str, np.ndarray], dict[str, np.ndarray]]] = {}

    def expected(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """ORT's answer to ``feeds``, remembered with them (their id cannot be reused meanwhile)."""
        with self._lock:
            known = self._expected.get(id(feeds))
        if known is not None and known[0] is feeds:
            return known[1]
        answer = dict(zip(self.outputs, self.session.run(self.outputs, dict(feeds))))
        with self._lock:
            self._expected[id(feeds)] = (feeds, answer)
        return answer

    def mismatch(self, feeds: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]) -> str | None:
        """Why ``got`` is not ORT's answer to ``feeds`` (one line), None when it is."""
        for name, want in self.expected(feeds).items():
            if name not in got:
                return f"output {name!r} is missing from the answer"
            answer = np.asarray(got[name])
            check = compare(name, want, answer)
            if not check.ok:
                how = (f"shape {list(answer.shape)}, onnxruntime's {list(want.shape)}" if answer.shape != want.shape
                       else f"max abs diff {check.max_abs:.3g}")
                return f"output {name!r} is not onnxruntime's answer to this request's own inputs ({how})"
        return None


class RemoteRuntime:
    """One model of a ``staronnx serve``, as the sweep's runtime: see the module docstring.

    Owns an event loop in a daemon thread and the asynchronous tritonclient on it; ``close()``
    stops both. Checks at once that the server answers, serves ``model`` and serves ``plan``,
    which then carries the server's batching contract (:meth:`ServedModel.contract_of`).
    """

    #: what a sweep reads of an in-process runtime (:class:`~staronnx.bench.sweep.SweptRuntime`):
    #: no trace here (``trace`` is refused over the network), and the server pads its batches
    #: itself, out of the sweep's sight
    tracer: Any = None
    preferred_batch_sizes: tuple[int, ...] = ()

    def __init__(self, url: str, plan: Plan, model: str | None = None, *, connections: int = CONNECTIONS,
                 clock: Callable[[], float] = time.perf_counter, check: AnswerCheck | None = None) -> None:
        self.check = check
        self.url = url
        self.protocol, self.address = parse_url(url)
        aio_client = _client_module(self.protocol)
        self.plan = plan
        self.model = model or Path(plan.root).resolve().name
        self.clock = clock
        self.workers: list[Any] = []  # the server's own; the sweep's warm-up sizes its bursts from this
        self.client: Any = None
        self._lock = threading.Lock()
        self._in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="staronnx-remote-client", daemon=True)
        self._thread.start()

        async def connect() -> Any:
            if self.protocol == "grpc":  # one HTTP/2 channel carries every request at once
                return aio_client.InferenceServerClient(self.address)
            return aio_client.InferenceServerClient(self.address, conn_limit=connections,
                                                    conn_timeout=REQUEST_TIMEOUT_S)

        self.client = self.call(connect())
        self._checking: Any = None  # a thread pool for ORT's answers (check=), made on first use
        try:
            self.served = self._check()
            self.plan = self.served.contract_of(plan)
        except BaseException:
            self.close()
            raise

    # -- the event loop ------------------------------------------------------------------------
    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = 30.0) -> Any:
        """Run ``coro`` on the client's loop and wait for its result (from any other thread)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise RemoteError(f"{self.url}: no answer within {timeout:g} s") from None

    def spawn(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on the client's loop; its concurrent future (counted until done)."""
        with self._lock:
            self._in_flight += 1
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        future.add_done_callback(self._one_done)
        return future

    def _one_done(self, _: Future[Any]) -> None:
        with self._lock:
            self._in_flight -= 1

    # -- checks -----------------------------------------------------------------------------
    def _check(self) -> ServedModel:
        from tritonclient.utils import InferenceServerException

        try:
            config = self.call(self._config())
        except InferenceServerException as exc:
            if exc.status() == PROTOCOLS[self.protocol]["not_found"]:
                raise RemoteError(f"{self.url} serves no model {self.model!r} ({exc.message()}); name it "
                                  "with model=", cli=f"{self.url} serves no model {self.model!r} "
                                  f"({exc.message()}); name it with --model") from None
            raise RemoteError(f"{self.url}: {exc.message()}") from None
        except (OSError, asyncio.TimeoutError) as exc:
            raise RemoteError(f"cannot reach {self.url}: {exc} (is staronnx serve running there?)") from None
        except Exception as exc:  # noqa: BLE001 - aiohttp's client errors: one line, not a traceback
            raise RemoteError(f"cannot reach {self.url}: {type(exc).__name__}: {exc} "
                              "(is staronnx serve running there?)") from None
        served = ServedModel.from_config(self.url, config)
        if served.plan_hash != self.plan.hash:
            raise RemoteError(f"{self.url} serves model {self.model!r} from plan {served.plan_hash}, not "
                              f"{self.plan.hash} ({self.plan.root}): sweep the plan the server serves")
        return served

    async def _config(self) -> dict[str, Any]:
        """The served model's configuration, as Triton's JSON (gRPC's message converted)."""
        # tritonclient is untyped: its answer is Triton's JSON, an object
        config: dict[str, Any]
        if self.protocol == "grpc":
            config = (await self.client.get_model_config(self.model, as_json=True))["config"]
        else:
            config = await self.client.get_model_config(self.model)
        return config

    # -- what the sweep calls ---------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray]) -> Future[dict[str, np.ndarray]]:
        """Send ``feeds`` (any batch, along each input's own batch axis) as one request; the
        future resolves to its outputs (with ``check``, fails when they are not ORT's answer)."""
        inputs, outputs = encode(self.plan, feeds, self.protocol)

        async def send() -> dict[str, np.ndarray]:
            result = await self.client.infer(self.model, inputs, outputs=outputs)
            got = {o.name(): result.as_numpy(o.name()) for o in outputs}
            why = await self.mismatch(feeds, got)
            if why is not None:
                raise RemoteError(why)
            return got

        return self.spawn(send())

    async def mismatch(self, feeds: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]) -> str | None:
        """(On the client's loop) why ``got`` is not ORT's answer to ``feeds``; None when it is,
        or when answers are not checked. ORT runs in a thread of its own, off the loop."""
        if self.check is None:
            return None
        if self._checking is None:
            from concurrent.futures import ThreadPoolExecutor

            self._checking = ThreadPoolExecutor(1, thread_name_prefix="staronnx-check")
        return await self._loop.run_in_executor(self._checking, self.check.mismatch, feeds, got)

    def stats(self) -> dict[str, Any]:
        """What :func:`staronnx.bench.sweep.wait_idle` reads: requests still unanswered."""
        with self._lock:
            return {"in_flight": self._in_flight}

    def close(self) -> None:
        """Close the client and stop its loop (requests still out are abandoned)."""
        if not self._loop.is_running():
            return
        try:
            if self.client is not None:
                self.call(self.client.close(), timeout=5.0)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if self._checking is not None:
            self._checking.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RemoteRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode(plan: Plan, feeds: Mapping[str, np.ndarray], protocol: str = "http") -> tuple[list[Any], list[Any]]:
    """tritonclient inputs for ``feeds`` and every output asked for, in ``protocol``'s classes
    (over HTTP, binary tensors both ways; gRPC's tensors are always raw bytes)."""
    from tritonclient.utils import np_to_triton_dtype

    client = _client_module(protocol)
    binary = {} if protocol == "grpc" else {"binary_data": True}
    inputs = []
    for t in plan.inputs:
        arr = np.asarray(feeds[t.name], order="C")  # ascontiguousarray makes a scalar [1]: its rank is kept
        datatype = np_to_triton_dtype(arr.dtype)
        if datatype is None:
            raise RemoteError(f"input {t.name!r}: dtype {arr.dtype} has no KServe v2 datatype")
        inp = client.InferInput(t.name, list(arr.shape), datatype)
        inp.set_data_from_numpy(arr, **binary)
        inputs.append(inp)
    outputs = [client.InferRequestedOutput(t.name, **binary) for t in plan.outputs]
    return inputs, outputs


class RemoteServer:
    """The sweep's per-point front end over the network (the part of :class:`Server` that
    :func:`~staronnx.serving.run_open_loop` uses): see the module docstring.

    The arguments are :class:`Server`'s; the spec's ``batch_size`` and ``max_delay`` must be the
    server's (a point is then labelled with what was measured), the rest is the server's business.
    """

    def __init__(self, runtime: RemoteRuntime, spec: ServeSpec) -> None:
        served, batch_size, max_delay = runtime.served, spec.batch_size, spec.max_delay
        if batch_size != served.batch_size:
            raise RemoteError(f"{runtime.url} forms batches of up to {served.batch_size} (staronnx serve "
                              f"--batch-size), not {batch_size}")
        if max_delay is None or not math.isclose(max_delay, served.max_delay, abs_tol=1e-6):
            given = "none (batches leave only when full)" if max_delay is None else f"{max_delay * 1e3:g} ms"
            raise RemoteError(f"{runtime.url} batches with a max delay of {served.max_delay * 1e3:g} ms "
                              f"(staronnx serve --max-delay), not {given}")
        self.runtime = runtime
        self.batch_size = batch_size
        self.max_delay = max_delay
        self.clock = runtime.clock
        self.created = self.clock()
        self._lock = threading.Lock()
        self._requests: list[RequestRecord] = []
        self._batches: dict[int, BatchRecord] = {}
        self._futures: set[Future[None]] = set()
        self._ids = itertools.count()
        self._encoded: dict[int, tuple[Mapping[str, np.ndarray], list[Any], list[Any]]] = {}
        self._closed = False

    def submit(self, sample: Mapping[str, np.ndarray], arrival: float | None = None) -> Future[None]:
        """Send one sample now, counted as arrived at ``arrival``; never waits for the answer."""
        if self._closed:
            raise ServerClosed("the remote front end is closed")
        # the generator reuses a pool of samples: encode each once (tritonclient only reads them)
        cached = self._encoded.get(id(sample))
        if cached is None or cached[0] is not sample:
            cached = (sample, *encode(self.runtime.plan, sample, self.runtime.protocol))
            self._encoded[id(sample)] = cached
        _, inputs, outputs = cached
        with self._lock:
            record = RequestRecord(id=next(self._ids), arrival=self.clock() if arrival is None else arrival)
            self._requests.append(record)
        future = self.runtime.spawn(self._send(record, sample, inputs, outputs))
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    async def _send(self, record: RequestRecord, sample: Mapping[str, np.ndarray], inputs: list[Any],
                    outputs: list[Any]) -> None:
        from tritonclient.utils import InferenceServerException

        try:
            result = await self.runtime.client.infer(self.runtime.model, inputs, outputs=outputs,
                                                     request_id=str(record.id))
        except InferenceServerException as exc:
            with self._lock:
                # 503 (UNAVAILABLE): the server's queue was full, as OverloadError in process
                if exc.status() == PROTOCOLS[self.runtime.protocol]["overloaded"]:
                    record.rejected = True
                else:
                    record.failed = True
                    record.error = _server_error(exc)
            raise
        except BaseException as exc:
            with self._lock:
                record.failed = True
                record.error = error_line(exc)
            raise
        done = self.clock()
        if self.runtime.check is not None:  # an answer that is not this request's own is a failure
            why = await self.runtime.mismatch(sample, {o.name(): result.as_numpy(o.name()) for o in outputs})
            if why is not None:
                with self._lock:
                    record.failed = True
                    record.error = why
                raise RemoteError(why)
        params = _parameters(result, self.runtime.protocol)
        with self._lock:
            record.done = done
            batch_id = params.get("staronnx_batch_id")
            # no batch named (an older server): the request is its own batch, ids kept apart
            key = int(batch_id) if isinstance(batch_id, int) else -1 - record.id
            batch = self._batches.get(key)
            if batch is None:
                batch = self._batches[key] = BatchRecord(id=key, size=0, formed=record.arrival)
                batch.placement = _placement(params.get("staronnx_placement"))
            record.batch_id = key
            batch.request_ids.append(record.id)
            batch.size += 1
            batch.formed = max(batch.formed, record.arrival)  # when it formed is the server's: a lower bound
            batch.done = done if batch.done is None else max(batch.done, done)

    def flush(self) -> None:
        """Nothing to do: the server batches dynamically, so no request waits for a full batch."""

    def wait_idle(self, timeout: float | None = None) -> int:
        """Wait until every request sent has its answer; how many still have none after
        ``timeout`` s (:meth:`Server.wait_idle`)."""
        with self._lock:
            futures = list(self._futures)
        _, pending = wait_futures(futures, timeout=timeout)
        return len(pending)

    def settings(self) -> dict[str, Any]:
        served = self.runtime.served
        return {"batch_size": served.batch_size, "max_delay": served.max_delay,
                "queue_capacity": served.queue_capacity, "on_full": "reject", "max_inflight": None,
                "policy": served.runtime.get("policy"), "plan_hash": served.plan_hash,
                "url": self.runtime.url, "model": self.runtime.model}

    def records(self, *, since: float | None = None, offered_rate: float | None = None,
                start: float | None = None, end: float | None = None) -> RunRecords:
        """The point's records on the client's clock, batches rebuilt from the server's ids."""
        with self._lock:
            reqs = [dataclasses.replace(r) for r in self._requests if since is None or r.arrival >= since]
            by_id = {r.id: r for r in reqs}
            batches = [dataclasses.replace(b, request_ids=[i for i in b.request_ids if i in by_id],
                                           placement=dict(b.placement)) for b in self._batches.values()]
            outstanding = bool(self._futures)
            now = self.clock()
        batches = [b for b in batches if b.request_ids]
        for b in batches:  # the papers' latency is that of each batch's oldest request
            b.size = len(b.request_ids)
            min((by_id[i] for i in b.request_ids), key=lambda r: r.arrival).first_in_batch = True
        arrivals = sorted(r.arrival for r in reqs)
        if offered_rate is None:
            offered_rate = mean_rate(arrivals)
        if start is None:
            start = arrivals[0] if arrivals else self.created
        if end is None:
            finished = [r.done for r in reqs if r.done is not None]
            end = now if outstanding or not finished else max(finished)
        return RunRecords(requests=reqs, batches=sorted(batches, key=lambda b: b.id), offered_rate=float(offered_rate),
                          batch_size=self.batch_size, start=float(start), end=float(end), queue_samples=[],
                          settings=self.settings())

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop sending; wait up to ``timeout`` s for the answers still out, then abandon them."""
        self._closed = True
        with self._lock:
            pending = list(self._futures)
        _, left = wait_futures(pending, timeout=timeout)
        for f in left:
            f.cancel()


def _server_error(exc: Any) -> str:
    """A server's refusal as one line: its status and message (tritonclient's exception)."""
    status = exc.status()
    return error_line(RuntimeError(f"{status}: {exc.message()}" if status else exc.message() or str(exc)))


def _placement(text: Any) -> dict[str, str]:
    """``"part0=cpu,part1=cuda"`` -> {"part0": "cpu", "part1": "cuda"}."""
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item) if isinstance(text, str) else {}


def served_runtime(url: str, plan: Plan, model: str | None = None) -> ServedModel:
    """What ``staronnx serve`` at ``url`` says of ``model`` (its batch size and its runtime's
    settings), checked against ``plan``, without sweeping: what ``--rates auto`` sizes a sweep
    over the network from, since the workers are the server's, not this command line's."""
    with RemoteRuntime(url, plan, model) as remote:
        return remote.served


#: the runtime settings a sweep over the network takes from the server (``expect`` may name them)
SERVER_SETTINGS = ("policy", "groups", "cuda_streams", "engine", "queue_capacity", "max_delay")


def remote_sweep(plan: Plan | str | Path, url: str, rates: Sequence[float], batch_sizes: Sequence[int] | None = None,
                 spec: SweepSpec = SweepSpec(), *, model: str | None = None, expect: Mapping[str, Any] | None = None,
                 check: str | Path | None = None, inputs: Mapping[str, np.ndarray] | str | Path | None = None,
                 progress: Progress | None = None) -> list[dict[str, Any]]:
    """:func:`~staronnx.bench.sweep.sweep` (``inputs`` and ``progress`` as there; the LP bound
    from this machine's perf model store) through the ``staronnx serve`` at ``url``, serving
    ``model`` (default: the plan folder's name), each point's traffic as ``spec.run`` says.

    The runtime settings are the server's (:data:`SERVER_SETTINGS`: the spec's policy, engine,
    queue capacity and max delay are not used): ``expect`` names those the caller counts on, and
    one that disagrees raises :class:`RemoteError` (restart the server to measure another); so
    do ``batch_sizes`` other than the server's. A model served one request per task is measured
    at batch 1, as in process. ``check``: the ONNX model the plan was cut from
    (:class:`AnswerCheck`). ``spec.trace``, ``spec.simulate`` and ``spec.run.colocate`` need the
    runtime in this process and are refused.
    """
    for option, value in (("trace", spec.trace), ("simulate", spec.simulate), ("colocate", spec.run.colocate)):
        if value:
            raise RemoteError(f"{option}= needs the runtime in this process; it cannot be used over the network",
                              cli=f"--{option} needs the runtime in this process; it cannot be used with --url")
    unknown = sorted(set(expect or {}) - set(SERVER_SETTINGS))
    if unknown:
        raise RemoteError(f"expect names {', '.join(unknown)}, not a server setting ({', '.join(SERVER_SETTINGS)})")
    given = {k: (expect or {}).get(k) for k in SERVER_SETTINGS}
    max_delay = given.pop("max_delay")
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    answers = None if check is None else AnswerCheck(check, plan)
    with RemoteRuntime(url, plan, model, check=answers) as remote:
        served = remote.served
        b = served.batch_size
        sizes = [b]
        if not served.batching:  # one request per task: batch 1, other sizes noted by the sweep
            sizes = sorted({1, *(batch_sizes or ())})
        elif batch_sizes is not None and sorted(set(batch_sizes)) != [b]:
            why = (f"{url} forms batches of up to {b} (staronnx serve --batch-size {b}); a sweep over the network "
                   "measures that size only: ")
            raise RemoteError(why + f"pass batch_sizes=[{b}] or None",
                              cli=why + f"pass --batch-sizes {b} or leave it out (restart the server with another "
                              "--batch-size to measure another)")
        if max_delay is not None and not math.isclose(max_delay, served.max_delay, abs_tol=1e-6):
            why = f"{url} batches with a max delay of {served.max_delay * 1e3:g} ms (staronnx serve --max-delay); "
            raise RemoteError(why + "leave max_delay out of expect or give that value",
                              cli=why + "leave --max-delay out or give that value")
        actual = {**served.runtime, "queue_capacity": served.queue_capacity}
        for key, value in given.items():
            if value is not None and key in actual and str(value) != str(actual[key]):
                flag = "--" + key.replace("_", "-")
                why = f"{url} runs with {flag} {actual[key]}, not {value}: over the network the runtime settings are "
                raise RemoteError(why + f"the server's (leave {key} out of expect)",
                                  cli=why + f"the server's (leave {flag} out)")
        wire = PROTOCOLS[remote.protocol]
        front_end: dict[str, Any] = {"kind": "network", "url": url, "model": remote.model, "protocol": wire["protocol"],
                     "client": wire["client"]}
        if not served.batching or served.batching_reason:  # what Triton's max_batch_size cannot say
            front_end.update(batching=served.batching, batching_reason=served.batching_reason)
        if answers is not None:
            front_end["check"] = str(answers.path)
        served_spec = replace(spec, policy=str(actual.get("policy", "?")), engine=str(actual.get("engine", "?")),
                              simulate=False, run=replace(spec.run, max_delay=served.max_delay,
                                                          queue_capacity=served.queue_capacity or 1024))
        return sweep(remote.plan, rates, sizes, served_spec,
                     machine=MachineSpec(str(actual.get("groups", "?")), served.cuda_streams, served.cuda_devices),
                     runtime=remote, front_end=FrontEnd(RemoteServer, front_end), inputs=inputs,
                     progress=progress)
