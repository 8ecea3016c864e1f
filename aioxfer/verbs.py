"""RDMA verbs: what this machine has, for ``aioxfer info`` and the Agent.

The transport itself is native (native/src/verbs.c): libibverbs is loaded at
run time, so a build without rdma-core installed still runs (verbs is then
simply unavailable). ``AIOXFER_VERBS_PROVIDER=/path/to/lib.so`` loads a verbs
provider library of our own instead of libibverbs (the software provider of
native/tests/softverbs/ that the tests use); spawned processes inherit it.

What hardware decides is a setting with a safe default, read from the
environment when an Agent enables verbs (README, "RDMA settings"):
``AIOXFER_VERBS_DEVICES`` (allow-list of HCAs), ``AIOXFER_VERBS_GID_INDEX``
(else a RoCE v2, routable GID is picked), ``AIOXFER_VERBS_TIMEOUT`` (20),
``AIOXFER_VERBS_RETRY_CNT`` (7), ``AIOXFER_VERBS_TC`` / ``AIOXFER_VERBS_SL``
(0), ``AIOXFER_VERBS_RELAXED_ORDERING`` (1).

The functions below read the kernel's own view (sysfs: /sys/class/infiniband,
/sys/bus/pci) so they work, and say "none", on machines without RDMA.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass

from aioxfer import _cyx

__all__ = [
    "PROVIDER_ENV",
    "Gid",
    "Nic",
    "devices",
    "gpu_nic_affinity",
    "memlock_limit",
    "nics",
    "pair_rails",
    "peermem_loaded",
    "provider",
    "recommended_devices",
    "status",
]

PROVIDER_ENV = "AIOXFER_VERBS_PROVIDER"
SYSFS_IB = "/sys/class/infiniband"
_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def provider() -> str | None:
    """The verbs provider library to load instead of libibverbs, if any."""
    return os.environ.get(PROVIDER_ENV) or None


def status() -> tuple[bool, str]:
    """(available, what was found): available when at least one device with
    an active port is there. A kernel without InfiniBand (ENOSYS) is "no
    devices", never an error."""
    n, _, why = _cyx.verbs_probe(provider())
    return n > 0, why


def devices() -> list[str]:
    """One line per usable device: name, port, link layer, MTU, the GID chosen
    (index, address, type)."""
    n, names, _ = _cyx.verbs_probe(provider())
    return names if n > 0 else []


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str
    type: str  # "IB/RoCE v1", "RoCE v2", or "" where the kernel does not say


@dataclass(frozen=True)
class Nic:
    """An RDMA device as the kernel shows it (sysfs)."""

    name: str
    pci: str  # "0000:17:00.0", "" for a software device
    ports: dict[int, tuple[str, str]]  # port -> (state, link layer)
    gids: dict[int, list[Gid]]  # port -> non-empty GID entries


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def nics(root: str = SYSFS_IB) -> list[Nic]:
    """Every RDMA device the kernel has, with its ports' state and link layer
    and their GID tables; [] where there is none."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    out = []
    for name in names:
        base = os.path.join(root, name)
        pci = os.path.basename(os.path.realpath(os.path.join(base, "device")))
        if not _BDF.fullmatch(pci):
            pci = ""
        ports: dict[int, tuple[str, str]] = {}
        gids: dict[int, list[Gid]] = {}
        try:
            port_names = sorted(os.listdir(os.path.join(base, "ports")), key=int)
        except (OSError, ValueError):
            port_names = []
        for p in port_names:
            pb = os.path.join(base, "ports", p)
            state = _read(os.path.join(pb, "state")).split(":")[-1].strip()
            ports[int(p)] = (state, _read(os.path.join(pb, "link_layer")))
            table = []
            try:
                idx = sorted(os.listdir(os.path.join(pb, "gids")), key=int)
            except (OSError, ValueError):
                idx = []
            for i in idx:
                g = _read(os.path.join(pb, "gids", i))
                if not g or set(g.replace(":", "")) == {"0"}:
                    continue
                table.append(Gid(int(i), g, _read(os.path.join(pb, "gid_attrs", "types", i))))
            gids[int(p)] = table
        out.append(Nic(name, pci, ports, gids))
    return out


def _pci_path(bdf: str) -> list[str]:
    """The PCIe path from the root complex down to a device: its bridges."""
    if not bdf:
        return []
    real = os.path.realpath(os.path.join("/sys/bus/pci/devices", bdf.lower()))
    return [p for p in real.split("/") if _BDF.fullmatch(p)]


def _distance(a: list[str], b: list[str]) -> int:
    """Hops between two PCIe devices through their closest common bridge
    (NCCL's PIX/PXB < PHB < SYS); a large number when they share no root."""
    if not a or not b:
        return 1 << 10
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return 1 << 8  # different root complexes: through the CPU interconnect
    return len(a) + len(b) - 2 * common


def gpu_nic_affinity(gpu_pci: list[str], nic_list: list[Nic] | None = None) -> dict[int, list[str]]:
    """For each GPU (by ordinal, its PCI address), the RDMA devices closest to
    it in the PCIe tree, nearest first. GPUDirect RDMA is fast only between a
    GPU and a NIC under one PCIe switch (or root complex)."""
    nl = nics() if nic_list is None else nic_list
    out: dict[int, list[str]] = {}
    for i, bdf in enumerate(gpu_pci):
        gp = _pci_path(bdf)
        ranked = sorted(nl, key=lambda n: (_distance(gp, _pci_path(n.pci)), n.name))
        out[i] = [n.name for n in ranked]
    return out


def recommended_devices(gpu: int) -> list[str]:
    """The RDMA devices to use for GPU ``gpu``: those at the smallest PCIe
    distance from it (for ``AIOXFER_VERBS_DEVICES``); [] when unknown."""
    from aioxfer import cuda

    info = cuda.device_info()
    nl = nics()
    if gpu >= len(info) or not nl:
        return []
    gp = _pci_path(info[gpu].pci)
    best = min(_distance(gp, _pci_path(n.pci)) for n in nl)
    return [n.name for n in nl if _distance(gp, _pci_path(n.pci)) == best]


def _link_layer(device_line: str) -> str:
    """"Ethernet" / "InfiniBand" from a ``devices()`` line; "" if it does not say."""
    m = re.search(r"\b(Ethernet|InfiniBand)\b", device_line)
    return m.group(1) if m else ""


def pair_rails(ours: list[str], theirs: list[str]) -> list[tuple[int, int]]:
    """Rails as (our device, the peer's device) pairs, both from ``devices()``
    lines: each of ours with the next unused one of theirs on the same link
    layer (InfiniBand never pairs with RoCE). Replaces pairing by index."""
    used: set[int] = set()
    pairs = []
    for i, mine in enumerate(ours):
        ll = _link_layer(mine)
        for j, other in enumerate(theirs):
            if j not in used and _link_layer(other) == ll:
                used.add(j)
                pairs.append((i, j))
                break
    return pairs


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK in bytes (soft limit); None when unlimited. Every byte
    registered counts against it once per device it is registered on."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def peermem_loaded() -> str | None:
    """The kernel module that lets plain ibv_reg_mr pin GPU memory
    (nvidia_peermem, or the older nv_peer_mem), if loaded."""
    for mod in ("nvidia_peermem", "nv_peer_mem"):
        if os.path.isdir(f"/sys/module/{mod}"):
            return mod
    return None
