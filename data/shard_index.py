"""The shard index (`index.json`, which `hvd-train shard` writes) and the plan of an epoch over tar shards.

The index is data from elsewhere: it is read with a size bound and every figure in it is checked before it sizes
anything. The plan follows from the index, the seed and the epoch number alone, so every rank computes the same one
without talking to the others (data/shards.py says how the shards are then read).
"""
import json
import os
import random
import re
import socket
import string
import subprocess
import urllib.parse
from dataclasses import dataclass

from hvd_train.data.errors import DataError
from hvd_train.gate import RecordError, index_facts
from hvd_train.uris import redact_all

INDEX = "index.json"
INDEX_MAX_BYTES = 64 * 2**20  # read from a file or a server: bounded before it is parsed
MAX_SHARDS = 10**6  # names a shard pattern may expand to (an index of a million shards is near its size bound)
MAX_SHARD_SAMPLES = 10**8  # samples one shard may claim (a tar of 100 million images is far past any writer's)
FORMAT = "hvd-train shards"


@dataclass(frozen=True)
class ShardSet:
    """One split's shards: their URLs, in the order given, and the sample count of each (from the index)."""
    urls: tuple
    counts: tuple
    facts: dict
    train: bool
    augment: object = None  # training: (data.augment.Augmentation, kind of images) the loader transforms with

    def __len__(self):
        return sum(self.counts)


def shard_name(url):
    """The name a shard has in the index: the file name at the end of a path, URL or pipe: command."""
    last = url.split()[-1].strip("'\"") if url.startswith("pipe:") else url
    return os.path.basename(last.split("?")[0])


def expand(pattern):
    """'a-{000..009}.tar' or several patterns joined by '::' -> the list of shard URLs: webdataset's expansion (WDS_
    variables, then braces), refused past MAX_SHARDS names. A pattern comes from the command line or a file: a few
    braces can name billions of shards, and braceexpand lists every range in memory before it yields a name, so
    the names are counted first (names_in), without listing any."""
    import braceexpand
    from webdataset.shardlists import envsubst

    parts = []
    for part in pattern.split("::"):
        for _ in range(10):  # as webdataset: a variable's value may name another
            try:
                substituted = envsubst(part)
            except AssertionError:  # webdataset's word for a ${NAME} whose WDS_NAME is not set
                unset = next(n for n in re.findall(r"\$\{(\w+)\}", part) if f"WDS_{n}" not in os.environ)
                raise DataError(f"${{{unset}}} stands for the environment variable WDS_{unset}, which is not set; "
                                f"set it, or write the pattern out") from None
            if substituted == part:
                break
            part = substituted
        parts.append(part)
    if sum(names_in(part) for part in parts) > MAX_SHARDS:
        raise DataError(f"it expands to more than {MAX_SHARDS:,} shard names; name fewer shards")
    return [name for part in parts for name in braceexpand.braceexpand(part)]


def names_in(pattern):
    """How many names braceexpand makes of `pattern`, counted by its own grammar (escapes, nested groups, comma
    lists, number and letter ranges with steps); at most MAX_SHARDS + 1. Raises DataError where braceexpand would
    refuse the braces."""
    count, start, depth, pos = 1, 0, 0, 0
    while pos < len(pattern):
        if pattern[pos] == "\\":
            pos += 2
            continue
        if pattern[pos] == "{":
            if depth == 0:
                start = pos
            depth += 1
        elif pattern[pos] == "}":
            depth -= 1
            if depth == 0:
                count = min(count * _names_in_group(pattern[start + 1:pos]), MAX_SHARDS + 1)
        pos += 1
    if depth != 0:
        raise DataError(f"its braces do not balance: {pattern[:200]!r}")
    return count


def _names_in_group(expr):
    numbers = re.match(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$", expr)
    if numbers:
        first, last, step = int(numbers.group(1)), int(numbers.group(2)), int(numbers.group(3) or 1) or 1
        return len(range(first, last + 1, step) if first < last else range(first, last - 1, -step))
    letters = re.match(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$", expr)
    if letters:  # braceexpand's alphabet: the capitals first
        alphabet = string.ascii_uppercase + string.ascii_lowercase
        first, last, step = alphabet.index(letters.group(1)), alphabet.index(letters.group(2)), \
            int(letters.group(3) or 1) or 1
        return len(alphabet[first:last + 1:step] if first < last else alphabet[first:(last or -52) - 1:-step])
    items, start, depth, pos = [], 0, 0, 0
    while pos < len(expr):  # a comma list at the top of the group: the items' names, one after another
        if expr[pos] == "\\":
            pos += 2
            continue
        depth += {"{": 1, "}": -1}.get(expr[pos], 0)
        if expr[pos] == "," and depth == 0:
            items.append(expr[start:pos])
            start = pos + 1
        pos += 1
    if depth != 0 or not items:  # no list: the braces are kept as text around the group's own expansion
        return names_in(expr)
    return sum(names_in(item) for item in items + [expr[start:]])


def default_index(pattern):
    """index.json beside the first shard; a pipe: command has no "beside" and must name its index."""
    first = expand(pattern)[0]
    if first.startswith("pipe:"):
        return None
    return first.rsplit("/", 1)[0] + "/" + INDEX if "/" in first else INDEX


# curl as webdataset runs it for http(s)://, except that the URL goes in through curl's config on stdin: a token in
# the URL (?token=...) would otherwise be in curl's command line, which every user of the machine sees (ps).
CURL = ("curl", "--config", "-", "--connect-timeout", "30", "--retry", "30", "--retry-delay", "2", "-f", "-s", "-L")


def open_location(url):
    """A stream of the shard or index at `url`, as webdataset's gopen opens it; http(s):// through CURL."""
    from webdataset.gopen import Pipe, gopen

    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
        return gopen(url)
    if any(c in url for c in "\r\n\0"):
        raise ValueError("a URL with a line break or NUL in it")
    pipe = Pipe(list(CURL), mode="rb", stdin=subprocess.PIPE, ignore_status=[141, 23])
    quoted = url.replace("\\", "\\\\").replace('"', '\\"')
    pipe.proc.stdin.write(f'url = "{quoted}"\n'.encode())
    pipe.proc.stdin.close()
    return pipe


def read_index(location):
    """{'shards': {name: count}, 'facts': {...}} from a local path, http(s):// URL or pipe: command."""
    try:
        with open_location(location) as f:
            text = f.read(INDEX_MAX_BYTES + 1)
        if len(text) > INDEX_MAX_BYTES:
            raise DataError(f"shard index {location}: larger than {INDEX_MAX_BYTES // 2**20} MB, far more than an "
                            f"index of a million shards takes; it is not one `hvd-train shard` wrote")
        index = json.loads(text)
    except RecursionError:  # json nests recursively
        raise DataError(f"shard index {location}: its values nest thousands of levels deep; it is not one "
                        f"`hvd-train shard` wrote") from None
    except (OSError, ValueError) as e:  # a missing file, a failed download, text that is not JSON
        if isinstance(e, DataError):
            raise
        why = unreachable(location) or f"cannot read it ({e})"
        raise DataError(f"shard index {location}: {why}; write shards and their index with "
                        f"`hvd-train shard`, or name the index with --data.shard_index") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("shards"), dict) \
            or not isinstance(index.get("facts"), dict):
        raise DataError(f"shard index {location}: not an hvd-train shard index (written by `hvd-train shard`)")
    try:  # the gate (hvd_train/gate.py): every fact typed and bounded, the data set's own facts plain and harmless
        index_facts(index["facts"], f"shard index {redact_all(location)}")
    except RecordError as e:
        raise DataError(str(e)) from None
    wrong = [n for n, c in index["shards"].items() if type(c) is not int or not 0 <= c <= MAX_SHARD_SAMPLES]
    if wrong:
        raise DataError(f"shard index {location}: shard {wrong[0]}'s sample count {index['shards'][wrong[0]]!r} is "
                        f"not a whole number from 0 to {MAX_SHARD_SAMPLES}; rewrite the index with `hvd-train shard`")
    return index


def open_split(pattern, index, location, train):
    urls = expand(pattern)
    missing = [shard_name(u) for u in urls if shard_name(u) not in index["shards"]]
    if missing:
        raise DataError(f"shard index {location} has no entry for {', '.join(missing[:3])}"
                        f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}: the pattern names shards "
                        f"that index does not list; check the pattern, or rewrite the index with `hvd-train shard`")
    local = [u for u in urls if "://" not in u and not u.startswith("pipe:") and not os.path.isfile(u)]
    if local:
        raise DataError(f"shard {local[0]} does not exist{f' (and {len(local) - 1} more)' if len(local) > 1 else ''}"
                        f"; check --data.{'train' if train else 'val'}_shards")
    return ShardSet(tuple(urls), tuple(int(index["shards"][shard_name(u)]) for u in urls), index["facts"], train)


def open_sets(train_shards, val_shards, shard_index=""):
    """(train ShardSet, val ShardSet, facts) for --dataset shards."""
    for name, value in (("train_shards", train_shards), ("val_shards", val_shards)):
        if not value:
            raise DataError(f"--dataset shards needs --data.{name}: a shard path, URL or pipe: command, with "
                            f"braces for a range, e.g. 'shards/{name[:-7]}-{{000000..000009}}.tar'")
        try:
            expand(value)
        except (DataError, RecursionError) as e:  # braceexpand recurses once per nested brace
            raise DataError(f"--data.{name} {redact_all(value)[:200]!r}: {e or 'its braces nest too deeply'}") \
                from None
    location = shard_index or default_index(train_shards)
    if location is None:
        raise DataError("--data.train_shards is a pipe: command: name the shard index with --data.shard_index")
    index = read_index(location)
    return open_split(train_shards, index, location, True), open_split(val_shards, index, location, False), \
        index["facts"]


# --------------------------------------------------------------------------------------------------------------------
# The plan of an epoch


def deal(items, parts, offset):
    return list(items[offset::parts])


def by_worker(items, workers):
    """items dealt to a rank's loader workers (one reader where there are none)."""
    return [deal(items, max(1, workers), w) for w in range(max(1, workers))]


def train_plan(shards, epoch, seed, world_size, workers, batch_size):
    """[rank][worker] -> shard indices for this epoch, and the steps every rank runs."""
    order = list(range(len(shards.urls)))
    random.Random(f"{seed}:{epoch}").shuffle(order)  # a str seed hashes the same in every process
    per_rank = [deal(order, world_size, r) for r in range(world_size)]
    per_worker = [by_worker(mine, workers) for mine in per_rank]
    batches = [sum(sum(shards.counts[i] for i in part) // batch_size for part in parts) for parts in per_worker]
    return per_worker, min(batches)


def check_plan(shards, world_size, batch_size, workers, epoch=1, seed=0):
    """Refuse a job whose ranks cannot all train: fewer shards than ranks, or an epoch without a full batch. Every
    rank reaches the same verdict (the plan is the same everywhere), so they all stop together."""
    if len(shards.urls) < world_size:
        raise DataError(f"{len(shards.urls)} training shard(s) cannot feed {world_size} ranks: each rank reads "
                        f"whole shards; write at least {world_size} (hvd-train shard --shard-size smaller)")
    _, steps = train_plan(shards, epoch, seed, world_size, workers, batch_size)
    if steps == 0:
        raise DataError(f"a step takes {batch_size} samples per rank, but in epoch {epoch} some rank's shards (or "
                        f"one of its loader workers' shards) hold fewer; lower --batch-size or --workers, or write "
                        f"larger shards")


def unreachable(url):
    """Why the server of an http(s):// shard cannot be reached (curl then gives webdataset an empty stream, which
    reads as an empty file), or None where it answers or the shard is not on a server."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=10).close()
    except OSError as e:
        return (f"the server {parts.hostname}:{port} does not answer ({e.strerror or e}); check that it runs and "
                f"that this host can reach it")
    return None
