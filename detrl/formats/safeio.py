"""Defensive file I/O for run bundles: bounded, non-following reads; crash-safe, single-writer writes.

Why this module exists:

* **Trust model.** A run bundle is written by another party (the training provider) and read by an
  auditor. Everything in it is hostile until checked. A symbolic link could point the auditor at its own
  files (``~/.ssh/id_ed25519``, ``/proc/self/environ``), a FIFO or device node could block it forever or
  feed it unbounded data, a multi-gigabyte "manifest" could exhaust its memory, and deeply nested or
  oddly numbered JSON could raise ``RecursionError`` or build enormous integers. The auditor's machine
  is not the bundle's to use: reads here open only regular files that lie inside the bundle (no link is
  followed below the root the auditor named), never block, read at most a stated number of bytes, and
  turn every defect into :class:`UnsafeInput` whose message begins with the bundle-relative file name.
* **Crash safety.** A recorder killed mid-write (power loss, OOM killer, SIGKILL) must leave either the
  old file or the new one, never a torn mix: :func:`write_atomic` writes a temporary file, fsyncs it,
  renames it over the target and fsyncs the directory.
* **Single writer.** :class:`DirLock` makes a second recorder on the same bundle fail at once instead of
  interleaving writes, without creating any file in the bundle.

Stdlib only; POSIX (Linux, macOS).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "DirLock",
    "LockedError",
    "UnsafeInput",
    "dumps_json",
    "fsync_dir",
    "loads_json",
    "naming",
    "nesting_depth",
    "open_regular",
    "read_bounded",
    "read_file",
    "write_atomic",
]

#: Most path components :func:`open_regular` accepts (``checkpoints/step_00000004.safetensors``).
MAX_COMPONENTS = 2
#: Bytes asked of the file per read call in :func:`read_bounded` (1 MiB).
CHUNK_BYTES = 1 << 20

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class UnsafeInput(ValueError):
    """A bundle file is missing, of the wrong kind, too large, or malformed.

    The message always begins with the bundle-relative file name, e.g.
    ``"checkpoints/step_00000004.safetensors: is a symbolic link"``.
    """


class LockedError(ValueError):
    """Another process holds the :class:`DirLock` on a bundle directory."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path}: another detrl process is writing this bundle")
        self.path = path


# --------------------------------------------------------------------------------------------------- reads


def _check_rel(rel: str) -> list[str]:
    """Split a bundle-relative POSIX path into its components, refusing anything that could leave the bundle."""
    if not isinstance(rel, str) or not rel:
        raise UnsafeInput(f"{rel!r}: not a bundle-relative path (empty)")
    if "\x00" in rel:
        raise UnsafeInput(f"{rel!r}: not a bundle-relative path (NUL byte)")
    if rel.startswith("/"):
        raise UnsafeInput(f"{rel}: not a bundle-relative path (absolute)")
    parts = rel.split("/")
    if len(parts) > MAX_COMPONENTS:
        raise UnsafeInput(f"{rel}: not a bundle-relative path (more than {MAX_COMPONENTS} components)")
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafeInput(f"{rel}: not a bundle-relative path (component {part!r})")
    return parts


def _lstat_mode(name: str, dir_fd: int) -> int | None:
    """``st_mode`` of ``name`` in ``dir_fd`` without following a final link; None if it cannot be statted."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return None


def _look(name: str, dir_fd: int) -> int | None:
    """The pre-open look at the final component (a separate name so tests can simulate a race past it)."""
    return _lstat_mode(name, dir_fd)


def _open_error(rel: str, what: str, e: OSError, name: str, dir_fd: int) -> UnsafeInput:
    """Translate an ``os.open`` failure of component ``name`` (``what``: "" for the file) into UnsafeInput."""
    if e.errno == errno.ENOENT:
        return UnsafeInput(f"{rel}: missing")
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        # ELOOP is what O_NOFOLLOW gives on a link (EMLINK on FreeBSD); ENOTDIR is what O_DIRECTORY gives
        # on a non-directory. Look, without following, to say which it was.
        mode = _lstat_mode(name, dir_fd)
        if mode is not None and stat.S_ISLNK(mode):
            return UnsafeInput(f"{rel}: {what}is a symbolic link")
        if e.errno == errno.ENOTDIR:
            return UnsafeInput(f"{rel}: {what}is not a directory")
    return UnsafeInput(f"{rel}: cannot open ({e.strerror or e})")


def open_regular(root: Path, rel: str, max_bytes: int) -> tuple[BinaryIO, int]:
    """Open the regular file ``root/rel`` for reading without following links or blocking.

    ``root`` is the bundle directory the auditor named (it may itself be a symbolic link). ``rel`` is a
    relative POSIX path of at most :data:`MAX_COMPONENTS` components, none empty, ``.`` or ``..``. No
    component below ``root`` may be a symbolic link, the file must be a regular file (not a FIFO, device,
    socket or directory), and its size must be at most ``max_bytes`` bytes; the size is checked on the
    open descriptor before a single byte is read.

    Returns ``(file, size)``: a binary file object the caller must close and the size in bytes that
    ``fstat`` reported (pass both to :func:`read_bounded`). Raises :class:`UnsafeInput` otherwise.
    """
    parts = _check_rel(rel)
    dir_fds: list[int] = []
    fd = -1
    try:
        try:
            dir_fds.append(os.open(root, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC))
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise UnsafeInput(f"{rel}: missing (no bundle directory {root})") from None
            raise UnsafeInput(f"{rel}: cannot open bundle directory {root} ({e.strerror or e})") from None
        for part in parts[:-1]:
            try:
                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC
                dir_fds.append(os.open(part, flags, dir_fd=dir_fds[-1]))
            except OSError as e:
                raise _open_error(rel, f"{part} ", e, part, dir_fds[-1]) from None
        name, parent = parts[-1], dir_fds[-1]
        # Look before opening so a device node is never opened at all (opening some has side effects);
        # the fstat below is the check that counts, since the entry may be swapped in between.
        mode = _look(name, parent)
        if mode is not None and stat.S_ISLNK(mode):
            raise UnsafeInput(f"{rel}: is a symbolic link")
        if mode is not None and not stat.S_ISREG(mode):
            raise UnsafeInput(f"{rel}: not a regular file")
        try:
            # O_NONBLOCK: a FIFO swapped in after the look above cannot hang the open.
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC, dir_fd=parent)
        except OSError as e:
            raise _open_error(rel, "", e, name, parent) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeInput(f"{rel}: not a regular file")
        if st.st_size > max_bytes:
            raise UnsafeInput(f"{rel}: {st.st_size} bytes, larger than the cap of {max_bytes} bytes")
        os.set_blocking(fd, True)  # no effect on a regular file; keeps later users unsurprised
        f = os.fdopen(fd, "rb")
        fd = -1  # owned by f now
        return f, st.st_size
    finally:
        if fd >= 0:
            os.close(fd)
        for d in dir_fds:
            os.close(d)


def read_bounded(f: BinaryIO, size: int, what: str, append_only: bool = False) -> bytes:
    """Read exactly ``size`` bytes (the size ``fstat`` reported) from ``f``, in chunks of at most 1 MiB.

    Raises :class:`UnsafeInput` (message prefixed with ``what``, the bundle-relative name) if the file
    ends early (``truncated while reading``) or has more bytes than ``size`` (``changed while
    reading``): either means someone is changing the file under the auditor. ``append_only``: the file
    is one a live recording appends to (commitments): growth is expected, and the prefix seen is read.
    """
    buf = bytearray()
    try:
        while len(buf) < size:
            chunk = f.read(min(size - len(buf), CHUNK_BYTES))
            if not chunk:
                raise UnsafeInput(f"{what}: truncated while reading ({len(buf)} of {size} bytes)")
            buf += chunk
        if not append_only and f.read(1):
            raise UnsafeInput(f"{what}: changed while reading (more than {size} bytes)")
    except OSError as e:
        raise UnsafeInput(f"{what}: cannot read ({e.strerror or e})") from None
    return bytes(buf)


def read_file(root: Path, rel: str, max_bytes: int, append_only: bool = False) -> bytes:
    """The whole of the regular file ``root/rel``, at most ``max_bytes`` bytes (:func:`open_regular` rules;
    ``append_only`` as in :func:`read_bounded`)."""
    f, size = open_regular(root, rel, max_bytes)
    with f:
        return read_bounded(f, size, rel, append_only)


# ---------------------------------------------------------------------------------------------------- JSON

# Everything that is neither a bracket nor the start of a string literal, or a whole string literal
# (escapes included): deleting these leaves the structural brackets, plus a lone '"' where a string is
# unterminated (JSON is invalid from there on, and json.loads stops before going any deeper).
_NOT_STRUCTURE = re.compile(r'[^\[\]{}"]+|"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1, '"': 0}


class _Refused(Exception):
    """Raised by the json.loads hooks; carries the one-line reason."""


def shortened(s: str, n: int = 40) -> str:
    """``s`` quoted, cut to ``n`` characters (another party's text in a message)."""
    return repr(s if len(s) <= n else s[:n] + "...")


def error_location(loc: tuple[Any, ...], whole: str) -> str:
    """Where a schema error is, ``a.b.0``, from pydantic's ``loc`` (``whole`` where it is empty): the keys of
    another party's JSON among its parts, so a part that is not printable or is long is :func:`shortened`,
    and the message stays one line."""
    parts = (str(p) for p in loc)
    return ".".join(p if p.isprintable() and len(p) <= 40 else shortened(p) for p in parts) or whole


def nesting_depth(text: str) -> int:
    """Deepest nesting of ``[]``/``{}`` in JSON ``text``, brackets inside string literals not counted.

    Runs in linear time inside the regex engine and ``itertools``; no recursion.
    """
    steps = map(_DEPTH_STEP.__getitem__, _NOT_STRUCTURE.sub("", text))
    return max(accumulate(steps, initial=0))


def loads_json(data: bytes, what: str, max_depth: int = 32, max_number_chars: int = 40) -> Any:
    """Parse untrusted JSON ``data`` (UTF-8 bytes) strictly.

    Refused, as :class:`UnsafeInput` ``"<what>: not valid JSON (<reason>)"`` (or ``"<what>: not UTF-8
    (...)"``): invalid UTF-8; nesting deeper than ``max_depth`` levels (checked before parsing, so deep
    input never reaches the recursive parser); number literals longer than ``max_number_chars``
    characters; integers outside ``[-2**128, 2**128)`` (a PCG64 generator's state is a 128-bit integer); floats that overflow (``1e999``); ``NaN`` and
    ``Infinity``; duplicate object keys; and anything ``json`` itself rejects. Nothing else escapes.
    """
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnsafeInput(f"{what}: not UTF-8 (byte {e.start})") from None
    depth = nesting_depth(text)
    if depth > max_depth:
        raise UnsafeInput(f"{what}: not valid JSON (nested {depth} levels deep, more than {max_depth})")

    def parse_int(s: str) -> int:
        if len(s) > max_number_chars:
            raise _Refused(f"integer literal of {len(s)} characters, more than {max_number_chars}")
        v = int(s)
        if not -(2**128) <= v < 2**128:
            raise _Refused(f"integer {s[:20]}... outside [-2**128, 2**128)")
        return v

    def parse_float(s: str) -> float:
        if len(s) > max_number_chars:
            raise _Refused(f"number literal of {len(s)} characters, more than {max_number_chars}")
        v = float(s)
        if not math.isfinite(v):
            raise _Refused(f"number {s} is not finite as a float")
        return v

    def parse_constant(s: str) -> Any:
        raise _Refused(f"{s} is not JSON")

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    raise _Refused(f"duplicate key {shortened(k)}")
                seen.add(k)
        return obj

    try:
        return json.loads(
            text,
            parse_int=parse_int,
            parse_float=parse_float,
            parse_constant=parse_constant,
            object_pairs_hook=pairs_hook,
        )
    except _Refused as e:
        reason = str(e)
    except json.JSONDecodeError as e:
        reason = f"{e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        reason = "nested too deeply"
    except (ValueError, OverflowError, TypeError) as e:
        reason = f"{type(e).__name__}: {e}"
    reason = " ".join(reason.split())[:200]  # one line, bounded
    raise UnsafeInput(f"{what}: not valid JSON ({reason})")


def json_kind(x: Any) -> str:
    """What kind of JSON value ``x`` is, for messages: "null", "a boolean", "a number", "a string", "a list"
    or "an object" (anything else too: a value that JSON could not have given)."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, (int, float)):
        return "a number"
    if isinstance(x, str):
        return "a string"
    return "a list" if isinstance(x, (list, tuple)) else "an object"


def dumps_json(obj: Any) -> bytes:
    """Canonical JSON: sorted keys, one-space indent, ASCII only, no NaN/Infinity, UTF-8, trailing newline.

    Equal inputs give byte-equal outputs whatever the dict insertion order, so the bytes can be hashed.
    Raises ``ValueError`` for non-finite floats and ``TypeError`` for values JSON cannot hold.
    """
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False) + "\n").encode()


# -------------------------------------------------------------------------------------------------- writes


def fsync_dir(path: Path) -> None:
    """Flush the directory ``path`` itself, so a rename or create in it survives a crash.

    Filesystems that cannot fsync a directory (EINVAL, ENOTSUP) are tolerated.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Give an ``OSError`` raised inside without a file name (a write or fsync on a full disk:
    ``[Errno 28] No space left on device``) the name of ``path``, so the one-line error says where."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


def write_atomic(dir: Path, name: str, data: bytes) -> None:
    """Replace ``dir/name`` with ``data`` so that after a crash it holds either the old or the new bytes.

    Writes ``dir/.name.tmp`` (never following a link there), fsyncs it, renames it over ``dir/name`` and
    fsyncs ``dir``. If anything fails before the rename the temporary file is removed and the old file
    is untouched. The temporary name is fixed, so callers must hold the bundle's :class:`DirLock`.
    """
    if not name or "/" in name or "\x00" in name or name in (".", ".."):
        raise ValueError(f"{name!r}: not a plain file name")
    dir = Path(dir)
    tmp = dir / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | _O_CLOEXEC, 0o644)
    try:
        try:
            with naming(dir / name):
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dir / name)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(dir)


# ---------------------------------------------------------------------------------------------------- lock


class DirLock:
    """Exclusive, non-blocking, advisory lock on a bundle directory, so only one process writes it.

    The lock is ``flock(LOCK_EX | LOCK_NB)`` on a descriptor of the directory inode itself, so:

    * no lock file is created in the bundle; a command refused because the bundle is busy changes
      nothing on disk;
    * the kernel drops the lock when the holding process dies, however it dies (SIGKILL, OOM killer),
      so there is never a stale lock to clean up;
    * ``flock`` locks belong to the open file description: two ``DirLock`` objects conflict even within
      one process, and a child made with ``fork`` (not ``subprocess``, which closes descriptors, nor
      ``exec``, since the descriptor is close-on-exec) shares its parent's lock until it exits.

    Meant for local filesystems; over NFS ``flock`` may be emulated or unsupported (then ``OSError``).
    Use as ``with DirLock(path): ...`` or :meth:`acquire` / :meth:`release`.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> DirLock:
        """Take the lock or raise :class:`LockedError` at once if another holder has it; returns self."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: DirLock already held by this object")
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockedError(self.path) from None
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (closing the descriptor). Does nothing if it is not held."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the open file description releases the flock

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def is_locked(path: Path) -> bool:
        """Whether some holder has the lock on ``path`` now (for status reports).

        Works by trying to take the lock and dropping it at once, so a writer starting in that instant
        may be refused; do not use it to decide whether to write.
        """
        lock = DirLock(path)
        try:
            lock.acquire()
        except LockedError:
            return True
        lock.release()
        return False
