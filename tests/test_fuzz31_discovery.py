"""Hostile etcd keys and values (fuzz31): what anyone who can write the
discovery prefix controls.

- The discovery harness (fuzz/fuzz_discovery.py: watch events into a real
  Members) replays its seeds and committed corpus, in a process of its own.
- Its first finding, on a real etcd: a key under ``{prefix}/agents/`` whose
  name bytes are not UTF-8 was read with "replace", so b"x\\xff" and
  b"x\\xfe" were both the name "x\\ufffd": a value naming that at either key
  made a member, and a DELETE of the other key (no member's) removed it.
  Such a key is now no agent's key: skipped, and said (discovery.bad_value).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import within
from test_discovery import is_, next_event
from test_discovery_faults import config, etcd_proc, etcd_put  # noqa: F401 (a fixture)

from aioxfer.discovery import PeerJoined
from aioxfer.metadata import PROTOCOL_VERSION, AgentMeta

ROOT = Path(__file__).resolve().parent.parent
FUZZ = ROOT / "fuzz"


def test_discovery_corpus_replays(tmp_path: Path) -> None:
    corpus = FUZZ / "corpus" / "discovery"
    dirs = [str(corpus)] if corpus.is_dir() else []
    r = subprocess.run([sys.executable, str(FUZZ / "replay.py"), "discovery", *dirs],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = r.stdout + r.stderr[-4000:]
    assert r.returncode == 0, out
    n = int(r.stdout.split("replayed ", 1)[1].split()[0])
    files = len(list(corpus.iterdir())) if corpus.is_dir() else 0
    assert n >= 9 + files, out  # the seeds and every committed input ran


def _forged(name: str, incarnation: int = 9) -> bytes:
    return msgspec.json.encode(AgentMeta(
        version=PROTOCOL_VERSION, name=name, incarnation=incarnation, host_id="h", pid=1,
        address="127.0.0.1:9", transports=["tcp"], regions=[]))


async def test_key_not_utf8_is_no_member(etcd_proc: Any, make_agent: Any,  # noqa: F811
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Failed on the base: "x\\ufffd" became a member from the key b"x\\xff",
    and a DELETE of b"x\\xfe" removed the member a well-formed key made."""
    import aetcd  # type: ignore[import-untyped]

    disc = config(etcd_proc)
    a = await make_agent("a", discovery=disc)
    events = a.membership()
    agents = f"{disc.prefix}/agents/".encode()
    odd = "x\ufffd"
    # A forged value at a key that is not UTF-8, then a marker member: the
    # watch delivers in order, so once the marker joined, the odd key's PUT
    # was judged.
    await etcd_put(etcd_proc, agents + b"x\xff", _forged(odd))
    await etcd_put(etcd_proc, agents + b"marker-1", _forged("marker-1"))
    await next_event(events, is_(PeerJoined, "marker-1", 9), what="marker-1 joined")
    assert odd not in a._membership._members
    assert "the key is not UTF-8" in capsys.readouterr().err
    # The well-formed key of that name is a member; a DELETE of another key
    # that "replace" read as the same name leaves it one.
    await etcd_put(etcd_proc, agents + odd.encode(), _forged(odd))
    await next_event(events, is_(PeerJoined, odd, 9), what="the well-formed key's member")
    host, port = etcd_proc.endpoint.rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port)) as c:
        await within(c.delete(agents + b"x\xfe"))
    await etcd_put(etcd_proc, agents + b"marker-2", _forged("marker-2"))
    await next_event(events, is_(PeerJoined, "marker-2", 9), what="marker-2 joined")
    assert odd in a._membership._members
    # A newcomer's list agrees.
    b = await make_agent("b", discovery=disc)
    assert odd in b._membership._members and "marker-2" in b._membership._members
    assert not any("\ufffd" in n and n != odd for n in b._membership._members)
