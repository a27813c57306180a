"""Reading one WebDataset tar shard, bounded: each regular file of the tar as webdataset's tar_file_expander gives
them, from wherever data/shard_index.py opens the location, inflated where it is compressed, and refused before it
is read where it would take more than the bounds below (data/shards.py streams the samples these files make up)."""
import bz2
import gzip
import lzma
import os
import re
import tarfile

from hvd_train.data.errors import BadSampleError
from hvd_train.data.shard_index import open_location
from hvd_train.uris import redact_all

# A shard is data from elsewhere, and each of its files is read into memory whole: a file whose tar header declares
# more than this is refused before it is read (a 10 KB sparse tar, or a 1.4 MB gzip of zeros, can declare 1.5 GB).
MEMBER_BYTES = 256 * 2**20
MEMBER_BYTES_VARIABLE = "HVD_MAX_SHARD_MEMBER_BYTES"  # raises (or lowers) that bound, in bytes
# What tarfile may read for a member's own headers (pax records, GNU long names), which it holds whole: names and
# attributes take a few hundred bytes in any shard a writer makes.
HEADER_BYTES = 2**20


def member_bound():
    """The most bytes one file of a shard may hold: MEMBER_BYTES, or HVD_MAX_SHARD_MEMBER_BYTES where it is set."""
    text = os.environ.get(MEMBER_BYTES_VARIABLE, "").strip()
    if not text:
        return MEMBER_BYTES
    if not text.isdigit() or not 1 <= int(text) <= 2**50:
        raise BadSampleError(f"{MEMBER_BYTES_VARIABLE}={text[:40]!r}: give the most bytes one file of a shard may "
                             f"hold, a whole number from 1 (default {MEMBER_BYTES:,})")
    return int(text)


def too_large(shown, what, size, bound):
    return BadSampleError(f"shard {shown}: {what} {size:,} bytes, more than the {bound:,} one file of a shard may "
                          f"take here; it is refused unread. If you trust this shard, raise the bound with "
                          f"{MEMBER_BYTES_VARIABLE}")


class Inflated:
    """A shard's bytes as tarfile reads them, after any decompression, counted as they are read: tarfile holds a
    member's headers whole (pax records, long names) before any header can be checked, so between two members it
    may read that member's declared size and HEADER_BYTES of the next one's headers, no more."""

    def __init__(self, stream, shown, bound):
        self.stream, self.shown, self.bound = stream, shown, bound
        self.count, self.limit = 0, HEADER_BYTES

    def read(self, size=-1):
        data = self.stream.read(size)
        self.count += len(data)
        if self.count > self.limit:  # the member's data is within its declared size: the headers after it are not
            raise BadSampleError(f"shard {self.shown}: a member's headers (pax records, long names) take more than "
                                 f"{HEADER_BYTES:,} bytes, which tarfile would hold whole; no shard writer makes "
                                 f"those, and the shard is refused before they are read; rewrite it with "
                                 f"`hvd-train shard`")
        return data

    def member(self, size):
        """tarfile has read a member's header, which declares `size` bytes: its data and the next headers may come."""
        self.limit = self.count + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE + HEADER_BYTES


class Prefixed:
    """A stream whose first bytes were read (to tell its compression) and are given again."""

    def __init__(self, stream, head):
        self.stream, self.head = stream, head

    def read(self, size=-1):
        if not self.head:
            return self.stream.read(size)
        if size is None or size < 0:
            data, self.head = self.head + self.stream.read(), b""
            return data
        data, self.head = self.head[:size], self.head[size:]
        return data


def uncompressed(stream):
    """`stream` inflated where it is compressed as tarfile's "r|*" tells (gzip, bzip2, xz), read as it is read."""
    head = b""
    while len(head) < 6:
        more = stream.read(6 - len(head))
        if not more:
            break
        head += more
    stream = Prefixed(stream, head)
    if head.startswith(b"\x1f\x8b\x08"):
        return gzip.GzipFile(fileobj=stream, mode="rb")
    if head.startswith(b"BZh"):
        return bz2.BZ2File(stream)
    if head.startswith((b"\xfd7zXZ", b"\x5d\x00\x00\x80")):
        return lzma.LZMAFile(stream)
    return stream


META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata files, which it skips


def tar_files(url, bound):
    """{"fname", "data", "__url__"} of each regular file of the tar shard at `url`, then {} (webdataset's
    tar_file_expander, for its group_by_keys), each file bounded: refused (BadSampleError, naming the shard and the
    bound) where its header declares more than `bound` bytes, before it is read, and the inflated stream counted as
    it is read (Inflated)."""
    shown = redact_all(url)
    counted = Inflated(uncompressed(open_location(url)), shown, bound)
    stream = tarfile.open(fileobj=counted, mode="r|")
    for info in stream:
        if info.size > bound:
            raise too_large(shown, f"member {info.name[:200]!r} declares", info.size, bound)
        counted.member(info.size)
        if info.issparse():  # holes tarfile fills with zeros: a few bytes of file for any size; no writer makes one
            raise BadSampleError(f"shard {shown}: member {info.name[:200]!r} is a sparse file, which no shard writer "
                                 f"makes; rewrite the shard with `hvd-train shard`")
        meta = META.match(info.name) or ("/" not in info.name and info.name.startswith("__")
                                         and info.name.endswith("__"))
        if not info.isreg() or meta:
            continue
        yield {"fname": info.name, "data": stream.extractfile(info).read(), "__url__": url}
        stream.members = []  # as webdataset: a stream of a million members keeps none of them
    yield {}
