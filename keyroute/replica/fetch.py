"""Fetching one ready-to-serve partition file (snapshot format 2) into the node's data directory, and
checking it is the file the manifest describes.

The bytes are checked against the manifest's size and checksum in the same pass that moves them:

    link       the snapshot is a local path on the node's filesystem: a hard link (no bytes move), then
               one read of the file to verify its checksum; the node never writes it (it opens LMDB
               read-only), so the snapshot's copy stays as published
    copy       a local path on another filesystem (or a link refused: EXDEV, EPERM, ...): the kernel copies
               each chunk (copy_file_range: the bytes never pass through this process), then the chunk is
               read back from the new file (in the page cache) into the checksum; fsynced before it counts
               as fetched. Where the kernel cannot copy between the two files, a streamed copy instead
    download   any other location (s3://, gs://, hdfs://, ...): a pyarrow input stream, same as a copy

Between chunks the fetch looks whether it was cancelled. Whatever fails, the destination file is removed.
Once the file is open, `check_keys` checks a sample of its keys belongs to the partition.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lmdb

from keyroute.keys.key_format import KeyFormat, KeyFormatError, key_from_data
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.logs import describe
from keyroute.storage.live import META_TAG
from keyroute.storage.lmdb_layout import HASHED_KEY_BYTES, TAG_HASHED, TAG_KEY
from keyroute.storage.snapshot import CHECKSUM_CHUNK_BYTES, ArrowLocation, Checksum, SnapshotError
from keyroute.storage.timeline import TimelineError, key_of_entry

log = logging.getLogger(__name__)

# Reads of this size keep a copy at disk speed while checksumming (1 MiB reads measured at a fraction
# of it); one buffer per load in flight.
CHUNK_BYTES = CHECKSUM_CHUNK_BYTES
# Why a hard link can fail where a copy would not: another mount of the same device, a filesystem or a
# kernel policy (fs.protected_hardlinks) that refuses it, too many links.
_LINK_REFUSED = frozenset(
    {errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
)
# How many keys of a fetched file are checked against the partitioner (spread through the file).
SAMPLE_KEYS = 64
# How many keys that are prefixes of the next one `_key_between` steps over before settling for one.
_PREFIX_STEPS = 8


class FetchError(Exception):
    """The file could not be fetched or is not the one the manifest describes; nothing was left behind."""


class FetchCancelled(FetchError):
    """The fetch was abandoned on request."""


@dataclass(frozen=True, slots=True)
class Fetched:
    """How a file came to the node: its method ("link", "copy", "download"), size and checksum."""

    method: str
    size: int
    checksum: str


def fetch_file(
    source: Path | ArrowLocation,
    name: str,
    dest: Path,
    *,
    size: int,
    checksum: str,
    cancelled: Callable[[], bool] = lambda: False,
    link: bool = True,
) -> Fetched:
    """Bring `name` (a '/'-separated path inside the snapshot version at `source`) to `dest` (a new file
    in an existing directory) and check it has `size` bytes and the `checksum` "<algorithm>:<hex>".

    `link=False` never hard-links (always a streamed copy). Raises FetchError (FetchCancelled when
    `cancelled()` became true) naming the file and what differs; `dest` is then gone.
    """
    shown = source.describe(name) if isinstance(source, ArrowLocation) else str(source / name)
    try:
        Checksum.like(checksum)  # a checksum this node cannot compute fails before anything moves
        if isinstance(source, ArrowLocation):
            return _download(source, name, dest, size, checksum, cancelled)
        return _local(source / name, dest, size, checksum, cancelled, link)
    except FetchError:
        _unlink(dest)
        raise
    except SnapshotError as exc:
        _unlink(dest)
        raise FetchError(f"{shown}: {exc}") from exc
    except OSError as exc:  # reading, writing (a full disk), a connection: name what was being fetched
        _unlink(dest)
        raise FetchError(f"fetching {shown} into {dest}: {describe(exc)}") from exc
    except BaseException:
        _unlink(dest)
        raise


def _local(src: Path, dest: Path, size: int, expected: str, cancelled: Callable[[], bool], link: bool) -> Fetched:
    try:
        st = os.stat(src)
    except FileNotFoundError:
        raise FetchError(f"snapshot file {src} is missing") from None
    if st.st_size != size:
        raise FetchError(f"{src}: size {st.st_size} bytes vs manifest {size}")  # known before any byte moves
    if link and st.st_dev == os.stat(dest.parent).st_dev:
        try:
            os.link(src, dest)
        except OSError as exc:
            if exc.errno not in _LINK_REFUSED:
                raise FetchError(f"linking {src} to {dest}: {exc}") from exc
            log.info("hard link of %s refused (%s): copying it", src, exc.strerror)
        else:
            checksum = Checksum.like(expected)
            with open(dest, "rb", buffering=0) as fh:
                _advise_sequential(fh.fileno())
                _pump(fh.readinto, None, checksum, size, str(src), cancelled)
            return _checked("link", str(src), checksum, size, expected)
    with open(src, "rb", buffering=0) as fh:
        _advise_sequential(fh.fileno())
        copied = _copy_in_kernel(fh.fileno(), str(src), dest, size, expected, cancelled)
        if copied is not None:
            return copied
        return _write(fh.readinto, "copy", str(src), dest, size, expected, cancelled)


# Answers of copy_file_range / sendfile that mean "not between these two files" (another filesystem, an
# old kernel, a filesystem without it): the next way of copying does the job instead.
_NO_KERNEL_COPY = frozenset({errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF})


def _copy_file_range(src_fd: int, out_fd: int, count: int, offset: int) -> int:
    return os.copy_file_range(src_fd, out_fd, count, offset, offset)


def _sendfile(src_fd: int, out_fd: int, count: int, offset: int) -> int:
    return os.sendfile(out_fd, src_fd, offset, count)  # writes at out_fd's position: `offset` too here


def _kernel_copies() -> list[Callable[[int, int, int, int], int]]:
    """The kernel's ways to copy between two files, best first: copy_file_range (same filesystem: the
    filesystem's own copy, a reflink where it has them), sendfile (any two files)."""
    return [
        copy for name, copy in (("copy_file_range", _copy_file_range), ("sendfile", _sendfile)) if hasattr(os, name)
    ]


def _copy_in_kernel(
    src_fd: int, shown: str, dest: Path, size: int, expected: str, cancelled: Callable[[], bool]
) -> Fetched | None:
    """Copy in the kernel, a chunk at a time, checksumming each chunk as read back from `dest` (from the page
    cache); None (and no `dest`) when no kernel copy works between these files, before any byte moved."""
    checksum = Checksum.like(expected)
    buffer = memoryview(bytearray(CHUNK_BYTES))
    for copy in _kernel_copies():
        with open(dest, "xb+", buffering=0) as out:  # read too: the chunks are checksummed as read back
            out_fd = out.fileno()
            done = 0
            while True:
                if cancelled():
                    raise FetchCancelled(f"fetching {shown} cancelled")
                try:
                    n = copy(src_fd, out_fd, CHUNK_BYTES, done)
                except OSError as exc:
                    if done or exc.errno not in _NO_KERNEL_COPY:
                        raise
                    break  # this way cannot copy between these files: the next one
                if not n:
                    os.fsync(out_fd)  # durable before the marker says the partition is loaded
                    return _checked("copy", shown, checksum, size, expected)
                end = done + n
                while done < end:
                    got = os.preadv(out_fd, [buffer[: min(CHUNK_BYTES, end - done)]], done)
                    if not got:
                        raise FetchError(f"{dest}: {end - done} byte(s) copied from {shown} cannot be read back")
                    checksum.update(buffer[:got])
                    done += got
                if done > size:  # the file grew since it was measured: no need to copy the rest
                    raise FetchError(f"{shown}: size at least {done} bytes vs manifest {size}")
        _unlink(dest)
    return None


def _download(
    source: ArrowLocation, name: str, dest: Path, size: int, expected: str, cancelled: Callable[[], bool]
) -> Fetched:
    shown = source.describe(name)
    try:
        stream = source.filesystem.open_input_stream(source.child(name), compression=None)
    except FileNotFoundError:
        raise FetchError(f"snapshot file {shown} is missing") from None
    with stream:
        return _write(stream.readinto, "download", shown, dest, size, expected, cancelled)


def _write(
    readinto: Callable[[memoryview], int],
    method: str,
    shown: str,
    dest: Path,
    size: int,
    expected: str,
    cancelled: Callable[[], bool],
) -> Fetched:
    checksum = Checksum.like(expected)
    with open(dest, "xb") as out:
        _pump(readinto, out.write, checksum, size, shown, cancelled)
        out.flush()
        os.fsync(out.fileno())  # durable before the marker says the partition is loaded
    return _checked(method, shown, checksum, size, expected)


def _pump(
    readinto: Callable[[memoryview], int],
    write: Callable[[memoryview], object] | None,
    checksum: Checksum,
    size: int,
    shown: str,
    cancelled: Callable[[], bool],
) -> None:
    """Read everything into `checksum` (and `write` it, when given), a chunk at a time."""
    buffer = memoryview(bytearray(CHUNK_BYTES))
    while True:
        if cancelled():
            raise FetchCancelled(f"fetching {shown} cancelled")
        n = readinto(buffer)
        if not n:
            return
        chunk = buffer[:n]
        checksum.update(chunk)
        if checksum.size > size:  # no need to move the rest of a file that is already too long
            raise FetchError(f"{shown}: size at least {checksum.size} bytes vs manifest {size}")
        if write is not None:
            write(chunk)  # a buffered writer writes all of it


def _checked(method: str, shown: str, checksum: Checksum, size: int, expected: str) -> Fetched:
    if checksum.size != size:
        raise FetchError(f"{shown}: size {checksum.size} bytes vs manifest {size}")
    if not checksum.matches(expected):
        raise FetchError(f"{shown}: checksum {checksum.value} vs manifest {expected}")
    return Fetched(method, checksum.size, checksum.value)


def _advise_sequential(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):  # only advice
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# -- the keys: a sample must belong to the partition ---------------------------------------------------


def check_keys(
    txn: lmdb.Transaction,
    *,
    partitioner: Partitioner,
    partitions: int,
    partition: int,
    key_format: KeyFormat,
    shown: str,
    limit: int = SAMPLE_KEYS,
    timeline: bool = False,
) -> int:
    """Keys from another partition (or placed by another partitioner) could never be asked for here: a
    file swapped between partitions, or built with other settings. Checks up to `limit` keys spread
    through the file (FetchError naming the first stray key and its partition); how many were checked."""
    sample = sample_keys(txn, limit, shown, timeline)
    for lmdb_key in sample:
        data = _timeline_key(lmdb_key, shown) if timeline else lmdb_key[len(TAG_KEY) :]
        if data is None:
            continue
        owner = partition_for(partitioner, data, partitions)
        if owner != partition:
            raise FetchError(
                f"{shown}: key {_show_key(key_format, data)} belongs to partition {owner} "
                f"({partitioner.value}, {partitions} partitions), not {partition}"
            )
    return len(sample)


def _timeline_key(lmdb_key: bytes, shown: str) -> bytes | None:
    """The serialized key of a timeline entry (None for a hashed one); FetchError if it is not an entry."""
    try:
        return key_of_entry(lmdb_key)
    except TimelineError as exc:
        raise FetchError(f"{shown}: {exc}") from None


def sample_keys(txn: lmdb.Transaction, limit: int, shown: str = "the file", timeline: bool = False) -> list[bytes]:
    """Up to `limit` `=`-tagged LMDB keys (hashed `#` keys cannot be hashed again) spread through the file:
    the first and the last, then breadth first a key in the middle of each gap between neighbours (a few
    cursor seeks each, however large the file). Also checks that the first and last keys are in the
    layout keyroute writes (keyroute.storage.lmdb_layout)."""
    cursor = txn.cursor()
    if not cursor.first():
        return []
    # A live partition's meta entries (META_TAG) sort before every key: skip them.
    if cursor.key()[:1] == META_TAG and not cursor.set_range(TAG_HASHED):
        return []
    ends = [bytes(cursor.key())]
    cursor.last()
    ends.append(bytes(cursor.key()))
    for key in ends:
        tag = key[:1]
        if timeline:
            _timeline_key(key, shown)
        elif tag not in (TAG_KEY, TAG_HASHED) or (tag == TAG_HASHED and len(key) != HASHED_KEY_BYTES):
            raise FetchError(f"{shown}: LMDB key {key[:40]!r} is not in the layout keyroute writes")
    last = ends[1]
    if not last.startswith(TAG_KEY):
        return []  # every key is hashed (`#` sorts before `=`)
    cursor.set_range(TAG_KEY)
    first = bytes(cursor.key())
    sample = [first] if first == last else [first, last]
    gaps = deque([(first, last)])
    while gaps and len(sample) < limit:
        lo, hi = gaps.popleft()
        found = _key_between(cursor, lo, hi)
        if found is not None:
            sample.append(found)
            gaps.append((lo, found))
            gaps.append((found, hi))
    return sample


def _key_between(cursor: lmdb.Cursor, lo: bytes, hi: bytes) -> bytes | None:
    """A key strictly between the keys lo and hi, or None if there is none. Between the first key after lo
    (a) and the last before hi (b), at the first byte where they differ: the first key at or after the
    byte halfway between theirs. Keys share their alphabet, so this splits the gap by its contents (the
    thousands of `customer-004999`, the first hex digit of a UUID) rather than by numeric byte values,
    which would leave most of a file of text keys unsampled."""
    if not (cursor.set_key(lo) and cursor.next()):
        return None
    a = bytes(cursor.key())
    if a >= hi:
        return None
    cursor.set_key(hi)
    cursor.prev()
    b = bytes(cursor.key())
    for _ in range(_PREFIX_STEPS):
        if a == b:
            return a
        d = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
        if d < len(a):
            halfway = (a[d] + b[d] + 1) // 2  # above a's byte, at most b's: a < probe <= b
            cursor.set_range(a[:d] + bytes([halfway]))
            return bytes(cursor.key())
        cursor.set_key(a)  # a is a prefix of b, and so of every key up to b: look past it
        cursor.next()
        a = bytes(cursor.key())
    return a


def _show_key(key_format: KeyFormat, data: bytes) -> str:
    try:
        text = key_from_data(key_format, data).text
    except KeyFormatError:
        return repr(data[:80])
    return repr(text if len(text) <= 80 else text[:80] + "…")
