"""nixl22: notifications a target never takes are dropped at a bound, and
that is logged through the layer's one rate limiter (_log_limited; it had a
limiter of its own): at most one line a second per agent, each saying how
many messages went since the line before, so that the lines add up to every
message dropped."""

from __future__ import annotations

import re
import time
import uuid

import pytest

from aioxfer.nixl import _bindings, nixl_agent, nixl_agent_config

STEP = 20.0


def _stored(agent: nixl_agent, count: int) -> None:
    """Waits until the target's pump has taken ``count`` messages in (stored
    or dropped): the notifications arrive asynchronously."""
    inner = agent.agent
    deadline = time.monotonic() + STEP
    while True:
        with inner._rt.locked():
            inner._take_notifs(inner._agent.notifications)
            seen = inner._seen
        if seen >= count:
            return
        assert time.monotonic() < deadline, f"{seen} of {count} notifications arrived"
        time.sleep(0.01)


def test_dropped_notifications_are_logged_at_most_once_a_second_and_add_up(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A small bound: 100 messages of 100 bytes (64 more each, as counted).
    monkeypatch.setattr(_bindings, "_NOTIF_STORE_BYTES", 100 * (100 + _bindings._NOTIF_COST))
    seen = {"n": 0}
    keep = _bindings.nixlAgent._keep_notif

    def counting(self: object, sender: str, frame: bytes) -> None:
        seen["n"] += 1
        keep(self, sender, frame)  # type: ignore[arg-type]

    monkeypatch.setattr(_bindings.nixlAgent, "_keep_notif", counting)
    monkeypatch.setattr(_bindings.nixlAgent, "_seen", property(lambda self: seen["n"]),
                        raising=False)
    sender = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    target = nixl_agent(str(uuid.uuid4()), nixl_agent_config())
    try:
        sender.add_remote_agent(target.get_agent_metadata())
        sent = 0
        start = time.monotonic()
        # Floods 0.6 s apart, then one message more than a second after the
        # last: the first drop is logged at once, the drops within the
        # second after a line are held back and counted in the next line
        # (the last message's drop writes the one that carries the rest).
        for burst in range(4):
            for i in range(400 if burst < 3 else 1):
                sender.send_notif(target.name, b"%03d-%03d-" % (burst, i) + b"x" * 92)
                sent += 1
            _stored(target, sent)
            time.sleep(0.6 if burst < 2 else 1.1 if burst == 2 else 0)
        elapsed = time.monotonic() - start
        kept = sum(len(v) for v in target.get_new_notifs().values())
        lines = [m for m in capsys.readouterr().err.splitlines() if "nobody took dropped" in m]
        counts = [int(re.search(r"notifications: (\d+) messages", m).group(1))  # type: ignore[union-attr]
                  for m in lines]
        assert 3 <= len(lines) <= int(elapsed) + 1, lines
        assert kept <= 100 and kept + sum(counts) == sent, (kept, counts, sent)
    finally:
        sender.close()
        target.close()
