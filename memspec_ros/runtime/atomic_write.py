"""A file replaced whole or not at all: written beside its path under a name of its own, then renamed onto it.

A reader (the node loading a zoo file, a resumed build) sees the old file or the new one, never half of one; two
writers never share a temporary name; a failed write leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

# a folder that cannot be opened for reading (mode 0333) or a file system that cannot sync one (EINVAL, a FUSE
# daemon without it): the rename before it has already happened, and failing the write then would report as failed
# what is in place
_CANNOT_SYNC = (errno.EINVAL, errno.EACCES, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP)


def owned_by_me(path: str | os.PathLike[str]) -> bool:
    """This user's file or folder, no symlink, that not every user can write to (group write allowed: a group per
    user, umask 002): what a cache folder another user can write to must show before the node uses it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o002


def sync_dir(folder: str | os.PathLike[str]) -> None:
    """The folder's entries on disk, where the folder can be synced (a rename is an entry: without this a power cut
    can undo it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _CANNOT_SYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _CANNOT_SYNC:
            raise
    finally:
        os.close(fd)


def sync_tree(folder: str | os.PathLike[str]) -> None:
    """Every file under ``folder`` on disk, and every folder's entries (the folder's own included)."""
    folder = Path(folder)
    for path in [*folder.rglob("*"), folder]:
        if path.is_symlink():
            continue
        if path.is_dir():
            sync_dir(path)
        elif path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


@contextlib.contextmanager
def written_aside(path: str | os.PathLike[str], suffix: str = ".tmp", sync: bool = False) -> Iterator[Path]:
    """Yields a temporary path beside ``path`` to write; when the block ends without an error it is renamed onto
    ``path`` (with ``sync``, the file synced before and its folder after: after a power cut the new name could
    hold an empty file, or the old one), keeping the old file's mode (else 0644, not mkstemp's 0600). The temporary
    file is gone afterwards either way."""
    path = Path(path)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(handle)
    tmp = Path(name)
    try:
        yield tmp
        if sync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
        if sync:
            sync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def mark_used(path: str | os.PathLike[str]) -> None:
    """Set ``path``'s modification time to now: the cache pruning keeps what was used lately (a file another user
    owns, or a read-only cache, keeps its old time, and is pruned the sooner)."""
    try:
        os.utime(path)
    except OSError:
        pass


def safetensors_io_error(exc: BaseException) -> bool:
    """Whether ``exc`` is safetensors' own report of a failed write or read (a full disk: "I/O error: No space left
    on device"), which is no OSError, so that callers treat it as the folder's failure, as an OSError."""
    return type(exc).__name__ == "SafetensorError" and "I/O error" in str(exc)


def cannot_write(exc: BaseException) -> bool:
    """Whether ``exc`` is a folder refusing a write (full, over quota, read-only, not ours), as an OSError or as
    safetensors' own I/O error: the work done so far is kept, and the same command goes on once that is fixed."""
    import errno

    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
    return safetensors_io_error(exc)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """``text`` into ``path`` by a rename (:func:`written_aside`, synced): a reader (the node, a resumed build) sees
    the old file or the new, never half."""
    with written_aside(path, sync=True) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_result_text(path: str | os.PathLike[str], text: str) -> None:
    """A result a command writes at its end (a bench's JSON, the results page): replaced whole (an earlier one
    stays until this one is complete), except where it cannot or must not be replaced by a rename: a link (written
    through, as the user pointed it), a device or pipe (/dev/null, /dev/stdout), or a file in a folder this
    process may not create files in (the file itself writable: written in place, as before)."""
    target = Path(path)
    special = target.is_symlink() or (target.exists() and not target.is_file())
    if special or (target.exists() and not os.access(target.parent, os.W_OK | os.X_OK)):
        target.write_text(text, encoding="utf-8")
    else:
        write_text_atomic(target, text)


def publish_dir(folder: str | os.PathLike[str], write) -> Path:
    """``write(staging)`` fills a folder beside ``folder``, which is then renamed onto it whole: a folder whose
    presence (a config.json, a model.safetensors) marks work done is never seen half-written. A ``folder`` already
    there (an older run's incomplete one) is replaced."""
    import shutil

    folder = Path(folder)
    staging = folder.with_name(folder.name + ".partial")
    aside = folder.with_name(folder.name + ".old")
    if aside.exists() and not folder.exists():  # a publish cut between its two renames: the old one comes back
        os.replace(aside, folder)  # now, so a failed write below leaves the folder as it was, not missing
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        write(staging)
        sync_tree(staging)  # on disk before the rename that says the work is done (a power cut)
    except BaseException:  # a failed write leaves no staging folder behind (the module's promise)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # the old folder renamed aside, not removed in place: a reader (the node loading a predictor head) saw it half
    # deleted while rmtree ran, and a crash there left it so; now there is at most an instant with no folder at all
    old = aside if folder.exists() else None
    if old is not None:
        if old.exists():
            shutil.rmtree(old)
        os.replace(folder, old)
    os.replace(staging, folder)
    sync_dir(folder.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def open_lock(path: str | os.PathLike[str]):
    """A lock file opened for flock, created if absent, never through a link planted at its name (one planted in a
    shared folder would have this process create or write a file where it points)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644), "a")


def acquire(lock, on_wait=None, timeout: float | None = None) -> None:
    """An exclusive flock on the open ``lock``, waited for where another process holds it; ``on_wait()`` is called
    once before waiting (to say so). With ``timeout``, TimeoutError once it has waited that long (a holder stopped
    for good). Released when the file closes, also if this process is killed."""
    import fcntl
    import time

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        if on_wait is not None:
            on_wait()
    if timeout is None:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.1)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"another process has held {lock.name} for more than {timeout:g} s") from None


@contextlib.contextmanager
def held_lock(path: str | os.PathLike[str], on_wait=None, timeout: float | None = None) -> Iterator[None]:
    """:func:`acquire` on :func:`open_lock` ``(path)`` for the block."""
    with open_lock(path) as lock:
        acquire(lock, on_wait, timeout)
        yield
