"""nixl31: arguments of the wrong kind, as NIXL's binding answers them: one
script run on aioxfer.nixl (through the shim) and, where its venv is
installed, on real NIXL 1.5.1, in test_nixl22_compat's style.

RECORDED is what real NIXL 1.5.1 answered on this machine (2026-12-07, UCX
on loopback). Its binding (pybind11) refuses any argument that is not the
declared kind with TypeError; each case marked "was:" answered otherwise
here before, as an exception no NIXL caller catches for this:

- check_remote_metadata(name, descs) with descs a list of tuples, an array
  (was: AttributeError) or a registration list (was: accepted, True);
- get_partial_agent_metadata / send_partial_agent_metadata with a transfer
  list (was: ValueError), a list of tuples or None (was: AttributeError);
- query_memory of tuples without a memory type (get_reg_descs gives None;
  was: AttributeError);
- a descriptor list indexed with a negative index (was: IndexError) or a
  string (was: ValueError): the binding's index is unsigned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import aioxfer.nixl

REAL_NIXL_PY = Path("/root/.cache/aioxfer-peers/venv-nixl/bin/python")

PROBE = r'''
import ctypes, json, os
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config


def case(name, fn):
    try:
        v = fn()
        out = ["ok", v if isinstance(v, (int, str, bool, type(None))) else type(v).__name__]
    except Exception as e:
        out = ["raise", type(e).__name__]
    print("@@" + json.dumps([name, out]), flush=True)


N = 1024
A = nixl_agent("A", nixl_agent_config(True, False, 0))
B = nixl_agent("B", nixl_agent_config(True, False, 0))
ba = (ctypes.c_ubyte * N)(); pa = ctypes.addressof(ba)
bb = (ctypes.c_ubyte * N)(); pb = ctypes.addressof(bb)
ra = A.register_memory([(pa, N, 0, "")], "DRAM")
rb = B.register_memory([(pb, N, 0, "")], "DRAM")
A.add_remote_agent(B.get_agent_metadata())
xd = A.get_xfer_descs([(pa, 16, 0), (pa + 16, 16, 0)], "DRAM")
fp = os.path.join(os.environ["PROBE_DIR"], "f")
open(fp, "wb").write(b"x" * 100)
A.create_backend("POSIX")

case("check_md_xfer", lambda: A.check_remote_metadata("B", B.get_xfer_descs([(pb, 16, 0)],
                                                                             "DRAM")))
case("check_md_none", lambda: A.check_remote_metadata("B", None))
case("check_md_list", lambda: A.check_remote_metadata("B", [(pb, 16, 0)]))
case("check_md_reglist", lambda: A.check_remote_metadata("B", rb))
case("check_md_np", lambda: A.check_remote_metadata("B", np.array([[pb, 16, 0]],
                                                                  dtype=np.uint64)))
case("partial_reg", lambda: A.get_partial_agent_metadata(ra, True))
case("partial_xfer", lambda: A.get_partial_agent_metadata(xd, True))
case("partial_list", lambda: A.get_partial_agent_metadata([(pa, 8, 0, "")], True))
case("partial_none", lambda: A.get_partial_agent_metadata(None, True))
case("send_partial_xfer", lambda: A.send_partial_agent_metadata(xd, True, ip_addr="127.0.0.1",
                                                                port=1))
case("query_reg", lambda: len(A.query_memory([(0, 0, 0, fp)], "POSIX", "FILE")))
case("query_no_mem", lambda: A.query_memory([(0, 0, 0, fp)], "POSIX"))
case("query_no_mem_ucx", lambda: A.query_memory([(pa, 8, 0, "")], "UCX"))
case("query_xfer", lambda: A.query_memory(xd, "POSIX"))
case("xd_item", lambda: xd[1][1])
case("xd_item_np", lambda: xd[np.uint32(1)][1])
case("xd_item_neg", lambda: xd[-1])
case("xd_item_str", lambda: xd["a"])
case("rd_item", lambda: ra[0][1])
case("rd_item_neg", lambda: ra[-1])
case("remdesc_neg", lambda: xd.remDesc(-1))
os._exit(0)  # (real NIXL can crash in its destructors at exit on some hosts)
'''

RECORDED: dict[str, list[Any]] = {
    "check_md_xfer": ["ok", True],
    "check_md_none": ["ok", True],
    "check_md_list": ["raise", "TypeError"],
    "check_md_reglist": ["raise", "TypeError"],
    "check_md_np": ["raise", "TypeError"],
    "partial_reg": ["ok", "bytes"],
    "partial_xfer": ["raise", "TypeError"],
    "partial_list": ["raise", "TypeError"],
    "partial_none": ["raise", "TypeError"],
    "send_partial_xfer": ["raise", "TypeError"],
    "query_reg": ["ok", 1],
    "query_no_mem": ["raise", "TypeError"],
    "query_no_mem_ucx": ["raise", "TypeError"],
    "query_xfer": ["raise", "TypeError"],
    "xd_item": ["ok", 16],
    "xd_item_np": ["ok", 16],
    "xd_item_neg": ["raise", "TypeError"],
    "xd_item_str": ["raise", "TypeError"],
    "rd_item": ["ok", 1024],
    "rd_item_neg": ["raise", "TypeError"],
    "remdesc_neg": ["raise", "IndexError"],
}


def _run(python: str, env: dict[str, str], cwd: Path) -> dict[str, list[Any]]:
    script = cwd / "probe.py"
    script.write_text(PROBE)
    env = dict(env, PROBE_DIR=str(cwd))
    proc = subprocess.run([python, str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    got = dict(json.loads(line[2:]) for line in proc.stdout.splitlines()
               if line.startswith("@@"))
    assert proc.returncode == 0 and len(got) == len(RECORDED), (
        f"rc={proc.returncode}, {len(got)} cases\n{proc.stderr[-3000:]}")
    return got


def _differences(got: dict[str, list[Any]]) -> list[str]:
    return [f"{k}: got {got.get(k)}, NIXL 1.5.1 {v}" for k, v in RECORDED.items()
            if got.get(k) != v]


def test_aioxfer_nixl_answers_as_nixl(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIXL_")}
    env["PYTHONPATH"] = aioxfer.nixl.shim_path()
    got = _run(sys.executable, env, tmp_path)
    assert not _differences(got), "\n".join(_differences(got))


@pytest.mark.skipif(not REAL_NIXL_PY.exists(), reason="real NIXL's venv is not installed here")
def test_recorded_answers_are_real_nixls(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NIXL_", "PYTHONPATH"))}
    env.update(UCX_NET_DEVICES="lo", UCX_MODULES="^ib")
    got = _run(str(REAL_NIXL_PY), env, tmp_path)
    assert not _differences(got), "\n".join(_differences(got))
