"""System shared memory (Triton's extension): tensors that a co-located client puts in POSIX shared
memory instead of the request, and outputs written back there.

A client creates a POSIX shared-memory object (``shm_open``: tritonclient's
``tritonclient.utils.shared_memory``, Python's ``multiprocessing.shared_memory``), registers a
window of it (name, key, offset, byte size) with the server, then names a region, a byte count and
an offset within the window in an input's or output's ``parameters`` (``shared_memory_region``,
``shared_memory_byte_size``, ``shared_memory_offset``) instead of sending its bytes. The server opens
the object once at registration and reads inputs from it and writes outputs into it for every
request, so no tensor bytes cross the socket.

The object is read and written through its file (``pread``/``pwrite``), not mapped: a client may
shrink its object after registering it, and a mapped page past the object's end kills the process
that touches it (SIGBUS), every other client's requests with it. Through the file, a shrunk object
is a short read, refused by the region's name. The bytes are copied once either way.

Shared memory is for clients on the server's machine only: every shared-memory call and every
request that places a tensor in a region is refused to a client connected from another address
(its regions would otherwise be another client's, or another process's, memory to read and write).

Every access is bounds-checked against the registered window and refused by the region's name
when it falls outside (at registration: the window against the object's size; per request: the
offset and byte count against the window). A key names an object in ``/dev/shm`` only (one path
component, no links followed): a client cannot make the server map an arbitrary file.

Inputs are copied out of the region when the request is decoded: the client may reuse its region
as soon as the answer arrives, and a region may be unregistered while a batch that holds one of
its requests still runs. Outputs are written when the answer is put together, before it is sent.

CUDA shared memory (``/v2/cudasharedmemory``, the gRPC ``CudaSharedMemory*`` calls) is not
implemented: registering a region is refused by name; its status lists no region and unregistering
all of them succeeds (there are none), as the example clients do at their start.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import stat
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from staronnx.serve import protocol
from staronnx.serve.protocol import ProtocolError, invalid, shown

#: where POSIX shared-memory objects live on Linux (glibc's shm_open opens the key's name here)
SHM_DIR = "/dev/shm"

#: the parameters of an input or output that place it in a registered region
REGION, BYTE_SIZE, OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"

CUDA_REFUSED = ("CUDA shared memory is not implemented by staronnx serve (it would need CUDA IPC handles); "
                "use system shared memory (/v2/systemsharedmemory, SystemSharedMemoryRegister) or send tensors "
                "in the request")


@dataclass
class Region:
    """One registered window of a shared-memory object, its file kept open."""

    name: str
    key: str
    offset: int
    byte_size: int
    _fd: int
    #: held while the file is read or written, so that an unregister on another thread (a request
    #: may be decoded on a worker thread) never closes it under a read, nor hands its number to
    #: another file opened meanwhile
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def check(self, offset: int, size: int, what: str) -> int:
        """The object's offset of ``size`` bytes at ``offset`` within the registered window, or the
        refusal naming the region and ``what`` (the input or output) when they fall outside it."""
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise invalid(f"{what}: {size} bytes at offset {offset} of shared memory region {shown(self.name)} "
                          f"fall outside it (it holds {self.byte_size} bytes)")
        return self.offset + offset

    def read(self, offset: int, size: int, what: str) -> bytes:
        """``size`` bytes at ``offset`` within the window (a copy)."""
        start = self.check(offset, size, what)
        with self._lock:
            data = os.pread(self._open(), size, start)
            if len(data) < size:
                raise self._shrank(what, os.fstat(self._fd).st_size)
        return data

    def write(self, offset: int, data: bytes | memoryview, what: str) -> None:
        """``data`` written at ``offset`` within the window; refused (nothing written) where the
        object no longer holds the window (written, it would grow again behind the client's back)."""
        start = self.check(offset, len(data), what)
        with self._lock:
            now = os.fstat(self._open()).st_size
            if now < start + len(data):
                raise self._shrank(what, now)
            os.pwrite(self._fd, data, start)

    def _open(self) -> int:
        """(Lock held.) The file, or the refusal of a region unregistered meanwhile."""
        if self._fd < 0:
            raise invalid(f"shared memory region {shown(self.name)} was unregistered while the request used it")
        return self._fd

    def _shrank(self, what: str, size: int) -> ProtocolError:
        return invalid(f"{what}: shared memory region {shown(self.name)}: its object {shown(self.key)} shrank to "
                       f"{size} bytes since it was registered (offset {self.offset} + byte_size {self.byte_size}); "
                       "register the region again")

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _object_path(key: str) -> str:
    """The file in /dev/shm a key names (``/input0`` and ``input0`` alike), or a refusal."""
    name = key.lstrip("/")
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise invalid(f"shared memory key {shown(key)} must name one POSIX shared-memory object (like '/input0')")
    return os.path.join(SHM_DIR, name)


class SharedMemoryRegions:
    """The system shared-memory regions registered with this server, shared by both front ends."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()  # registration may run on the loop while a decoding thread reads

    def register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the object ``key`` as region ``name``."""
        if not isinstance(name, str) or not name:
            raise invalid("registering system shared memory needs a region name")
        if not isinstance(key, str):
            raise invalid(f"shared memory region {shown(name)}: 'key' must be a string")
        offset = _count(offset, f"shared memory region {shown(name)}: 'offset'")
        byte_size = _count(byte_size, f"shared memory region {shown(name)}: 'byte_size'")
        path = _object_path(key)
        with self._lock:
            if name in self._regions:
                raise invalid(f"shared memory region {shown(name)} is already registered (unregister it first)")
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                raise invalid(f"shared memory region {shown(name)}: cannot open key {shown(key)}: "
                              f"{exc.strerror or exc}") from None
            try:  # the file stays open while the region is registered (closed by unregister)
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise invalid(f"shared memory region {shown(name)}: key {shown(key)} is not a shared-memory "
                                  "object")
                if offset + byte_size > info.st_size:
                    raise invalid(f"shared memory region {shown(name)}: offset {offset} + byte_size {byte_size} "
                                  f"runs past the end of key {shown(key)} ({info.st_size} bytes)")
                if byte_size == 0:
                    raise invalid(f"shared memory region {shown(name)}: byte_size must be at least 1")
            except BaseException:
                os.close(fd)
                raise
            self._regions[name] = Region(name, key, offset, byte_size, fd)

    def unregister(self, name: str | None) -> None:
        """Forget region ``name`` (every region where ``name`` is empty or None); unknown: refused."""
        with self._lock:
            if not name:
                regions, self._regions = list(self._regions.values()), {}
            else:
                region = self._regions.pop(name, None)
                if region is None:
                    raise self._unknown(name)
                regions = [region]
        for region in regions:
            region.close()

    def status(self, name: str | None) -> list[dict[str, Any]]:
        """Each region's name, key, offset and byte size (only ``name``'s, if given: unknown is refused)."""
        if name:
            return [self.region(name).status()]
        with self._lock:
            return [r.status() for r in self._regions.values()]

    def region(self, name: str) -> Region:
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise self._unknown(name)
        return region

    def _unknown(self, name: str) -> ProtocolError:
        listed = ", ".join(shown(n) for n in sorted(self._regions)[:16]) or "none"
        return ProtocolError("invalid", f"shared memory region {shown(name)} is not registered "
                                        f"(registered: {listed})")

    # -- per request -----------------------------------------------------------------------------
    def read_input(self, name: str, datatype: Any, shape: Any, placement: Mapping[str, Any]) -> np.ndarray:
        """Input ``name`` read (copied) from the region its parameters place it in."""
        what = f"input {shown(name)}"
        region, size, offset = placement_of(placement, what)
        return protocol.from_raw(name, datatype, shape, self.region(region).read(offset, size, what))

    def check_output(self, name: str, placement: Mapping[str, Any]) -> None:
        """Refuse, before the request runs, an output placed in an unknown region or outside one."""
        what = f"output {shown(name)}"
        region, size, offset = placement_of(placement, what)
        self.region(region).check(offset, size, what)

    def write_output(self, name: str, array: np.ndarray, placement: Mapping[str, Any]) -> int:
        """Output ``name`` written into the region its parameters name; returns its byte count.
        An output larger than the window given is refused by name (nothing is written)."""
        what = f"output {shown(name)}"
        region, size, offset = placement_of(placement, what)
        raw = protocol.to_raw(array)
        if len(raw) > size:
            raise invalid(f"{what} is {len(raw)} bytes, but {BYTE_SIZE} {size} given for shared memory region "
                          f"{shown(region)} holds fewer; give at least {len(raw)}")
        self.region(region).write(offset, raw, what)
        return len(raw)

    def close(self) -> None:
        self.unregister(None)


#: what a request from a client on another machine is told
REMOTE = ("system shared memory is only for clients on the server's machine (this request came from {peer}); "
          "send the tensors in the request")


@functools.lru_cache(maxsize=4096)
def local_peer(peer: str | None) -> bool:
    """Whether a connection's peer is on this machine: a loopback address (aiohttp's
    ``request.remote``: ``127.0.0.1``, ``::1``; gRPC's ``context.peer()``: ``ipv4:127.0.0.1:5000``,
    ``ipv6:[::1]:5000``) or a Unix socket. Remembered per address: a connection's peer comes with
    every request, and parsing it (``ipaddress``) was ~1 % of a served request's CPU."""
    if not peer:
        return False
    if peer.startswith("unix:"):
        return True
    peer = urllib.parse.unquote(peer)  # gRPC writes ipv6:%5B::1%5D:5000
    host = (peer[5:].rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer).strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def check_local(peer: str | None) -> None:
    """Refuse a shared-memory call from a client on another machine."""
    if not local_peer(peer):
        raise ProtocolError("refused", REMOTE.format(peer=shown(peer or "an unknown address")))


def placement_of(params: Mapping[str, Any], what: str) -> tuple[str, int, int]:
    """(region, byte size, offset) from an input's or output's parameters, checked."""
    region = params.get(REGION)
    if not isinstance(region, str) or not region:
        raise invalid(f"{what}: '{REGION}' must name a registered region")
    size = _count(params.get(BYTE_SIZE), f"{what}: '{BYTE_SIZE}'")
    return region, size, _count(params.get(OFFSET, 0), f"{what}: '{OFFSET}'")


def _count(value: object, what: str) -> int:
    """``value`` where it is a non-negative integer (not a bool), else the refusal naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise invalid(f"{what} must be a non-negative integer, got {protocol.cut(value, 40)}")
    return value


def in_shared_memory(params: Mapping[str, Any]) -> bool:
    """Whether an input's or output's parameters place it in shared memory."""
    return REGION in params
