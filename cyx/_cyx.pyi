"""Type stub for aioxfer._cyx (cyx/_cyx.pyx); see cyx/README.md."""

from collections.abc import Buffer, Iterable

import numpy as np
import numpy.typing as npt

OK: int
E_INVALID: int
E_NOMEM: int
E_ACCESS: int
E_PEER_LOST: int
E_TIMEOUT: int
E_TRANSPORT: int
E_REGISTRATION: int
E_PROTOCOL: int
E_CLOSED: int
E_CANCELLED: int
E_NOTFOUND: int

ACCESS_READ: int
ACCESS_WRITE: int
EP_TCP: int
EP_SHM: int
EP_FILE: int
EP_CUDA: int
MEM_HOST: int
MEM_CUDA: int
MEM_FILE: int
CUDA_IPC_HANDLE: int
OP_WRITE: int
OP_READ: int
OP_NOTIFY: int

CQ_XFER: int
CQ_NOTIFY: int
CQ_PEER_LOST: int
CQ_REGION_FREED: int
CQ_LOG: int
CQ_CONN_CLOSED: int
CQ_RAIL_DOWN: int

MAX_NOTIFY: int
DESC_FIELDS: int

Descs = npt.NDArray[np.uint64]
# (kind, status, id, tag, nbytes, fail_index, payload)
Record = tuple[int, int, int, int, int, int, bytes | None]
PostItem = tuple[int, int, Descs | None, Buffer | None, int]

def strerror(status: int) -> str: ...
def file_backend() -> tuple[bool, str]: ...

class NativeError(Exception):
    status: int
    what: str
    def __init__(self, status: int, what: str) -> None: ...

class Engine:
    def __init__(
        self,
        copy_workers: int = 0,
        chunk_bytes: int = 0,
        inline_bytes: int = 0,
        keepalive_ms: int = 0,
        peer_timeout_ms: int = 0,
        stall_ms: int = 0,
    ) -> None: ...
    def fileno(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def shutdown(self) -> None: ...
    def close(self) -> None: ...
    def register(self, obj: Buffer, memfd: int = -1) -> tuple[int, int, int, int, int]: ...
    def register_file(self, fd: int, offset: int, nbytes: int, access: int) -> tuple[int, int]: ...
    def file_backend(self) -> tuple[int, str]: ...
    def register_kind(
        self, kind: int, addr: int, nbytes: int, access: int, owner: object
    ) -> tuple[int, int]: ...
    def cuda_enable(self) -> tuple[int, str]: ...
    def endpoint_import_cuda(
        self,
        ep: int,
        rid: int,
        key: int,
        nbytes: int,
        access: int,
        addr: int,
        handle: bytes | None,
        offset: int,
        uuid: bytes | None,
    ) -> None: ...
    def deregister(self, rid: int) -> None: ...
    def pinned_regions(self) -> int: ...
    def endpoint_create(self, kind: int, tag: int, pid: int) -> int: ...
    def endpoint_add_conn(self, ep: int, fd: int, rail: int = 0) -> None: ...
    def endpoint_rails(self, ep: int) -> list[tuple[int, bool, int, int, int]]: ...
    def endpoint_import(
        self, ep: int, rid: int, key: int, nbytes: int, access: int, addr: int, memfd: int
    ) -> None: ...
    def endpoint_forget(self, ep: int, rid: int) -> None: ...
    def endpoint_close(self, ep: int) -> None: ...
    def accept_conn(self, fd: int, tag: int) -> None: ...
    def post(
        self,
        ep: int,
        op: int,
        descs: Descs | None,
        notify: Buffer | None,
        req_id: int,
        defer: bool = False,
    ) -> int: ...
    def post_many(self, items: Iterable[PostItem]) -> list[int]: ...
    def doorbell(self) -> None: ...
    def cancel(self, req_id: int) -> int: ...
    def poll(self, max: int = 4096) -> list[Record]: ...
    def stats(self) -> dict[str, int]: ...

def cuda_probe() -> tuple[int, str, int]: ...
def cuda_device_name(ordinal: int) -> str: ...
def cuda_pointer(ptr: int, nbytes: int) -> tuple[int, int, int]: ...
def cuda_export(ptr: int) -> tuple[bytes, int, bytes]: ...
def cuda_alloc(device: int, nbytes: int) -> int: ...
def cuda_free(ptr: int) -> None: ...
def cuda_copy(dst: int, src: int, nbytes: int) -> None: ...
