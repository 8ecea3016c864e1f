"""Type stub of aioxfer._cyx, the compiled Cython edge (cyx/_cyx.pyx; cyx/README.md).

Checked against the built module by ``python -m mypy.stubtest aioxfer._cyx``
(allowlist: tools/stubtest-allowlist.txt). The status codes and limits come
from aioxfer/_abi.py, generated from native/include/aioxfer.h
(tools/gen_abi.py): the same values _cyx exports.
"""

from collections.abc import Callable, Iterable
from typing import Any, Final, Self, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

# Status codes (native/include/aioxfer.h: AXF_STATUS_TABLE).
OK: Final[int]
E_INVALID: Final[int]
E_NOMEM: Final[int]
E_ACCESS: Final[int]
E_PEER_LOST: Final[int]
E_TIMEOUT: Final[int]
E_TRANSPORT: Final[int]
E_REGISTRATION: Final[int]
E_PROTOCOL: Final[int]
E_CLOSED: Final[int]
E_CANCELLED: Final[int]
E_NOTFOUND: Final[int]
E_LIMIT: Final[int]

ACCESS_READ: Final[int]
ACCESS_WRITE: Final[int]
EP_TCP: Final[int]
EP_SHM: Final[int]
EP_FILE: Final[int]
EP_VERBS: Final[int]
EP_CUDA: Final[int]
MEM_HOST: Final[int]
MEM_CUDA: Final[int]
MEM_FILE: Final[int]
OP_WRITE: Final[int]
OP_READ: Final[int]
OP_NOTIFY: Final[int]

CQ_XFER: Final[int]
CQ_NOTIFY: Final[int]
CQ_PEER_LOST: Final[int]
CQ_REGION_FREED: Final[int]
CQ_LOG: Final[int]
CQ_CONN_CLOSED: Final[int]
CQ_RAIL_DOWN: Final[int]

MAX_NOTIFY: Final[int]
VERBS_MAX_DEVICES: Final[int]
CUDA_IPC_HANDLE: Final[int]
DESC_FIELDS: Final[int]

# Type aliases of this stub only (private: the module has no such names).
# A descriptor array (n, DESC_FIELDS) uint64, or one descriptor as a tuple
# (lrid, loff, rrid, rkey, roff, len).
_Descs = npt.NDArray[np.uint64] | tuple[int, int, int, int, int, int]
# (kind, status, id, tag, nbytes, fail_index, payload)
_Record = tuple[int, int, int, int, int, int, bytes | None]
# (ep, op, descs, notify, req_id)
_PostItem = tuple[int, int, _Descs | None, Buffer | None, int]
# Queue pair parameters: (qpn, psn, mtu, lid, port, gid_index, gid), and from
# peers that say them (link layer, GID type, READ depth served).
_QPInfo7 = tuple[int, int, int, int, int, int, bytes]
_QPInfo = tuple[int, int, int, int, int, int, bytes, int, int, int]
# (rail, live, bytes, rate in bytes/ms, reroutes)
_RailStats = tuple[int, bool, int, int, int]

def strerror(status: int) -> str: ...
def file_backend() -> tuple[bool, str]: ...
def verbs_probe(provider: str | None = None) -> tuple[int, list[str], str]: ...

class NativeError(Exception):
    status: int
    what: str
    def __init__(self, status: int, what: str) -> None: ...

# @cython.final: cannot be subclassed.
@final
class Engine:
    # The constructor is __cinit__ (tp_new): every argument 0 is the engine's default.
    def __new__(
        cls,
        copy_workers: int = 0,
        chunk_bytes: int = 0,
        inline_bytes: int = 0,
        keepalive_ms: int = 0,
        peer_timeout_ms: int = 0,
        stall_ms: int = 0,
        max_conns: int = 0,
        max_notify_per_conn: int = 0,
        revoke_timeout_ms: int = 0,
        reply_queue_bytes: int = 0,
    ) -> Self: ...
    def fileno(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def shutdown(self) -> None: ...
    def close(self) -> None: ...
    # regions
    def register(self, obj: Buffer, memfd: int = -1) -> tuple[int, int, int, int, int]: ...
    def register_file(self, fd: int, offset: int, nbytes: int, access: int) -> tuple[int, int]: ...
    def file_backend(self) -> tuple[int, str]: ...
    def register_kind(
        self, kind: int, addr: int, nbytes: int, access: int, owner: object
    ) -> tuple[int, int]: ...
    def cuda_enable(self) -> tuple[int, str]: ...
    def cuda_pin_region(self, rid: int) -> int: ...
    def endpoint_import_cuda(
        self,
        ep: int,
        rid: int,
        key: int,
        nbytes: int,
        access: int,
        addr: int,
        handle: Buffer | None,
        offset: int,
        uuid: Buffer | None,
    ) -> None: ...
    def deregister(self, rid: int) -> None: ...
    def pinned_regions(self) -> int: ...
    # endpoints
    def endpoint_create(self, kind: int, tag: int, pid: int = 0, pidfd: int = -1) -> int: ...
    def endpoint_add_conn(self, ep: int, fd: int, rail: int = 0) -> None: ...
    def endpoint_rails(self, ep: int) -> list[_RailStats]: ...
    def endpoint_import(
        self, ep: int, rid: int, key: int, nbytes: int, access: int, addr: int, memfd: int = -1
    ) -> None: ...
    def endpoint_forget(self, ep: int, rid: int) -> None: ...
    def endpoint_close(self, ep: int) -> None: ...
    def accept_conn(self, fd: int, tag: int, pidfd: int = -1) -> None: ...
    def notify_release(self, tag: int, n: int) -> None: ...
    def region_holders(self, rid: int) -> list[int] | None: ...
    # data path
    def post(
        self,
        ep: int,
        op: int,
        descs: _Descs | None,
        notify: Buffer | None,
        req_id: int,
        defer: bool = False,
    ) -> int: ...
    def post_many(self, items: Iterable[_PostItem], polls: bool = False) -> list[int]: ...
    def doorbell(self) -> None: ...
    def cancel(self, req_id: int) -> int: ...
    def poll(self, max: int = 4096) -> list[_Record]: ...
    def drain(
        self,
        inflight: dict[int, Any],
        slow: Callable[[int, int, int, int, int, int, bytes | None], object],
        release: Callable[[Any], object],
        result_type: type,
        max: int = 4096,
    ) -> tuple[int, int, int]: ...
    def stats(self) -> dict[str, int]: ...
    # verbs
    def verbs_enable(self, provider: str | None = None) -> tuple[int, str]: ...
    def verbs_device_count(self) -> int: ...
    def verbs_region_keys(self, rid: int) -> list[tuple[int, int]]: ...
    def verbs_region_dmabuf(self, rid: int, fd: int, offset: int = 0) -> None: ...
    def verbs_qp_create(self, ep: int, dev: int) -> _QPInfo: ...
    def verbs_qp_connect(
        self, ep: int, dev: int, remote_dev: int, remote: _QPInfo | _QPInfo7
    ) -> None: ...
    def verbs_accept_qp(self, dev: int, remote: _QPInfo | _QPInfo7) -> tuple[int, _QPInfo]: ...
    def verbs_qp_destroy(self, handle: int) -> None: ...
    def verbs_accept_conn(self, fd: int, tag: int, handles: Iterable[int]) -> None: ...
    def endpoint_import_verbs(
        self, ep: int, rid: int, keys: Iterable[tuple[int, int]]
    ) -> None: ...

# CUDA (process-wide)
def cuda_probe() -> tuple[int, str, int]: ...
def cuda_device_name(ordinal: int) -> str: ...
def cuda_pointer(ptr: int, nbytes: int) -> tuple[int, int, int]: ...
def cuda_device_info(ordinal: int) -> tuple[bool, str, int]: ...
def cuda_describe(ptr: int, nbytes: int) -> tuple[int, str]: ...
def cuda_ipc_open_count() -> int: ...
def cuda_export(ptr: int) -> tuple[bytes, int, bytes]: ...
def cuda_alloc(device: int, nbytes: int) -> int: ...
def cuda_free(ptr: int) -> None: ...
def cuda_copy(dst: int, src: int, nbytes: int) -> None: ...
