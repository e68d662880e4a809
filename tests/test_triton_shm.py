"""System shared memory (issue 49, item 5) through Triton's own clients: regions created with
``tritonclient.utils.shared_memory``, registered over HTTP and gRPC, inputs read from them and
outputs written to them by ``staronnx serve`` on loopback, numeric (``simple``) and string
(``simple_string``) tensors, as Triton's ``simple_{http,grpc}_shm_client.py`` and
``simple_{http,grpc}_shm_string_client.py`` do; and every way to get it wrong (an unknown region,
a window past the region's end, an output larger than its window, a key naming a file outside
/dev/shm, CUDA shared memory) refused by name while the server keeps serving.
"""

from __future__ import annotations

import uuid

import numpy as np
import onnx
import pytest

pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from test_serve import start_server
from test_triton_compat import simple_model
from test_triton_strings import simple_string_model
from tritonclient import utils
from tritonclient.utils import InferenceServerException

from staronnx import partition
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(180)

CLIENTS = {"http": httpclient, "grpc": grpcclient}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("shm")
    onnx.save(simple_model(), str(root / "simple.onnx"))
    onnx.save(simple_string_model(), str(root / "simple_string.onnx"))
    plans = [partition(root / "simple.onnx", spec=PartitionSpec(parts=1, costs="estimate"), output_dir=root / "simple"),
             partition(root / "simple_string.onnx", spec=PartitionSpec(parts=1, costs="estimate"),
                       output_dir=root / "simple_string")]
    s = start_server([p.root for p in plans], root, "--policy", "eager", "--batch-size", "8", "--max-delay", "1ms",
                     "--drain-timeout", "10s")
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


@pytest.fixture(params=["http", "grpc"])
def client(request, served):
    module = CLIENTS[request.param]
    c = module.InferenceServerClient(served.http if request.param == "http" else served.grpc)
    c.unregister_system_shared_memory()
    c.unregister_cuda_shared_memory()  # as the examples do first: there are none, and that succeeds
    c.module = module
    c.protocol = request.param
    handles: list = []
    c.region = lambda name, size: _region(handles, name, size)
    yield c
    c.unregister_system_shared_memory()
    for h in handles:
        shm.destroy_shared_memory_region(h)


def _region(handles: list, name: str, size: int):
    """A new POSIX shared-memory object (a unique key per test), and its handle."""
    key = f"/staronnx_test_{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(name, key, size)
    handle.key = key
    handles.append(handle)
    return handle


def _registered(c, in0: np.ndarray, in1: np.ndarray):
    """Regions input_data (``in0`` then ``in1``, one tensor's bytes apart) and output_data, as
    large, registered with the server; their handles."""
    size = in0.nbytes
    ins = c.region("input_data", 2 * size)
    outs = c.region("output_data", 2 * size)
    shm.set_shared_memory_region(ins, [in0])
    shm.set_shared_memory_region(ins, [in1], offset=size)
    c.register_system_shared_memory("input_data", ins.key, 2 * size)
    c.register_system_shared_memory("output_data", outs.key, 2 * size)
    return ins, outs


def _status_names(c) -> set[str]:
    status = c.get_system_shared_memory_status()
    if c.protocol == "http":
        return {r["name"] for r in status}
    return set(status.regions)


def test_numeric_tensors_through_shared_memory(client):
    """simple_{http,grpc}_shm_client.py: inputs in one region (the second at an offset), outputs
    in another; nothing but the tensors' places crosses the socket."""
    c, m = client, client.module
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    in1 = np.ones((1, 16), dtype=np.int32)
    size = in0.nbytes
    ins, outs = _registered(c, in0, in1)
    assert _status_names(c) == {"input_data", "output_data"}
    inputs = [m.InferInput("INPUT0", [1, 16], "INT32"), m.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("input_data", size)
    inputs[1].set_shared_memory("input_data", size, offset=size)
    outputs = [m.InferRequestedOutput("OUTPUT0"), m.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("output_data", size)
    outputs[1].set_shared_memory("output_data", size, offset=size)
    results = c.infer("simple", inputs, outputs=outputs)
    out0 = results.get_output("OUTPUT0")
    shape = out0["shape"] if c.protocol == "http" else list(out0.shape)
    assert shape == [1, 16]
    # the values are in shared memory, not in the answer
    if c.protocol == "http":
        assert "data" not in out0 and "binary_data_size" not in out0.get("parameters", {})
    else:
        assert results.get_response().raw_output_contents == [b"", b""]
    got0 = shm.get_contents_as_numpy(outs, np.int32, shape)
    got1 = shm.get_contents_as_numpy(outs, np.int32, shape, offset=size)
    np.testing.assert_array_equal(got0, in0 + in1)
    np.testing.assert_array_equal(got1, in0 - in1)
    # a region may be unregistered by name, then it is unknown
    c.unregister_system_shared_memory("input_data")
    assert _status_names(c) == {"output_data"}
    with pytest.raises(InferenceServerException, match="'input_data' is not registered"):
        c.infer("simple", inputs, outputs=outputs)


def test_string_tensors_through_shared_memory(client):
    """simple_{http,grpc}_shm_string_client.py: serialized BYTES tensors in and out."""
    c, m = client, client.module
    in0 = np.array([str(i).encode() for i in range(16)], dtype=object)
    in1 = np.array([b"1"] * 16, dtype=object)
    expected_sum = np.array([str(i + 1).encode() for i in range(16)], dtype=object)
    expected_diff = np.array([str(i - 1).encode() for i in range(16)], dtype=object)
    sizes = [utils.serialized_byte_size(utils.serialize_byte_tensor(a)) for a in (in0, in1, expected_sum, expected_diff)]
    handles = [c.region(n, s) for n, s in zip(("in0", "in1", "out0", "out1"), sizes)]
    shm.set_shared_memory_region(handles[0], [utils.serialize_byte_tensor(in0)])
    shm.set_shared_memory_region(handles[1], [utils.serialize_byte_tensor(in1)])
    for h, name, size in zip(handles, ("in0", "in1", "out0", "out1"), sizes):
        c.register_system_shared_memory(name, h.key, size)
    inputs = [m.InferInput("INPUT0", [1, 16], "BYTES"), m.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_shared_memory("in0", sizes[0])
    inputs[1].set_shared_memory("in1", sizes[1])
    outputs = [m.InferRequestedOutput("OUTPUT0"), m.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("out0", sizes[2])
    outputs[1].set_shared_memory("out1", sizes[3])
    results = c.infer("simple_string", inputs, outputs=outputs)
    out0 = results.get_output("OUTPUT0")
    datatype = out0["datatype"] if c.protocol == "http" else out0.datatype
    assert datatype == "BYTES"
    got0 = shm.get_contents_as_numpy(handles[2], np.object_, [1, 16])
    got1 = shm.get_contents_as_numpy(handles[3], np.object_, [1, 16])
    assert got0.ravel().tolist() == expected_sum.tolist()
    assert got1.ravel().tolist() == expected_diff.tolist()


def test_out_of_range_and_unknown_are_refused_by_name(client):
    c, m = client, client.module
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    h = c.region("small", data.nbytes)
    shm.set_shared_memory_region(h, [data])
    # a window past the object's end, at registration
    with pytest.raises(InferenceServerException, match="'small'.*runs past the end"):
        c.register_system_shared_memory("small", h.key, data.nbytes, offset=8)
    c.register_system_shared_memory("small", h.key, data.nbytes)
    with pytest.raises(InferenceServerException, match="'small' is already registered"):
        c.register_system_shared_memory("small", h.key, data.nbytes)
    # a key that does not exist, or names something outside /dev/shm
    with pytest.raises(InferenceServerException, match="cannot open key"):
        c.register_system_shared_memory("missing", "/staronnx_no_such_key", 64)
    with pytest.raises(InferenceServerException, match="must name one POSIX shared-memory object"):
        c.register_system_shared_memory("escape", "/../../etc/passwd", 64)
    # an input past the window's end, an unknown region, an output larger than its window
    def inputs(region: str = "small", offset: int = 0) -> list:
        ins = [m.InferInput("INPUT0", [1, 16], "INT32"), m.InferInput("INPUT1", [1, 16], "INT32")]
        ins[0].set_shared_memory(region, data.nbytes, offset=offset)
        ins[1].set_shared_memory("small", data.nbytes)
        return ins

    def output(size: int, offset: int = 0) -> list:
        out = m.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("small", size, offset=offset)
        return [out]

    with pytest.raises(InferenceServerException, match="input 'INPUT0'.*shared memory region 'small'.*outside"):
        c.infer("simple", inputs(offset=4))
    with pytest.raises(InferenceServerException, match="'nowhere' is not registered"):
        c.infer("simple", inputs("nowhere"))
    with pytest.raises(InferenceServerException, match="output 'OUTPUT0' is 64 bytes.*'small'"):
        c.infer("simple", inputs(), outputs=output(8))
    with pytest.raises(InferenceServerException, match="output 'OUTPUT0'.*'small'.*outside"):
        c.infer("simple", inputs(), outputs=output(64, offset=8))
    with pytest.raises(InferenceServerException, match="'gone' is not registered"):
        c.unregister_system_shared_memory("gone")
    # the server still answers, reading both inputs from the region
    results = c.infer("simple", inputs(), outputs=[m.InferRequestedOutput("OUTPUT0")])
    np.testing.assert_array_equal(results.as_numpy("OUTPUT0"), data + data)
    c.unregister_system_shared_memory()
    assert _status_names(c) == set()


def test_cuda_shared_memory_is_refused_by_name(client):
    """Not implemented (no CUDA IPC): registering says so; its status lists no region."""
    c = client
    with pytest.raises(InferenceServerException, match="CUDA shared memory is not implemented"):
        c.register_cuda_shared_memory("gpu_region", b"\0" * 64, 0, 64)
    status = c.get_cuda_shared_memory_status()
    assert (status == [] if c.protocol == "http" else not status.regions)


def test_server_lists_the_extension(served):
    assert "system_shared_memory" in httpclient.InferenceServerClient(served.http).get_server_metadata()["extensions"]


def _other_address() -> str | None:
    """An address of this machine that is not a loopback one (None where there is none)."""
    import ipaddress
    import subprocess

    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return next((a for a in out if ipaddress.ip_address(a).version == 4 and not ipaddress.ip_address(a).is_loopback),
                None)


def test_shared_memory_is_for_clients_on_this_machine(tmp_path):
    """A client reaching the server from another address may not register, list or use regions
    (they would be memory of this machine's processes to read and write); it still infers."""
    address = _other_address()
    if address is None:
        pytest.skip("this machine has no address other than loopback")
    onnx.save(simple_model(), str(tmp_path / "simple.onnx"))
    plan = partition(tmp_path / "simple.onnx", spec=PartitionSpec(parts=1, costs="estimate"),
                     output_dir=tmp_path / "simple")
    s = start_server([plan.root], tmp_path, "--host", "0.0.0.0", "--insecure", "--policy", "eager")
    try:
        http = httpclient.InferenceServerClient(f"{address}:{s.http.rsplit(':', 1)[1]}")
        grpc = grpcclient.InferenceServerClient(f"{address}:{s.grpc.rsplit(':', 1)[1]}")
        data = np.arange(16, dtype=np.int32).reshape(1, 16)
        handles: list = []
        try:
            h = _region(handles, "mine", data.nbytes)
            for client in (http, grpc):
                with pytest.raises(InferenceServerException, match="only for clients on the server's machine"):
                    client.register_system_shared_memory("mine", h.key, data.nbytes)
                with pytest.raises(InferenceServerException, match="only for clients on the server's machine"):
                    client.get_system_shared_memory_status()
            # registered by a local client, the region is still not the remote client's to use
            httpclient.InferenceServerClient(s.http).register_system_shared_memory("mine", h.key, data.nbytes)
            for client, module in ((http, httpclient), (grpc, grpcclient)):
                inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
                inputs[0].set_shared_memory("mine", data.nbytes)
                inputs[1].set_data_from_numpy(data)
                with pytest.raises(InferenceServerException, match="not served to this client"):
                    client.infer("simple", inputs)
                inputs[0].set_data_from_numpy(data)
                np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), data + data)
        finally:
            for handle in handles:
                shm.destroy_shared_memory_region(handle)
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_a_region_whose_object_shrank_is_refused_and_the_server_keeps_serving(client, served):
    """A client that truncates its shared-memory object after registering it (by mistake, or to
    harm the server) gets its request refused by name: the server maps the object, and touching a
    mapped page past the object's end kills a process with SIGBUS, every other client's requests
    with it. The server reads and writes a region through the object's file instead."""
    import os

    c, m = client, client.module
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    size = in0.nbytes
    ins, outs = _registered(c, in0, in0)
    os.truncate(f"/dev/shm/{ins.key.lstrip('/')}", 0)
    os.truncate(f"/dev/shm/{outs.key.lstrip('/')}", 0)
    inputs = [m.InferInput("INPUT0", [1, 16], "INT32"), m.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("input_data", size)
    inputs[1].set_shared_memory("input_data", size, offset=size)
    with pytest.raises(InferenceServerException, match="shrank"):
        c.infer("simple", inputs)
    # the outputs' object shrank too: the inputs sent in the request, the answer refused by name
    inputs = [m.InferInput("INPUT0", [1, 16], "INT32"), m.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in0)
    outputs = [m.InferRequestedOutput("OUTPUT0"), m.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("output_data", size)
    outputs[1].set_shared_memory("output_data", size, offset=size)
    with pytest.raises(InferenceServerException, match="shrank"):
        c.infer("simple", inputs, outputs=outputs)
    # and the server still serves
    assert served.proc.poll() is None
    result = c.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), in0 + in0)
