"""A malformed frame's ProtocolError carries no raw control character.

msgspec quotes a bad value (an unknown tag, a name that fails its check)
raw in its message; a hostile peer's first frame then put ESC, CR, LF or a
bidi override into our exception's text, which applications print (sec29's
lead). decode_body escapes it.
"""

from __future__ import annotations

import msgspec
import pytest

from aioxfer.errors import ProtocolError
from aioxfer.protocol import decode_body

HOSTILE = "x\x1b[2J\r\n2026-12-07 [error] forged\u202e"


@pytest.mark.parametrize("body", [
    {"type": HOSTILE},
    {"type": "hello", "version": 1, "name": HOSTILE, "incarnation": 1, "purpose": "data",
     "nonce": b"n" * 16},
])
def test_a_malformed_frames_error_has_no_raw_control_character(body: dict[str, object]) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_body(msgspec.msgpack.encode(body))
    text = str(info.value)
    assert text.startswith("malformed frame")
    assert not any(not c.isprintable() for c in text), ascii(text)
