"""Opening checkpoint files: regular files only, never blocking, OS errors mapped once.

Every file of a checkpoint (config.json, the index, each shard) is input from
outside the server. Anything that is not a regular file is refused before it is
opened for reading: opening a FIFO for reading blocks until some writer appears
(forever, and a reload holds the model's reload lock meanwhile), a character
device such as /dev/zero or /dev/urandom never ends, a socket cannot be opened,
a directory cannot be read. Symlinks are followed (Hugging Face hub caches link
snapshot files into blobs/); their target is what must be a regular file.

Three checks, so that no race can block: `os.stat` first; then `os.open` with
O_NONBLOCK, so that a file swapped for a FIFO between the two still opens at
once; then `fstat` of the opened descriptor, so the check applies to exactly the
file that is read.

`open_shard`, `read_span` and `read_into` are the positional reads of tensor bytes;
`reopen_direct` gives a shard's descriptor for reads past the page cache (O_DIRECT).

`os_error` turns an `OSError` into the `CheckpointError` subclass a user sees;
every entry point (`Checkpoint`, `load_model`, `update_weights_from_disk`) goes
through it, so a missing file is always `CheckpointNotFoundError` and a file
that exists but cannot be read (permissions, a symlink loop, an I/O error) is
always `UnreadableCheckpointError`.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import time
from pathlib import Path

import torch

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnreadableCheckpointError,
)

# config.json and the index are read whole; real ones are kilobytes to a few MB.
# A bigger file is refused rather than read into memory (a symlink to a huge file).
MAX_JSON_BYTES = 100_000_000
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_NOCTTY", 0))
_NOT_FOUND = (errno.ENOENT, errno.ENOTDIR)


def os_error(e: OSError | ValueError, file) -> CheckpointError:
    """The `CheckpointError` for an OS error met while opening or reading `file`.

    ValueError covers paths the OS cannot take at all: an embedded NUL byte, or a
    name that cannot be encoded for the file system (such a file cannot exist).
    """
    if isinstance(e, ValueError):
        return CheckpointNotFoundError(f"{file!s}: not a valid path ({e})")
    if isinstance(e, FileNotFoundError | NotADirectoryError) or e.errno in _NOT_FOUND:
        return CheckpointNotFoundError(f"{file}: missing")
    return UnreadableCheckpointError(f"{file}: cannot read: {e.strerror or e}")


def directory_path(path) -> Path:
    """`path` (a str or `os.PathLike`) as a `Path`, refusing an empty one: ``Path("")`` is
    the current directory, and a server that reloaded from wherever it was started (a
    config value left blank) would serve other weights than the caller meant."""
    try:
        text = os.fspath(path)
    except TypeError:
        text = None
    if not isinstance(text, str):
        raise TypeError(f"a checkpoint path is a str or os.PathLike naming a directory, "
                        f"got {type(path).__name__}: {path!r}")
    if not text:
        raise CheckpointNotFoundError(f"{text!r}: an empty path names no checkpoint directory "
                                      "(it would read the current directory)")
    return Path(text)


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def stat_path(path) -> os.stat_result:
    """`os.stat` (symlinks followed), errors mapped by `os_error`."""
    try:
        return os.stat(path)
    except (OSError, ValueError) as e:
        raise os_error(e, path) from None


def exists(path) -> bool:
    """Whether `path` names something (after symlinks); other errors (permissions,
    symlink loops) raise instead of reading as 'absent'."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except (OSError, ValueError) as e:
        raise os_error(e, path) from None
    return True


def require_regular(st: os.stat_result, path) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnreadableCheckpointError(f"{path}: cannot read: {kind_of(st.st_mode)}, not a "
                                        "regular file")


def open_regular(path) -> io.FileIO:
    """Open `path` for reading if and only if it is a regular file (see the module doc).

    Returns an unbuffered binary file; its descriptor is safe for positional reads
    from several threads.
    """
    require_regular(stat_path(path), path)
    try:
        # the FileIO owns the descriptor as soon as the opener returns it, and only the
        # FileIO closes it: a Ctrl-C inside the lambda leaks one descriptor at worst,
        # never closes one twice
        f = io.FileIO(path, "rb", opener=lambda p, _: os.open(p, _OPEN_FLAGS))
    except (OSError, ValueError) as e:
        raise os_error(e, path) from None
    try:
        require_regular(fstat(f, path), path)  # it was swapped since the stat above
    except BaseException:
        f.close()
        raise
    return f


def fstat(f: io.FileIO, path) -> os.stat_result:
    try:
        return os.fstat(f.fileno())
    except OSError as e:
        raise os_error(e, path) from None


def stamp(st: os.stat_result) -> tuple[int, ...]:
    """Which file, and which version of it: (device, inode, size, mtime_ns, ctime_ns).

    Taken with `fstat` on the descriptor that is then read, so a stamp always
    belongs to the bytes that were read. Timestamps tick coarsely (a rewrite in
    place within one tick at the same size keeps all five), so callers that reuse
    a parse compare the parsed bytes too.
    """
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def pread(f: io.FileIO, n: int, offset: int, path) -> bytes:
    """Up to `n` bytes at `offset` (fewer only at the end of the file); positional,
    so threads may share `f`."""
    out = []
    got = 0
    try:
        while got < n:
            chunk = os.pread(f.fileno(), min(n - got, 1 << 30), offset + got)
            if not chunk:
                break
            out.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise os_error(e, path) from None
    return b"".join(out)


# A file modified longer ago than this when it was read cannot be rewritten later
# without its mtime moving (timestamps come from a clock that ticks every few ms).
SETTLED_NS = 2_000_000_000


def settled(st: tuple[int, ...]) -> bool:
    """Whether a file with stamp `st`, read now, was last changed (content or inode:
    mtime and ctime) long enough ago that any later rewrite changes its stamp. For a
    file read while still fresh, a rewrite within the same timestamp tick at the same
    size and inode keeps the stamp: its bytes must be compared instead."""
    return time.time_ns() - max(st[3], st[4]) > SETTLED_NS


def read_small(path, limit: int | None = None) -> tuple[bytes, tuple[int, ...]]:
    """(all bytes, stamp) of a small regular file (config.json, the index), at most
    `limit` bytes (default `MAX_JSON_BYTES`); the stamp is taken on the open file
    before it is read. Too big a file is refused by its size, before reading."""
    limit = MAX_JSON_BYTES if limit is None else limit
    with open_regular(path) as f:
        st = stamp(fstat(f, path))
        raw = b"" if st[2] > limit else pread(f, limit + 1, 0, path)
    if max(st[2], len(raw)) > limit:
        raise CorruptCheckpointError(f"{path}: too large: {max(st[2], len(raw))} bytes, more "
                                     f"than {limit}; refusing to read it")
    return raw, st


def list_dir(path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (OSError, ValueError) as e:
        raise os_error(e, path) from None


def open_shard(fpath: Path):
    """A shard opened for positional reads (a file object: use it in a ``with``); a
    regular file only, opened without blocking (`open_regular`)."""
    return open_regular(fpath)


def reopen_direct(handle) -> io.FileIO | None:
    """The file open as `handle` opened again with O_DIRECT (reads past the page cache),
    or None where that is refused (no O_DIRECT, no /proc, tmpfs). Through the handle's
    own /proc entry: the very file it holds, whatever was renamed over its path since."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        f = io.FileIO(f"/proc/self/fd/{handle.fileno()}", "rb",
                      opener=lambda p, _: os.open(p, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0)))
    except (OSError, ValueError):
        return None
    try:
        mine, theirs = os.fstat(f.fileno()), os.fstat(handle.fileno())
    except OSError:
        mine = theirs = None
    if mine is None or (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
        f.close()
        return None
    return f


def read_span(handle, fpath: Path, offset: int, nbytes: int, out: torch.Tensor | None = None,
              what: str = "data") -> torch.Tensor:
    """`nbytes` bytes at `offset` (validated by the caller against the header), into `out`
    (uint8, e.g. a pinned staging slice) or fresh CPU memory. Positional reads: threads may
    share `handle`."""
    buf = torch.empty(nbytes, dtype=torch.uint8) if out is None else out
    read_into(handle, fpath, offset, memoryview(buf.numpy()), what)
    return buf


def read_into(handle, fpath: Path, offset: int, view: memoryview, what: str = "data") -> None:
    """`read_span` into a byte view the caller keeps (a ring slot's: no tensor, no view made
    per read, each of which holds the GIL that a reload's other threads wait for)."""
    nbytes = len(view)
    fd = handle.fileno()
    got = 0
    try:
        while got < nbytes:  # one read returns at most ~2 GiB on Linux
            n = os.preadv(fd, [view[got:]], offset + got)
            if not n:
                raise read_failure(fpath, what, got, nbytes)
            got += n
    except OSError as e:
        raise read_failure(fpath, what, got, nbytes, e) from None


def read_failure(fpath: Path, what: str, got: int, nbytes: int,
                 error: OSError | None = None) -> CheckpointError:
    """The error of a positional read that failed (`error`) or came back short."""
    if error is None:
        return CorruptCheckpointError(f"{fpath}: truncated while reading {what}: got {got} of {nbytes} bytes "
                                      "(the file changed after its header was read?)")
    err = os_error(error, fpath)
    return type(err)(f"{err} (reading {what})")
