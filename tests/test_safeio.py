"""detrl.formats.safeio: reads of an untrusted bundle stay inside it, never block, are bounded; writes are atomic."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.formats import safeio
from detrl.formats.safeio import (
    DirLock,
    LockedError,
    UnsafeInput,
    dumps_json,
    loads_json,
    open_regular,
    read_bounded,
    read_file,
    write_atomic,
)

CKPT = "checkpoints/step_00000004.safetensors"


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    root = tmp_path / "bundle"
    (root / "checkpoints").mkdir(parents=True)
    (root / "manifest.json").write_bytes(b'{"format": "detrl-bundle"}\n')
    (root / CKPT).write_bytes(b"weights")
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A real file outside the bundle, standing for the auditor's own secrets."""
    p = tmp_path / "secret"
    p.write_bytes(b"auditor's private key")
    return p


def refused(root: Path, rel: str, max_bytes: int = 1 << 20) -> str:
    with pytest.raises(UnsafeInput) as ei:
        read_file(root, rel, max_bytes)
    msg = str(ei.value)
    assert msg.startswith(f"{rel}:") or msg.startswith(f"{rel!r}:"), msg
    return msg


# --------------------------------------------------------------------------------------------------- reads


def test_regular_files_read(bundle: Path) -> None:
    assert read_file(bundle, "manifest.json", 100) == b'{"format": "detrl-bundle"}\n'
    assert read_file(bundle, CKPT, 7) == b"weights"  # exactly at the cap is allowed
    f, size = open_regular(bundle, CKPT, 100)
    with f:
        assert size == 7 and f.read() == b"weights"


def test_root_may_be_a_symlink(bundle: Path, tmp_path: Path) -> None:
    link = tmp_path / "named-by-auditor"
    link.symlink_to(bundle)
    assert read_file(link, CKPT, 100) == b"weights"


def test_symlinked_file_refused(bundle: Path, outside: Path) -> None:
    (bundle / "manifest.json").unlink()
    (bundle / "manifest.json").symlink_to(outside)
    assert refused(bundle, "manifest.json") == "manifest.json: is a symbolic link"
    (bundle / CKPT).unlink()
    (bundle / CKPT).symlink_to(outside)
    assert refused(bundle, CKPT) == f"{CKPT}: is a symbolic link"


def test_symlinked_intermediate_dir_refused(bundle: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (bundle / "checkpoints").rename(elsewhere)
    (bundle / "checkpoints").symlink_to(elsewhere)
    assert (bundle / CKPT).read_bytes() == b"weights"  # a following reader would get it
    msg = refused(bundle, CKPT)
    assert "checkpoints is a symbolic link" in msg


def test_intermediate_not_a_directory_refused(bundle: Path) -> None:
    (bundle / "roundlog").write_bytes(b"x")
    assert "is not a directory" in refused(bundle, "roundlog/step")


def _within(
    timeout_s: float, fn: Callable[[], object], unblock: Callable[[], None] = lambda: None
) -> BaseException:
    """Run ``fn`` in a daemon thread and return what it raised; fail the test (instead of hanging the
    suite) if it has not finished after ``timeout_s`` seconds, or if it returned without raising."""
    result: list[BaseException | None] = []

    def target() -> None:
        try:
            fn()
            result.append(None)
        except BaseException as e:  # handed to the test
            result.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        unblock()
        pytest.fail(f"did not finish within {timeout_s} s")
    if result[0] is None:
        pytest.fail("did not raise")
    return result[0]


def _open_in_thread(root: Path, rel: str, timeout_s: float) -> BaseException:
    """open_regular(root, rel) in a thread with a timeout; a regression that blocks fails instead of hanging."""

    def unblock() -> None:  # a reader stuck in open() of a FIFO waits for a writer: give it one
        with contextlib.suppress(OSError):
            os.close(os.open(root / rel, os.O_WRONLY | os.O_NONBLOCK))

    return _within(timeout_s, lambda: open_regular(root, rel, 1 << 20)[0].close(), unblock)


def test_fifo_refused_without_blocking(bundle: Path) -> None:
    os.mkfifo(bundle / "roundlog")
    err = _open_in_thread(bundle, "roundlog", 2.0)
    assert isinstance(err, UnsafeInput) and str(err) == "roundlog: not a regular file"


@pytest.fixture
def race_past_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-open lstat sees nothing, as if the entry was swapped in just after it: the flags on the
    open and the fstat after it must refuse on their own."""
    monkeypatch.setattr(safeio, "_look", lambda name, dir_fd: None)


@pytest.mark.usefixtures("race_past_look")
def test_fifo_swapped_in_after_the_look_does_not_block(bundle: Path) -> None:
    os.mkfifo(bundle / "roundlog")
    err = _open_in_thread(bundle, "roundlog", 2.0)
    assert isinstance(err, UnsafeInput) and str(err) == "roundlog: not a regular file"


@pytest.mark.usefixtures("race_past_look")
@pytest.mark.parametrize("target", ["/dev/zero", "outside"])
def test_symlink_swapped_in_after_the_look_refused(bundle: Path, outside: Path, target: str) -> None:
    (bundle / "commitments").symlink_to(outside if target == "outside" else target)
    assert refused(bundle, "commitments") == "commitments: is a symbolic link"


@pytest.mark.usefixtures("race_past_look")
def test_directory_swapped_in_after_the_look_refused(bundle: Path) -> None:
    (bundle / "commitments").mkdir()
    assert refused(bundle, "commitments") == "commitments: not a regular file"


def test_symlink_to_dev_zero_refused(bundle: Path) -> None:
    (bundle / "commitments").symlink_to("/dev/zero")
    assert refused(bundle, "commitments") == "commitments: is a symbolic link"


def test_directory_in_place_of_file_refused(bundle: Path) -> None:
    (bundle / "commitments").mkdir()
    assert refused(bundle, "commitments") == "commitments: not a regular file"


def test_oversize_refused_before_reading(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (bundle / "roundlog").write_bytes(b"x" * 11)

    def no_read(*a: object) -> bytes:
        raise AssertionError("read before the size check")

    monkeypatch.setattr(safeio, "read_bounded", no_read)
    assert refused(bundle, "roundlog", 10) == "roundlog: 11 bytes, larger than the cap of 10 bytes"


def test_sparse_huge_file_refused_quickly(bundle: Path) -> None:
    with open(bundle / "roundlog", "wb") as f:
        f.truncate(1 << 33)  # 8 GiB, sparse
    t0 = time.monotonic()
    assert "8589934592 bytes, larger than the cap" in refused(bundle, "roundlog", 1 << 20)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    "rel",
    ["..", "../secret", "checkpoints/..", "checkpoints/../../secret", "/etc/passwd", "", ".",
     "checkpoints//x", "checkpoints/", "a/b/c", "nul\x00byte"],
)  # fmt: skip
def test_paths_that_could_leave_the_bundle_refused(bundle: Path, rel: str) -> None:
    msg = refused(bundle, rel)
    assert "not a bundle-relative path" in msg


def test_missing(bundle: Path, tmp_path: Path) -> None:
    assert refused(bundle, "roundlog") == "roundlog: missing"
    assert refused(bundle, "nodir/x") == "nodir/x: missing"
    assert refused(tmp_path / "no-bundle", "manifest.json").startswith("manifest.json: missing")


def test_truncated_and_grown_while_reading(bundle: Path) -> None:
    f, size = open_regular(bundle, CKPT, 100)
    with f:
        err = _within(2.0, lambda: read_bounded(f, size + 5, CKPT))  # a reader that loops on EOF fails
    assert isinstance(err, UnsafeInput) and str(err).startswith(f"{CKPT}: truncated while reading")
    f, size = open_regular(bundle, CKPT, 100)
    with open(bundle / CKPT, "ab") as g:
        g.write(b"more")
    with f, pytest.raises(UnsafeInput, match=f"^{CKPT}: changed while reading"):
        read_bounded(f, size, CKPT)


def test_read_bounded_reads_in_chunks(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(safeio, "CHUNK_BYTES", 3)
    data = bytes(range(256)) * 5
    (bundle / "roundlog").write_bytes(data)
    assert read_file(bundle, "roundlog", len(data)) == data


# ---------------------------------------------------------------------------------------------------- JSON


def json_refused(data: bytes | str, what: str = "manifest.json") -> str:
    if isinstance(data, str):
        data = data.encode()
    with pytest.raises(UnsafeInput) as ei:
        loads_json(data, what)
    msg = str(ei.value)
    assert msg.startswith(f"{what}: ") and "\n" not in msg, msg
    return msg


def nested(depth: int) -> str:
    """``depth`` levels alternating object and array: {"a":[{"a":[...0...]}]}."""
    opens = ['{"a":' if i % 2 == 0 else "[" for i in range(depth)]
    closes = ["}" if i % 2 == 0 else "]" for i in reversed(range(depth))]
    return "".join(opens) + "0" + "".join(closes)


def test_depth_limit() -> None:
    assert loads_json(("[" * 32 + "]" * 32).encode(), "m") == eval("[" * 32 + "]" * 32)
    assert safeio.nesting_depth(nested(32)) == 32
    assert loads_json(nested(32).encode(), "m") is not None
    assert "nested 33 levels deep" in json_refused("[" * 33 + "]" * 33)
    assert "nested 33 levels deep" in json_refused(nested(33))
    assert loads_json(b"[[1]]", "m", max_depth=2) == [[1]]
    assert "more than 1" in json_refused_with(b"[[1]]", max_depth=1)


def json_refused_with(data: bytes, **kw: int) -> str:
    with pytest.raises(UnsafeInput) as ei:
        loads_json(data, "m", **kw)
    return str(ei.value)


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deep_nesting_refused_before_parsing(depth: int) -> None:
    # Without the pre-scan json.loads would raise RecursionError (caught, but with another reason).
    msg = json_refused("[" * depth + "]" * depth)
    assert f"nested {depth} levels deep" in msg
    msg = json_refused("[" * depth)  # unterminated too
    assert "nested" in msg


def test_depth_not_fooled_by_strings() -> None:
    # Brackets inside strings do not count ...
    s = '["' + "[{" * 100 + '"]'
    assert loads_json(s.encode(), "m") == ["[{" * 100]
    # ... nor after an escaped quote inside the string ...
    s = '["\\"' + "[" * 100 + '"]'
    assert loads_json(s.encode(), "m") == ['"' + "[" * 100]
    # ... nor after an escaped backslash (the quote after it does end the string) ...
    s = '{"k\\\\": "' + "{" * 50 + '\\\\"}'
    assert loads_json(s.encode(), "m") == {"k\\": "{" * 50 + "\\"}
    # ... and closing brackets in strings do not hide real depth.
    s = '["]]]]]]]]]]",' * 33 + "0" + "]" * 33
    assert "nested 33 levels deep" in json_refused(s)
    s = '["\\\\",' * 33 + "0" + "]" * 33  # the string ends at the quote after an escaped backslash
    assert "nested 33 levels deep" in json_refused(s)


def test_numbers() -> None:
    assert loads_json(f"[{2**128 - 1}, {-(2**128)}, 1.5e300, -0.0]".encode(), "m") == [
        2**128 - 1,
        -(2**128),
        1.5e300,
        0.0,
    ]
    assert "integer literal of 10000 characters" in json_refused("1" * 10_000)
    assert "integer literal of 10001 characters" in json_refused("-" + "1" * 10_000)
    assert "outside" in json_refused(str(2**128))
    assert "outside" in json_refused(str(-(2**128) - 1))
    assert "not finite" in json_refused("1e999")
    assert "not finite" in json_refused("[-1e999]")
    assert "number literal of 52 characters" in json_refused("0." + "1" * 50)


@pytest.mark.parametrize("const", ["NaN", "Infinity", "-Infinity", "[NaN]", '{"a": Infinity}'])
def test_non_finite_constants_refused(const: str) -> None:
    assert "is not JSON" in json_refused(const)


def test_duplicate_keys_refused() -> None:
    assert "duplicate key 'a'" in json_refused('{"a": 1, "b": 2, "a": 1}')
    assert "duplicate key 'x'" in json_refused('{"a": [{"x": 1, "x": 2}]}')
    assert loads_json(b'{"a": {"a": 1}}', "m") == {"a": {"a": 1}}  # same key at another level is fine


def test_invalid_utf8_and_syntax() -> None:
    assert json_refused(b'{"a": "\xff"}').startswith("manifest.json: not UTF-8")
    assert "not valid JSON" in json_refused(b'{"a": ')
    assert "not valid JSON" in json_refused(b"")
    assert "not valid JSON" in json_refused(b'{"a": 1} trailing')
    assert "not valid JSON" in json_refused(b'"control \x01 char"')
    assert "not valid JSON" in json_refused(b'["unterminated')


MANIFEST = {
    "format": "detrl-bundle",
    "version": 2,
    "config": {"lr": 0.00025, "gamma": 0.99, "steps": 1000, "env": "Pong", "seed": -7, "flags": [True, None]},
    "merkle_root": "ab" * 32,
    "files": {"roundlog": {"sha256": "cd" * 32, "bytes": 123456}, 'x\\"[': {"nested": [[1], {"a": []}]}},
}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_unsafe_input(data: bytes) -> None:
    try:
        loads_json(data, "manifest.json")
    except UnsafeInput as e:
        assert str(e).startswith("manifest.json: ") and "\n" not in str(e)


@st.composite
def mutated_manifest(draw: st.DrawFn) -> bytes:
    data = bytearray(dumps_json(MANIFEST))
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "dup"]))
        i = draw(st.integers(0, len(data)))
        if kind == "flip" and i < len(data):
            data[i] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[i:i] = draw(st.sampled_from([b"[", b"{", b"]", b"}", b'"', b"\\", b",", b":", b"9" * 50,
                                              b"1e999", b"NaN", b'"format":1,', b"\xff", b"\xc3"]))  # fmt: skip
        elif kind == "delete":
            del data[i : i + draw(st.integers(1, 5))]
        else:
            j = draw(st.integers(0, len(data)))
            data[i:i] = data[min(i, j) : max(i, j)]
    return bytes(data)


@settings(max_examples=300, deadline=None)
@given(mutated_manifest())
def test_mutated_manifest_only_raises_unsafe_input(data: bytes) -> None:
    try:
        loads_json(data, "manifest.json")
    except UnsafeInput as e:
        assert str(e).startswith("manifest.json: ") and "\n" not in str(e)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**128), 2**128 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_dumps_loads_round_trip(value: object) -> None:
    data = dumps_json(value)
    assert data.endswith(b"\n") and data.isascii()
    assert dumps_json(loads_json(data, "m")) == data


def test_dumps_json_canonical() -> None:
    a = dumps_json({"b": 1, "a": [1, 2], "é": "ü"})
    b = dumps_json({"é": "ü", "a": [1, 2], "b": 1})
    assert a == b == b'{\n "a": [\n  1,\n  2\n ],\n "b": 1,\n "\\u00e9": "\\u00fc"\n}\n'
    with pytest.raises(ValueError):
        dumps_json({"x": float("nan")})


# -------------------------------------------------------------------------------------------------- writes


def test_write_atomic(tmp_path: Path) -> None:
    write_atomic(tmp_path, "manifest.json", b"one")
    assert (tmp_path / "manifest.json").read_bytes() == b"one"
    write_atomic(tmp_path, "manifest.json", b"two" * 100_000)
    assert (tmp_path / "manifest.json").read_bytes() == b"two" * 100_000
    assert sorted(os.listdir(tmp_path)) == ["manifest.json"]


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_atomic(tmp_path, "manifest.json", b"old")

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        write_atomic(tmp_path, "manifest.json", b"new")
    assert (tmp_path / "manifest.json").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["manifest.json"]


def test_write_atomic_does_not_follow_a_planted_temp_link(tmp_path: Path, outside: Path) -> None:
    (tmp_path / ".manifest.json.tmp").symlink_to(outside)
    with pytest.raises(OSError):
        write_atomic(tmp_path, "manifest.json", b"new")
    assert outside.read_bytes() == b"auditor's private key"
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x"])
def test_write_atomic_refuses_paths(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        write_atomic(tmp_path, name, b"x")


def test_fsync_dir(tmp_path: Path) -> None:
    safeio.fsync_dir(tmp_path)
    with pytest.raises(OSError):
        safeio.fsync_dir(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------------- lock

# Loads safeio.py by path, so the child skips `import detrl` (which imports torch: seconds).
CHILD = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("safeio", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
try:
    lock = m.DirLock(Path(sys.argv[2])).acquire()
except m.LockedError as e:
    print("LOCKED", e, flush=True); sys.exit(3)
print("ACQUIRED", flush=True)
if sys.argv[3] == "hold":
    time.sleep(60)
"""


def child(path: Path, mode: str = "try") -> list[str]:
    return [sys.executable, "-c", CHILD, safeio.__file__, str(path), mode]


def test_lock_refuses_another_process(tmp_path: Path) -> None:
    with DirLock(tmp_path) as lock:
        assert lock.held
        r = subprocess.run(child(tmp_path), capture_output=True, text=True, timeout=30)
        assert r.returncode == 3, r.stderr
        assert r.stdout.strip() == f"LOCKED {tmp_path}: another detrl process is writing this bundle"
        assert DirLock.is_locked(tmp_path)
        with pytest.raises(LockedError, match="another detrl process is writing this bundle"):
            DirLock(tmp_path).acquire()  # a second open file description in this process conflicts too
    assert not lock.held
    r = subprocess.run(child(tmp_path), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "ACQUIRED", r.stderr
    assert not DirLock.is_locked(tmp_path)


def test_sigkilled_holder_releases_lock(tmp_path: Path) -> None:
    p = subprocess.Popen(child(tmp_path, "hold"), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ACQUIRED"
        assert DirLock.is_locked(tmp_path)
        with pytest.raises(LockedError):
            DirLock(tmp_path).acquire()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        p.stdout.close()
    assert p.returncode == -signal.SIGKILL
    with DirLock(tmp_path):
        pass


def test_lock_creates_no_file(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_bytes(b"{}")
    before = sorted(os.listdir(tmp_path))
    with DirLock(tmp_path):
        assert sorted(os.listdir(tmp_path)) == before
        assert DirLock.is_locked(tmp_path)
        assert sorted(os.listdir(tmp_path)) == before
    assert sorted(os.listdir(tmp_path)) == before


def test_lock_release_is_idempotent_and_reacquirable(tmp_path: Path) -> None:
    lock = DirLock(tmp_path)
    lock.acquire()
    with pytest.raises(RuntimeError):
        lock.acquire()
    lock.release()
    lock.release()
    lock.acquire()
    lock.release()


def test_a_full_disk_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``[Errno 28] No space left on device`` alone did not say where: the write names its file, and a
    failed atomic write leaves the old file and no temporary one."""
    import errno

    (tmp_path / "manifest.json").write_bytes(b"old")

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safeio.os, "write", full)
    with pytest.raises(OSError) as e:
        safeio.write_atomic(tmp_path, "manifest.json", b"new")
    assert e.value.errno == errno.ENOSPC and str(tmp_path / "manifest.json") in str(e.value)
    assert (tmp_path / "manifest.json").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
