"""fz26: aioxfer.nixl's deserialize_descs (bytes from a peer, decoded with
msgspec since nixl24) on a descriptor row nested deeper than the
interpreter's recursion limit: DListBlob.rows was list[list[Any]], so msgspec
followed the nesting and raised RecursionError, out of deserialize_descs as
an untyped error, where every other damaged blob is NIXL_ERR_INVALID_PARAM
(tests/test_nixl24_compat.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from aioxfer.nixl import _bindings as nb
from aioxfer.nixl import _wire, nixl_agent, nixl_agent_config

DEPTH = 5000  # past any recursion limit a test runs under


@pytest.fixture
def agent() -> Any:
    a = nixl_agent("fz26-ser", nixl_agent_config())
    yield a
    a.close()


def _deep_rows(kind: str, in_meta: bool) -> bytes:
    """A serialized list whose one row holds an array nested DEPTH deep (as
    its first field, or as its meta), msgpack written by hand: msgspec's
    encoder would recurse as deep itself."""
    enc = msgspec.msgpack.encode
    deep = b"\x91" * DEPTH + b"\x01"
    row = b"\x94\x01\x02\x03" + deep if in_meta else b"\x93" + deep + b"\x02\x03"
    # DListBlob is array_like: kind, mem, descs, metas, dtype, shape, rows, inner
    body = (b"\x98" + enc(kind) + enc(0) + enc(b"") + enc([]) + enc("") + enc([])
            + b"\x91" + row + enc("t"))
    return _wire.DL_MAGIC + body


@pytest.mark.parametrize("kind", ["list", "tuple"])
@pytest.mark.parametrize("in_meta", [False, True])
def test_a_deeply_nested_row_is_invalid_param(agent: Any, kind: str, in_meta: bool) -> None:
    with pytest.raises(nb.nixlInvalidParamError):
        agent.deserialize_descs(_deep_rows(kind, in_meta))


def test_a_row_that_nests_shallowly_is_invalid_param_too(agent: Any) -> None:
    """(The blob the test above builds, 2 deep: refused as damaged, so the
    deep one fails only by its depth.)"""
    enc = msgspec.msgpack.encode
    blob = _wire.DL_MAGIC + enc(["list", 0, b"", [], "", [], [[[[1]], 2, 3]], "t"])
    with pytest.raises(nb.nixlInvalidParamError):
        agent.deserialize_descs(blob)
