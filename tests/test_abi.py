"""The generated ABI (tools/gen_abi.py): current, and the same in C, Cython and Python."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from aioxfer import _abi, _cyx, errors

ROOT = Path(__file__).resolve().parent.parent


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_abi", ROOT / "tools" / "gen_abi.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_abi"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gen_abi = _gen()


def test_generated_files_are_current(tmp_path: Path) -> None:
    # Regenerate from the header into a temporary tree: byte for byte what is
    # committed (else: python tools/gen_abi.py).
    rc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_abi.py"), "--out", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert rc.returncode == 0, rc.stderr
    for rel in (gen_abi.PXI, gen_abi.PY, gen_abi.PYI):
        assert (tmp_path / rel).read_text() == (ROOT / rel).read_text(), (
            f"{rel} is stale: run python tools/gen_abi.py"
        )
    check = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_abi.py"), "--check"],
        capture_output=True, text=True,
    )
    assert check.returncode == 0, check.stderr


def _copy_sources(dst: Path) -> None:
    for rel in (gen_abi.HEADER, gen_abi.INTERNAL_HEADER, gen_abi.PXI, gen_abi.PY, gen_abi.PYI):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, dst / rel)


def test_a_new_status_code_is_one_header_edit(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    header = tmp_path / gen_abi.HEADER
    lines = header.read_text().splitlines()
    new = min(_abi.STATUS_NAMES) - 1
    # The table's last entry is the first line after its #define that does
    # not continue: the new code goes after it.
    start = next(i for i, line in enumerate(lines) if "#define AXF_STATUS_TABLE(X)" in line)
    last = next(i for i in range(start, len(lines)) if not lines[i].rstrip().endswith("\\"))
    lines[last] += " \\"
    lines.insert(last + 1, f'    X(AXF_E_SOMETHING_NEW, {new}, "something \\"new\\"")')
    header.write_text("\n".join(lines) + "\n")
    check = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_abi.py"), "--root", str(tmp_path), "--check"],
        capture_output=True, text=True,
    )
    assert check.returncode == 1
    assert "aioxfer/_abi.py is stale" in check.stderr
    rc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_abi.py"), "--root", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert rc.returncode == 0, rc.stderr
    ns: dict[str, object] = {}
    exec((tmp_path / gen_abi.PY).read_text(), ns)
    assert ns["E_SOMETHING_NEW"] == new
    assert ns["STATUS_TEXT"] == {**_abi.STATUS_TEXT, new: 'something "new"'}
    assert f"E_SOMETHING_NEW = {new}" in (tmp_path / gen_abi.PXI).read_text()
    assert "E_SOMETHING_NEW: Final[int]" in (tmp_path / gen_abi.PYI).read_text()


def test_header_without_the_table_is_refused(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    header = tmp_path / gen_abi.HEADER
    header.write_text(header.read_text().replace("AXF_STATUS_TABLE(X)", "AXF_STATUS_LIST(X)"))
    rc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_abi.py"), "--root", str(tmp_path)],
        capture_output=True, text=True,
    )
    assert rc.returncode == 2
    assert "AXF_STATUS_TABLE" in rc.stderr


def test_compiled_edge_exports_the_generated_values() -> None:
    names = [n for n in vars(_abi) if n.isupper() and isinstance(getattr(_abi, n), int)]
    assert "E_LIMIT" in names and "MAX_CONNS" in names and "VERBS_MAX_DEVICES" in names
    for name in names:
        assert getattr(_cyx, name) == getattr(_abi, name), name
    for status, text in _abi.STATUS_TEXT.items():
        assert _cyx.strerror(status) == text
        assert errors.strerror(status) == text
    assert errors.strerror(min(_abi.STATUS_TEXT) - 1) == _cyx.strerror(min(_abi.STATUS_TEXT) - 1)


def test_every_status_has_an_error_class() -> None:
    # A new status code needs a decision in aioxfer/errors.py.
    assert set(errors._CLASS_BY_NAME) == set(_abi.STATUS_NAMES.values())
    assert errors.error_class(_abi.E_ACCESS) is errors.AccessDenied
    assert errors.error_class(_abi.E_PEER_LOST) is errors.PeerLost
    assert errors.error_class(_abi.E_LIMIT) is errors.TransportError
    err = errors.error_for_status(_abi.E_TIMEOUT, "reading")
    assert isinstance(err, errors.TransferTimeout) and isinstance(err, TimeoutError)
    assert str(err) == "reading: timed out" and err.status == _abi.E_TIMEOUT


def _compile_checks(tmp_path: Path, pxi: str) -> subprocess.CompletedProcess[str]:
    m = re.search(r'cdef extern from \*:\n    """\n(.*?)    """', pxi, re.S)
    assert m is not None
    src = tmp_path / "checks.c"
    src.write_text('#include "aioxfer.h"\n' + m.group(1))
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    return subprocess.run(
        [cc, "-std=c11", "-fsyntax-only", "-I", str(ROOT / "native" / "include"), str(src)],
        capture_output=True, text=True,
    )


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_stale_cython_include_fails_the_c_build(tmp_path: Path) -> None:
    # The build itself refuses an include whose values differ from the header.
    pxi = (ROOT / gen_abi.PXI).read_text()
    ok = _compile_checks(tmp_path, pxi)
    assert ok.returncode == 0, ok.stderr
    stale = pxi.replace("AXF_OK == 0,", "AXF_OK == 1,")
    assert stale != pxi
    bad = _compile_checks(tmp_path, stale)
    assert bad.returncode != 0
    assert "cyx/_abi.pxi is stale (AXF_OK)" in bad.stderr
