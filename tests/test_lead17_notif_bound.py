"""The NIXL shim's notification assembler bounds what all senders together
hold, not only each one: partial messages of senders that never finish them
(died mid-message, or a peer connecting under name after name) were kept at
up to 64 MiB a name for good."""

from __future__ import annotations

import pytest

from aioxfer.nixl import _wire


def test_all_senders_together_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_wire, "_MAX_HELD_BYTES", 1 << 20)
    drops: list[tuple[str, int]] = []
    asm = _wire.NotifAssembler(lambda s, n: drops.append((s, n)))
    msg = bytes(range(256)) * 1024  # 256 KiB: fragments, all but the last sent
    sent = [_wire.notif_frames(msg) for _ in range(64)]
    for i, frames in enumerate(sent):  # 64 senders, 16 MiB of unfinished messages
        for frame in frames[:-1]:
            assert asm.feed(f"dead-{i}", frame) is None
    assert asm.held() <= 1 << 20
    assert len(drops) >= 60 and sum(n for _, n in drops) + asm.held() == 64 * sum(
        len(f) - len(_wire.NOTIF_MAGIC) - 1 - _wire._ID for f in _wire.notif_frames(msg)[:-1])
    # A dropped message's last fragment is ignored (never a truncated message);
    # a live sender's next message still comes whole.
    assert asm.feed("dead-0", sent[0][-1]) is None
    got = [m for f in _wire.notif_frames(msg) if (m := asm.feed("live", f)) is not None]
    assert got == [msg]
