"""``nixl._api``: NIXL's Python agent API (``nixl_agent``) over aioxfer.

Behaviour follows NIXL 1.5.1 call for call (see README "Coming from NIXL"):
descriptor inputs that are the wrong shape give None after logging an error;
unknown memory types, operations and backend names raise KeyError; failures
raise the ``nixl._bindings`` exceptions. The agent is built through
``_bindings.nixlAgent`` looked up at call time, as NIXL's own tests expect.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import operator
import sys
from collections.abc import Generator
from enum import Enum
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from aioxfer.nixl import _bindings as nixlBind
from aioxfer.nixl import _wire
from aioxfer.nixl.logging import get_logger

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]

logger = get_logger(__name__)

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT

# Backend handles never reach the user: plain ints.
nixl_backend_handle = int

_STATE = {0: "DONE", 1: "PROC"}  # any other status: "ERR"
# The native agent class as imported: nixl_agent builds its agent through
# the module attribute nixlBind.nixlAgent at call time (NIXL's test_nixl_api
# replaces that attribute by a plain function), so the class to test an agent
# against must be taken now, not read back from that attribute.
_NativeAgent = nixlBind.nixlAgent


def _is_tensor(obj: object) -> bool:
    # Only if torch is already imported: importing it here would cost ~1 s.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


# The numpy types get_serialized_descs carries (integers, either byte order):
# np.dtype() of a type string from the wire is only ever one of these.
_SERIAL_DTYPES = {d.str: d for t in (np.int8, np.int16, np.int32, np.int64, np.uint8,
                                      np.uint16, np.uint32, np.uint64)
                  for d in (np.dtype(t).newbyteorder("<"), np.dtype(t).newbyteorder(">"))}
_I64_MIN = -(2**63)
_U64_LIMIT = 2**64


def _serial_field(i: int, v: Any) -> int:
    """A descriptor tuple's integer field as msgpack carries it (numpy
    integers become ints; a float, a string, an int out of msgpack's range
    refused: pickle would carry them, no descriptor has them)."""
    if isinstance(v, float | str | bytes | bytearray):
        raise TypeError(f"cannot serialize descriptor {i}: field {v!r} is not an integer")
    try:
        n = operator.index(v)
    except TypeError:
        raise TypeError(f"cannot serialize descriptor {i}: field {v!r} is not an "
                        f"integer") from None
    if not _I64_MIN <= n < _U64_LIMIT:
        raise TypeError(f"cannot serialize descriptor {i}: field {n} is out of range")
    return n


def _serial_row(i: int, r: Any) -> list[int | str | bytes]:
    if not isinstance(r, tuple | list) or len(r) not in (3, 4):
        raise TypeError(f"cannot serialize descriptor {i}: {r!r} is not a tuple of (addr, "
                        f"len, devId) or (addr, len, devId, meta)")
    row: list[int | str | bytes] = [_serial_field(i, v) for v in r[:3]]
    if len(r) == 4:
        meta = r[3]
        if isinstance(meta, bytearray | memoryview):
            meta = bytes(meta)
        if not isinstance(meta, str | bytes):
            raise TypeError(f"cannot serialize descriptor {i}: meta {meta!r} is not str or bytes")
        row.append(meta)
    return row


def _serial_array(blob: _wire.DListBlob) -> npt.NDArray[Any]:
    dt = _SERIAL_DTYPES.get(blob.dtype)
    if dt is None:
        raise ValueError(f"array of type {blob.dtype!r}")
    shape = blob.shape
    if len(shape) not in (1, 2) or any(d < 0 for d in shape):
        raise ValueError(f"array of shape {shape}")
    if math.prod(shape) * dt.itemsize != len(blob.descs):
        raise ValueError(f"array of shape {shape} in {len(blob.descs)} bytes")
    return np.frombuffer(blob.descs, dtype=dt).reshape(shape).copy()


def _serial_rows(blob: _wire.DListBlob) -> list[Any] | tuple[Any, ...]:
    if len(blob.inner) != len(blob.rows):
        raise ValueError("descriptor rows and their kinds differ in number")
    out: list[Any] = []
    for row, kind in zip(blob.rows, blob.inner, strict=True):
        if (len(row) not in (3, 4) or kind not in "tl"
                or not all(type(v) is int for v in row[:3])
                or (len(row) == 4 and type(row[3]) not in (str, bytes))):
            raise ValueError("damaged descriptor row")
        out.append(tuple(row) if kind == "t" else row)
    return out if blob.kind == "list" else tuple(out)


class nixl_prepped_dlist_handle:
    """A prepared descriptor list. ``release()`` frees it (idempotent);
    dropping the last reference does so too."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent: nixlBind.nixlAgent, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            self._agent.releasedDlistH(self._handle)
            self._released = True

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                self._agent.releasedDlistH(self._handle)
            except Exception:
                pass


class nixl_xfer_handle:
    """A transfer request. ``release()`` frees it (cancelling it if it is in
    flight; idempotent); dropping the last reference does so too."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent: nixlBind.nixlAgent, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            self._agent.releaseXferReq(self._handle)
            self._released = True

    def future(self) -> concurrent.futures.Future[str]:
        """(aioxfer extension) A future of the current post: "DONE", or the
        exception check_xfer_state would raise; cancelling it cancels the
        transfer. ``asyncio.wrap_future(handle.future())`` in any loop."""
        return self._agent.xferFuture(self._handle)

    def __await__(self) -> Generator[Any, None, str]:
        """(aioxfer extension) ``await handle`` after ``agent.transfer(handle)``:
        "DONE" once it is, or the nixl exception; cancelling the awaiting
        task cancels the transfer."""
        return asyncio.wrap_future(self.future()).__await__()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                self._agent.releaseXferReq(self._handle)
            except Exception:
                pass


class nixl_thread_sync_t(Enum):
    """Thread synchronisation modes (accepted; aioxfer.nixl is always thread-safe)."""

    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:
    """``nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
    listen_port=DEFAULT_COMM_PORT, capture_telemetry=False, num_threads=0,
    backends=["UCX"], sync_mode=None)``.

    aioxfer's engine always progresses off the Python thread, so
    ``enable_prog_thread`` changes nothing; ``num_threads`` sets the engine's
    copy workers; ``enable_listen_thread`` starts the metadata listener on
    ``listen_port`` (0: any free port)."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] | None = None,
        sync_mode: nixl_thread_sync_t | None = None,
    ) -> None:
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})"
            )
        self.backends = ["UCX"] if backends is None else backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


class nixl_agent:
    """``nixl_agent(agent_name, nixl_conf=None, instantiate_all=False)``: one
    agent; registers memory, exchanges metadata, transfers, notifies. Safe to
    use from several threads at once."""

    def __init__(
        self,
        agent_name: str,
        nixl_conf: nixl_agent_config | None = None,
        instantiate_all: bool = False,
    ) -> None:
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning(
                "Ignoring instantiate_all based on the provided config in agent creation."
            )
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        default_sync = (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            if nixl_conf.enable_listen
            else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        cfg = nixlBind.nixlAgentConfig()
        cfg.useProgThread = nixl_conf.enable_pthread
        cfg.useListenThread = nixl_conf.enable_listen
        cfg.listenPort = nixl_conf.port
        cfg.syncMode = (nixl_conf.sync_mode or default_sync).value
        cfg.pthrDelay = 0
        cfg.lthrDelay = 100000
        cfg.captureTelemetry = nixl_conf.capture_telemetry
        # Looked up at call time: NIXL's tests replace it to inspect the config.
        self.agent = nixlBind.nixlAgent(agent_name, cfg)

        self.name = agent_name
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, int] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_list: list[str] = self.agent.getAvailPlugins()
        if not self.plugin_list:
            logger.error("No plugins available, cannot start transfers!")
            raise RuntimeError("No plugins available for NIXL, cannot start transfers!")
        self.plugin_b_options: dict[str, dict[str, str]] = {}
        self.plugin_mem_types: dict[str, list[str]] = {}

        backends = list(self.plugin_list) if instantiate_all else nixl_conf.backends
        for name in backends:
            if name not in self.plugin_list:
                logger.warning("Skipping backend registration %s due to the missing plugin.",
                               name)
                continue
            init: dict[str, str] = {}
            if nixl_conf.num_threads > 0 and name == "UCX":
                init["num_threads"] = str(nixl_conf.num_threads)
            self.create_backend(name, init)

        self.nixl_mems = {
            "DRAM": nixlBind.DRAM_SEG,
            "VRAM": nixlBind.VRAM_SEG,
            "FILE": nixlBind.FILE_SEG,
            "BLOCK": nixlBind.BLK_SEG,
            "OBJ": nixlBind.OBJ_SEG,
            "cpu": nixlBind.DRAM_SEG,  # deprecated
            "cuda": nixlBind.VRAM_SEG,  # deprecated
        }
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
        # The per-request calls, bound to the agent's own (same arguments,
        # same results): a Python frame fewer per post and per poll. Not
        # where a subclass overrides them, or where the agent is not ours
        # (nixlBind.nixlAgent replaced by a factory of something else).
        if isinstance(self.agent, _NativeAgent):
            cls = type(self)
            if cls.transfer is nixl_agent.transfer:
                self.transfer = self.agent.xferTransfer  # type: ignore[method-assign]
            if cls.check_xfer_state is nixl_agent.check_xfer_state:
                self.check_xfer_state = self.agent.xferState  # type: ignore[method-assign]
        logger.info("Initialized NIXL agent: %s", agent_name)

    # ------------------------------------------------------------ plugins and backends

    def _load_plugin_params(self, plugin: str) -> None:
        if plugin not in self.plugin_list:
            return
        try:
            options, mems = self.agent.getPluginParams(plugin)
        except Exception:
            logger.warning("Failed to load params for plugin %s", plugin, exc_info=True)
            return
        self.plugin_b_options[plugin] = options
        self.plugin_mem_types[plugin] = mems

    def get_plugin_list(self) -> list[str]:
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        if backend not in self.plugin_mem_types:
            self._load_plugin_params(backend)
        if backend not in self.plugin_mem_types:
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        if backend not in self.plugin_b_options:
            self._load_plugin_params(backend)
        if backend not in self.plugin_b_options:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend: str) -> list[str]:
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend: str) -> dict[str, str]:
        if backend in self.backend_options:
            return self.backend_options[backend]
        logger.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] | None = None) -> None:
        self.backends[backend] = self.agent.createBackend(backend, dict(initParams or {}))
        options, mems = self.agent.getBackendParams(self.backends[backend])
        self.backend_mems[backend] = mems
        self.backend_options[backend] = options
        logger.info("Backend %s was instantiated", backend)

    def _handles(self, backends: list[str] | None) -> list[int]:
        if not backends:
            return []
        return [self.backends[b] for b in backends]

    # ------------------------------------------------------------ memory

    def register_memory(self, reg_list: Any, mem_type: str | None = None,
                        backends: list[str] | None = None) -> nixlBind.nixlRegDList | None:
        descs = self.get_reg_descs(reg_list, mem_type)
        # None (malformed input, logged) raises TypeError here, as in NIXL.
        self.agent.registerMem(descs, self._handles(backends))  # type: ignore[arg-type]
        return descs

    def deregister_memory(self, dereg_list: nixlBind.nixlRegDList,
                          backends: list[str] | None = None) -> None:
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(self, reg_list: Any, backend: str, mem_type: str | None = None
                     ) -> list[dict[str, str] | None]:
        descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(
                f"Backend '{backend}' not found. Available backends: {list(self.backends)}"
            )
        return self.agent.queryMem(descs, self.backends[backend])  # type: ignore[arg-type]

    def make_connection(self, remote_agent: str | bytes, backends: list[str] | None = None
                        ) -> None:
        self.agent.makeConnection(remote_agent, self._handles(backends))

    # ------------------------------------------------------------ transfers

    def prep_xfer_dlist(self, agent_name: str | bytes, xfer_list: Any,
                        mem_type: str | None = None, backends: list[str] | None = None
                        ) -> nixl_prepped_dlist_handle:
        handles = self._handles(backends)
        if (isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2
                and xfer_list.shape[1] == 5):
            # NIXL 1.5.1's strided (compressed) form: (addr, len, devId,
            # stride, count) rows; it carries no memory type.
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            name = nixlBind.NIXL_INIT_AGENT if agent_name in ("NIXL_INIT_AGENT", "") else agent_name
            handle = self.agent.prepXferDlist(name, self.nixl_mems[mem_type], xfer_list, handles)
            return nixl_prepped_dlist_handle(self.agent, handle)
        descs = self.get_xfer_descs(xfer_list, mem_type)
        if agent_name in ("NIXL_INIT_AGENT", ""):
            handle = self.agent.prepXferDlist(descs, handles)
        else:
            handle = self.agent.prepXferDlist(agent_name, descs, handles)
        return nixl_prepped_dlist_handle(self.agent, handle)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        duration, err_margin, method = self.agent.estimateXferCost(req_handle._handle)
        name = ("ANALYTICAL_BACKEND" if method == nixlBind.NIXL_COST_ANALYTICAL_BACKEND
                else "UNKNOWN")
        return duration, err_margin, name

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Any, remote_xfer_side: nixl_prepped_dlist_handle,
                          remote_indices: Any, notif_msg: bytes | str = b"",
                          backends: list[str] | None = None, skip_desc_merge: bool = False
                          ) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        handle = self.agent.makeXferReq(
            op,
            local_xfer_side._handle,
            local_indices,
            remote_xfer_side._handle,
            remote_indices,
            notif_msg,
            self._handles(backends),
            skip_desc_merge,
        )
        return nixl_xfer_handle(self.agent, handle)

    def initialize_xfer(self, operation: str, local_descs: nixlBind.nixlXferDList,
                        remote_descs: nixlBind.nixlXferDList, remote_agent: str | bytes,
                        notif_msg: bytes | str = b"", backends: list[str] | None = None
                        ) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        handle = self.agent.createXferReq(op, local_descs, remote_descs, remote_agent,
                                          notif_msg, self._handles(backends))
        return nixl_xfer_handle(self.agent, handle)

    # (For an agent of ours, __init__ binds both to the agent's xferTransfer
    # and xferState, which do what these do.)
    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes | str = b"") -> str:
        return _STATE.get(self.agent.postXferReq(handle._handle, notif_msg), "ERR")

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        return _STATE.get(self.agent.getXferStatus(handle._handle), "ERR")

    def statistics(self) -> Any:
        """(aioxfer extension) The aioxfer agent's statistics(): these
        transfers counted by peer and path (None before UCX or POSIX exists)."""
        return self.agent.statistics()

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlBind.nixlXferTelemetry:
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        b_handle = self.agent.queryXferBackend(handle._handle)
        return next(name for name, h in self.backends.items() if h == b_handle)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: list[str] | None = None) -> int:
        return self.agent.prepMemView(dlist, self._handles(backends))

    def release_mem_view(self, mvh: int) -> None:
        self.agent.releaseMemView(mvh)

    # ------------------------------------------------------------ notifications

    def get_new_notifs(self, backends: list[str] | None = None) -> dict[str, list[bytes]]:
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends: list[str] | None = None) -> dict[str, list[bytes]]:
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes,
                               backends: list[str] | None = None, tag_is_prefix: bool = True
                               ) -> bool:
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        messages = self.notifs.get(remote_agent_name)
        if not messages:
            return False
        for i, msg in enumerate(messages):
            if (msg.startswith(lookup_tag) if tag_is_prefix else lookup_tag in msg):
                del messages[i]
                return True
        return False

    def send_notif(self, remote_agent_name: str | bytes, notif_msg: bytes | str,
                   backend: str | None = None) -> None:
        if backend is None:
            self.agent.genNotif(remote_agent_name, notif_msg)
        else:
            self.agent.genNotif(remote_agent_name, notif_msg, self.backends[backend])

    # ------------------------------------------------------------ metadata

    def get_agent_metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(self, descs: nixlBind.nixlRegDList,
                                   inc_conn_info: bool = False,
                                   backends: list[str] | None = None) -> bytes:
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: str | bytes) -> None:
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(self, descs: nixlBind.nixlRegDList,
                                    inc_conn_info: bool = False,
                                    backends: list[str] | None = None, ip_addr: str = "",
                                    port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        self.agent.sendLocalPartialMD(descs, inc_conn_info, self._handles(backends), ip_addr,
                                      port, label)

    def fetch_remote_metadata(self, remote_agent: str | bytes, ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT
                                  ) -> None:
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str | bytes,
                              descs: nixlBind.nixlXferDList | None = None) -> bool:
        if descs is None:
            descs = nixlBind.nixlXferDList(nixlBind.DRAM_SEG)
        return self.agent.checkRemoteMD(agent, descs) == nixlBind.NIXL_SUCCESS

    # ------------------------------------------------------------ descriptor lists

    @staticmethod
    def _tensor_mem_type(tensor: Any) -> str:
        return "DRAM" if tensor.get_device() == -1 else "VRAM"

    def _tensor_rows(self, tensors: list[Any]) -> np.ndarray | None:
        device = tensors[0].device
        rows = np.zeros((len(tensors), 3), dtype=np.uint64)
        for i, t in enumerate(tensors):
            if t.device != device:
                return None
            if not t.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            dev = t.get_device()
            rows[i, :] = (t.data_ptr(), t.numel() * t.element_size(), 0 if dev == -1 else dev)
        return rows

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None
                       ) -> nixlBind.nixlXferDList | None:
        """A nixlXferDList from: (addr, len, devId) tuples with a mem type, an
        Nx3 numpy array with a mem type, a tensor, a list of tensors, or a
        nixlXferDList (returned as it is). Other shapes: None, after logging."""
        if isinstance(descs, nixlBind.nixlXferDList):
            return descs
        if isinstance(descs, nixlBind.nixlRegDList):
            logger.error("RegList type detected for transfer, please use XferList")
            return None
        if isinstance(descs, np.ndarray):
            # NIXL reads descs[0] before it looks at the type: an empty (or
            # 0-d) array raises numpy's IndexError, as an empty list does.
            descs[0]  # noqa: B018
            if mem_type is not None and descs.ndim == 2 and descs.shape[1] == 3:
                return nixlBind.nixlXferDList(self.nixl_mems[mem_type], descs)
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
            else:
                logger.error("Nx3 shape required for transfer descriptor list from numpy array")
            return None
        if _is_tensor(descs):
            if not descs.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            dev = descs.get_device()
            return nixlBind.nixlXferDList(
                self.nixl_mems[self._tensor_mem_type(descs)],
                [(descs.data_ptr(), descs.numel() * descs.element_size(), 0 if dev == -1 else dev)],
            )
        if isinstance(descs[0], tuple):
            if mem_type is not None and len(descs[0]) == 3:
                return nixlBind.nixlXferDList(self.nixl_mems[mem_type], descs)
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
            else:
                logger.error("3-tuple list needed for transfer")
            return None
        if _is_tensor(descs[0]):
            rows = self._tensor_rows(descs)
            if rows is None:
                return None
            return nixlBind.nixlXferDList(self.nixl_mems[self._tensor_mem_type(descs[0])], rows)
        return None

    def get_remote_descs(self, descs: Any, mem_type: str | None = None
                         ) -> nixlBind.nixlRemoteDList | None:
        if isinstance(descs, nixlBind.nixlRemoteDList):
            return descs
        if isinstance(descs[0], tuple):
            if mem_type is not None and len(descs[0]) == 4:
                return nixlBind.nixlRemoteDList(self.nixl_mems[mem_type], descs)
            if mem_type is None:
                logger.error("Please specify a mem type")
            else:
                logger.error("4-tuple list (addr, len, dev_id, agent_name) needed for remote "
                             "descriptors")
        return None

    def get_reg_descs(self, descs: Any, mem_type: str | None = None
                      ) -> nixlBind.nixlRegDList | None:
        """A nixlRegDList from: (addr, len, devId, meta) tuples with a mem type,
        an Nx3 numpy array with a mem type (empty meta), a tensor, a list of
        tensors, or a nixlRegDList (returned as it is). Other shapes: None,
        after logging."""
        if isinstance(descs, nixlBind.nixlRegDList):
            return descs
        if isinstance(descs, nixlBind.nixlXferDList):
            logger.error("XferList type detected for registration, please use RegList")
            return None
        if isinstance(descs, np.ndarray):
            # NIXL reads descs[0] before it looks at the type: an empty (or
            # 0-d) array raises numpy's IndexError, as an empty list does.
            descs[0]  # noqa: B018
            if mem_type is not None and descs.ndim == 2 and descs.shape[1] == 3:
                return nixlBind.nixlRegDList(self.nixl_mems[mem_type], descs)
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
            else:
                logger.error("Nx3 shape required for transfer descriptor list from numpy array")
            return None
        if _is_tensor(descs):
            if not descs.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            dev = descs.get_device()
            return nixlBind.nixlRegDList(
                self.nixl_mems[self._tensor_mem_type(descs)],
                [(descs.data_ptr(), descs.numel() * descs.element_size(), 0 if dev == -1 else dev,
                  "")],
            )
        if isinstance(descs[0], tuple):
            if mem_type is not None and len(descs[0]) == 4:
                return nixlBind.nixlRegDList(self.nixl_mems[mem_type], descs)
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
            else:
                logger.error("4-tuple list needed for registration")
            return None
        if _is_tensor(descs[0]):
            rows = self._tensor_rows(descs)
            if rows is None:
                return None
            return nixlBind.nixlRegDList(self.nixl_mems[self._tensor_mem_type(descs[0])], rows)
        return None

    def get_serialized_descs(self, descs: Any) -> bytes:
        """A descriptor list as bytes for a peer (msgspec, not pickle: the
        peer's deserialize_descs runs no code from the wire). NIXL pickles
        anything; here what describes descriptors comes back as it went: a
        nixlXferDList or nixlRegDList, an integer numpy array of one or two
        dimensions (Nx3, a strided Nx5), a list or tuple of descriptor
        tuples (or lists) of three integers and maybe a meta (str, bytes);
        anything else is refused (TypeError)."""
        if isinstance(descs, nixlBind.nixlRegDList):
            blob = _wire.DListBlob("reg", int(descs.getType()), descs._a.tobytes(),
                                   list(descs._metas))
        elif isinstance(descs, nixlBind.nixlXferDList):
            blob = _wire.DListBlob("xfer", int(descs.getType()), descs._a.tobytes())
        elif isinstance(descs, np.ndarray):
            if descs.dtype.str not in _SERIAL_DTYPES or descs.ndim not in (1, 2):
                raise TypeError(f"cannot serialize a {descs.ndim}-dimensional {descs.dtype} "
                                f"array: descriptor arrays are 1 or 2-dimensional, of integers")
            # (In this host's byte order, as NIXL's pickle gives it back.)
            native = np.ascontiguousarray(descs, dtype=descs.dtype.newbyteorder("="))
            blob = _wire.DListBlob("ndarray", 0, native.tobytes(), dtype=native.dtype.str,
                                   shape=list(descs.shape))
        elif isinstance(descs, list | tuple):
            rows = [_serial_row(i, r) for i, r in enumerate(descs)]
            blob = _wire.DListBlob("list" if isinstance(descs, list) else "tuple", 0, b"",
                                   rows=rows,
                                   inner="".join("l" if isinstance(r, list) else "t"
                                                 for r in descs))
        else:
            raise TypeError(f"cannot serialize {type(descs).__name__}: a NIXL descriptor list, "
                            f"an integer numpy array or a list of descriptor tuples (never "
                            f"pickled: the bytes come from a peer)")
        return _wire.encode_dlist(blob)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        try:
            blob = _wire.decode_dlist(serialized_descs)
            if blob.kind == "ndarray":
                return _serial_array(blob)
            if blob.kind in ("list", "tuple"):
                return _serial_rows(blob)
            if len(blob.descs) % 24:
                raise ValueError("descriptor array of a wrong size")
            arr = np.frombuffer(blob.descs, dtype=np.uint64).reshape(-1, 3).copy()
            mem = nixlBind.nixl_mem_t(blob.mem)
        except (ValueError, msgspec.DecodeError) as exc:
            raise nixlBind.nixlInvalidParamError(f"NIXL_ERR_INVALID_PARAM: {exc}") from None
        if blob.kind == "xfer":
            return nixlBind.nixlXferDList(mem, arr)
        if blob.kind == "reg" and len(blob.metas) == arr.shape[0]:
            out = nixlBind.nixlRegDList(mem, arr)
            out._metas = list(blob.metas)
            return out
        raise nixlBind.nixlInvalidParamError("NIXL_ERR_INVALID_PARAM: unknown descriptor list")

    # ------------------------------------------------------------ aioxfer extension

    def close(self) -> None:
        """Closes the agent now rather than at exit (NIXL closes when the
        agent is destroyed): peers see it leave, its memory is released."""
        self.agent.close()
