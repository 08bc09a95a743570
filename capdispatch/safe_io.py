"""Reading and writing files without being hung, flooded or made to damage anything.

Every file capdispatch reads (policies, lock files, verdicts, the SGLang knob map) and
every file it writes (lock files, calibrated policies, verdicts) goes through here:

- a reader opens without blocking (a FIFO never hangs it), refuses anything but a
  regular file (a directory, a FIFO, a device, a socket) and reads at most a bound;
- a writer writes only a regular file (or creates one): the text goes to a temporary
  file beside the target, is flushed to disk and renamed over it, so a reader sees the
  old file or the new one, never half of either; a file rewritten keeps its mode; a
  symbolic link keeps pointing where it did (the file it names is replaced);
- a private file (the verification cache's) is read only when it is this user's and
  nobody else may write it, without following a link, and written 0600 with a link at
  its name replaced, never followed.

A leaf module: it imports nothing of capdispatch but the errors, so every room may use it.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from typing import Optional

from .errors import CapdispatchError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class FileError(CapdispatchError, ValueError):
    """A file that cannot be read or written safely: PATH, and why (one line)."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


MAX_SHOWN = 300     # a message names a file; it need not repeat a page of it


def shown(path) -> str:
    """PATH as text for a message, however it was given (str, bytes, PathLike): control
    and bidi characters (a terminal would act on them, or show the name reordered) and
    undecodable bytes escaped, a name longer than MAX_SHOWN characters cut, its length said."""
    try:
        text = os.fsdecode(os.fspath(path))
    except (TypeError, ValueError):
        text = repr(path)
    if len(text) > MAX_SHOWN:
        text = f"{text[:150]}...{text[-100:]} ({len(text)} characters)"
    if text.isprintable():
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:     # a lone surrogate: an undecodable byte of the name
            pass
    return ascii(text)[1:-1]


def kind(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO (named pipe)")."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def read_bytes(path, *, limit: int, what: str = "file") -> bytes:
    """At most LIMIT bytes of the regular file PATH (symbolic links followed to a regular
    file); a FileError naming WHAT and the reason for anything else, more than LIMIT
    bytes included. Never blocks on a FIFO, never reads a device."""
    name = shown(path)
    try:
        path = os.fspath(path)
    except TypeError:
        raise FileError(name, f"a {what} is a file path, not a {type(path).__name__}") from None
    if (b"\0" if isinstance(path, bytes) else "\0") in path:
        raise FileError(name, f"cannot read {what}: the path contains a NUL byte")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):     # before open: opening a device may act on it
            raise FileError(name, f"cannot read {what}: it is {kind(st.st_mode)}, not a regular file")
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
    except FileError:
        raise
    except (OSError, UnicodeError, ValueError) as exc:
        raise FileError(name, f"cannot read {what}: {_why(exc)}") from None
    try:
        st = os.fstat(fd)                    # what was opened, if it changed since the stat
        if not stat.S_ISREG(st.st_mode):
            raise FileError(name, f"cannot read {what}: it is {kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise FileError(name, f"{what} is larger than {_size(limit)} ({_size(st.st_size)})")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise FileError(name, f"{what} is larger than {_size(limit)}")
        return b"".join(chunks)
    except FileError:
        raise
    except OSError as exc:
        raise FileError(name, f"cannot read {what}: {_why(exc)}") from None
    finally:
        os.close(fd)


def read_private(path, *, limit: int, secret: bool = False) -> bytes:
    """At most LIMIT bytes of PATH, a regular file (no symbolic link followed) that
    belongs to this user and that nobody else may write (SECRET: nor read); ValueError
    saying why not, OSError when it cannot be opened (FileNotFoundError: absent)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if os.path.islink(path):
            raise ValueError("it is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"it is {kind(st.st_mode)}, not a regular file")
        why = unsafe_owner_or_mode(st, "it", secret)
        if why:
            raise ValueError(why)
        if st.st_size > limit:
            raise ValueError(f"it is larger than {_size(limit)}")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise ValueError(f"it is larger than {_size(limit)}")
        return data
    finally:
        os.close(fd)


def unsafe_owner_or_mode(st, what: str, secret: bool = False) -> Optional[str]:
    """Why a file or folder with stat ST may not be trusted (another user's, writable by
    others; SECRET: readable by others), or None."""
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if secret and st.st_mode & 0o077:
        return f"{what} may be read or written by others (mode {stat.S_IMODE(st.st_mode):04o}, need 0600)"
    if st.st_mode & 0o022:
        return f"{what} is writable by {'others' if st.st_mode & 0o002 else 'its group'} " \
               f"(mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def target_of(path) -> str:
    """The file a write to PATH replaces: PATH itself, or the file its symbolic link(s)
    name. A FileError when that is not a regular file (or absent)."""
    name = shown(path)
    try:
        path = os.fspath(path)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
    except (TypeError, ValueError):
        raise FileError(name, f"not a file path ({type(path).__name__})") from None
    if not path or "\0" in path:
        raise FileError(name or "''", "not a file path (empty or with a NUL byte)")
    real = os.path.realpath(path) if os.path.islink(path) else path
    try:
        st = os.stat(path)          # through links: what a write would reach (/dev/stdout: a pipe)
    except FileNotFoundError:
        return real                 # a new file (or a link to one not made yet)
    except OSError as exc:
        raise FileError(name, f"cannot write: {_why(exc)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FileError(name, f"cannot write: it is {kind(st.st_mode)}; give a regular file "
                              f"(or '-' for standard output)")
    return real


def write_atomic(path, data, *, mode: Optional[int] = None, private: bool = False,
                 links: bool = True) -> str:
    """Replace (or create) the regular file PATH with DATA (str: UTF-8) so that no reader
    sees a partial file: a temporary file beside it, fsync, rename, fsync of the folder.
    A file rewritten keeps its permission bits (MODE, or 0666 less the umask, for a new
    one). PRIVATE: the file is made 0600 whatever was there, and a symbolic link at PATH
    is replaced itself, never followed. LINKS False: a symbolic link at PATH is refused,
    and one made there meanwhile is replaced, never followed. The temporary file is
    removed on every failure. Returns the path written; a FileError says why nothing was."""
    name = shown(path)
    if private or not links:
        real = os.fsdecode(os.fspath(path))
        if not links and os.path.islink(real):
            raise FileError(name, "cannot write: it is a symbolic link (this file is written at "
                                  "its own name, never through a link)")
        if os.path.lexists(real) and not (os.path.islink(real) or os.path.isfile(real)):
            raise FileError(name, f"cannot write: it is {kind(os.lstat(real).st_mode)}")
    else:
        real = target_of(path)
    body = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    folder = os.path.dirname(os.path.abspath(real))
    try:
        old = None if private else os.stat(real) if links else os.lstat(real)
        if old is not None and not stat.S_ISREG(old.st_mode):
            raise FileNotFoundError(real)      # a link made meanwhile: replaced, as a new file
        keep = 0o600 if private else stat.S_IMODE(old.st_mode)
    except FileNotFoundError:
        old, keep = None, (0o666 & ~_umask()) if mode is None else mode
    except OSError as exc:
        raise FileError(name, f"cannot write: {_why(exc)}") from None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(real)}.", suffix=".part")
    except OSError as exc:
        raise FileError(name, f"cannot write: {_why(exc)} (in {folder})") from None
    try:
        try:
            os.fchmod(fd, keep)
            if old is not None and hasattr(os, "fchown") and old.st_uid != os.geteuid():
                try:
                    os.fchown(fd, old.st_uid, old.st_gid)   # root rewriting another's file
                except OSError:
                    pass
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, real)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise FileError(name, f"cannot write: {_why(exc)}") from None
        raise
    _fsync_dir(folder)
    return real


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass      # some file systems cannot sync a folder; the rename itself is atomic
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it (other threads may create files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        if exc.errno == errno.ELOOP:
            return "too many levels of symbolic links"
        return exc.strerror or str(exc)
    return str(exc) or type(exc).__name__


def _size(n: int) -> str:
    return f"{n // 1024} KiB" if n >= 1024 else f"{n} bytes"


def printable(text, limit: int = 0) -> str:
    """TEXT safe to print on a terminal: control characters (escape sequences included)
    shown as escapes, tabs and newlines kept; cut to LIMIT characters (0: no limit)."""
    text = str(text)
    if limit and len(text) > limit:
        text = text[:limit] + f"... ({len(text) - limit} more characters)"
    return "".join(c if c.isprintable() or c in "\n\t" else ascii(c)[1:-1] for c in text)


# A run of this many characters without a space in a message is a value, never a word: it
# is cut, so that a huge argument is named, not echoed whole.
LONG_WORD = 200


def message_text(text) -> str:
    """An error line as printed: control characters escaped (printable) and each run of more
    than LONG_WORD characters without a space cut to its start and its length."""
    def cut(m):
        return f"{m.group(0)[:80]}... ({len(m.group(0))} characters)"
    return re.sub(r"\S{%d,}" % (LONG_WORD + 1), cut, printable(text))
