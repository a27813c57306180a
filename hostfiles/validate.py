"""Check a hostfile before a job waits on it: `python hostfiles/validate.py FILE [--strict]`.

Accepts the format both horovodrun (-hostfile) and OpenMPI's mpirun read: one host per line, `HOST slots=N`
(OpenMPI's optional `max_slots=M` too), each host once, blank lines and `#` comments, Unix line endings. Exit 0
and a one-line total when the file is valid; otherwise every problem as FILE:LINE: message, and exit 1. A host
name that does not resolve here is a warning (it may resolve only on the cluster's nodes); --strict makes it an
error, for files checked where the job starts.
"""
import re
import shlex
import socket
import sys
from typing import Iterable, Optional, Sequence

# A host name or IPv4/IPv6 address: letters, digits, dots, dashes, underscores, colons (IPv6), brackets.
HOST = re.compile(r"^[A-Za-z0-9_.\-:\[\]]+$")
OPTION = re.compile(r"^(slots|max_slots|max-slots)=(\S*)$")
HOST_COLON_SLOTS = re.compile(r"^([A-Za-z0-9_.\-]+):(\d+)$")


class HostListError(Exception):
    """A host list that cannot be read at all; the message names the file and the reason."""


def read_lines(path: str, name: Optional[str] = None) -> list[str]:
    """The lines of the file at `path`, split at LF only, so that a Windows CR stays visible (open() in text mode
    would drop it). `name` is what messages call the file (default: its path)."""
    name = name or path
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise HostListError(f"{name}: cannot read: {e.strerror or e}") from None
    try:
        return data.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        number = data.count(b"\n", 0, e.start) + 1
        raise HostListError(f"{name}:{number}: byte {data[e.start]:#04x} is not UTF-8 text: a host list holds host "
                            f"names and addresses; save it as plain text") from None


def windows_line_ending(path: str, lines: Iterable[str]) -> Optional[tuple[int, str]]:
    """(line number, message) for the first line holding a carriage return (a file saved on Windows), or None.
    mpirun -hostfile stops there with an ORTE parse error, so a hostfile must have none. parse() itself reads a CR
    as blank space, so that a live host list saved on Windows still works: Horovod sees only discover_hosts.py's
    output, never the file."""
    for number, line in enumerate(lines, 1):
        if "\r" in line:
            quoted = shlex.quote(str(path))
            return number, (f"Windows line endings (CR LF), which mpirun -hostfile rejects: convert the file with "
                            f"sed -i 's/\\r$//' {quoted} (or dos2unix {quoted})")
    return None


def parse(lines: Iterable[str], live: bool = False) -> tuple[list[tuple[str, int]], list[tuple[int, str]]]:
    """(hosts as [(host, slots)], errors as [(line number, message)]): the one reader of host lists.

    A hostfile (live=False) is what horovodrun -hostfile and mpirun -hostfile read: every line `HOST slots=N`.
    The live host list an operator edits for elastic discovery (live=True) also takes horovodrun -H's `HOST:N`
    and a bare `HOST` (one slot), and `slots=0` there drains the host (it is left out). Either way a host is listed
    once, compared without case as mpirun resolves names (it refuses a hostfile that repeats a host).
    """
    seen: dict[str, tuple[int, str]]
    hosts, errors, seen = [], [], {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *options = line.split()
        colon = HOST_COLON_SLOTS.match(host)
        if colon and live:
            host, options = colon.group(1), [f"slots={colon.group(2)}"] + options
        elif colon:
            errors.append((number, f"{host!r}: write '{colon.group(1)} slots={colon.group(2)}' in a hostfile "
                                   f"(HOST:N is horovodrun -H's form)"))
            continue
        if not HOST.match(host) or "=" in host:
            errors.append((number, f"{host!r} is not a host name or address"))
            continue
        if host.startswith("-"):  # ssh and mpirun would take it for one of their options (-oProxyCommand=...)
            errors.append((number, f"{host!r}: a host name cannot start with '-' (ssh and mpirun would read it as "
                                   f"an option); fix the name"))
            continue
        # Recorded before the slots are checked: a repeat is named even while the first line has another problem.
        first, spelled = seen.setdefault(host.lower(), (number, host))
        if first != number:
            also = "" if spelled == host else f" as {spelled}"
            errors.append((number, f"{host} is listed again (first on line {first}{also}): list each host once, "
                                   f"with its total slots"))
            continue
        values = {}
        for option in options:
            m = OPTION.match(option)
            if not m:
                errors.append((number, f"unknown option {option!r} after {host} (expected slots=N)"))
                continue
            key = m.group(1).replace("-", "_")
            if not m.group(2).isdigit():
                errors.append((number, f"{key}={m.group(2)!r} on {host} is not a whole number"))
                continue
            values[key] = int(m.group(2))
        if options and len(values) < len(options):
            continue
        if live:
            values.setdefault("slots", 1)
        if "slots" not in values:
            errors.append((number, f"{host} has no slots=N: say how many processes to start there"))
            continue
        if values["slots"] == 0 and not live:
            errors.append((number, f"{host} has slots=0: give it at least one slot, or remove the line"))
            continue
        if values.get("max_slots", values["slots"]) < values["slots"]:
            errors.append((number, f"{host} has max_slots={values['max_slots']} below slots={values['slots']}"))
            continue
        if values["slots"] > 0:
            hosts.append((host, values["slots"]))
    return hosts, errors


RESOLVE_WAIT_S = 10  # for all names together: a resolver that does not answer must not hold the check up


def resolve(host: str) -> Optional[str]:
    try:
        socket.getaddrinfo(host.strip("[]"), None)
        return None
    except (socket.gaierror, UnicodeError) as e:
        return getattr(e, "strerror", None) or str(e)


def unresolved(hosts: Sequence[tuple[str, int]], lines: Sequence[str]) -> list[tuple[int, str]]:
    """(line number, message) for each host name this machine cannot resolve (mpirun would stop at it)."""
    from concurrent.futures import ThreadPoolExecutor, wait

    pool = ThreadPoolExecutor(max_workers=8)
    futures = {host: pool.submit(resolve, host) for host, _ in hosts}
    wait(futures.values(), timeout=RESOLVE_WAIT_S)
    pool.shutdown(wait=False, cancel_futures=True)
    found = []
    for host, future in futures.items():
        error = future.result() if future.done() else f"no answer from the resolver within {RESOLVE_WAIT_S} s"
        if error:
            number = next(i for i, line in enumerate(lines, 1) if line.split("#", 1)[0].split()[:1] == [host])
            found.append((number, f"{host} does not resolve here ({error}); mpirun and horovodrun stop at it with "
                                  f"'Could not resolve hostname' unless it resolves where the job starts: fix the "
                                  f"name or /etc/hosts"))
    return found


def main(argv: Sequence[str]) -> int:
    strict = "--strict" in argv
    argv = [a for a in argv if a != "--strict"]
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    path = argv[0]
    try:
        lines = read_lines(path)
    except HostListError as e:
        print(e, file=sys.stderr)
        return 1
    hosts, errors = parse(lines)
    if not hosts and not errors:
        errors.append((1, "no hosts: the file has only blank lines and comments"))
    crlf = windows_line_ending(path, lines)
    if crlf:
        errors = sorted(errors + [crlf], key=lambda error: error[0])
    for number, message in errors:
        print(f"{path}:{number}: {message}", file=sys.stderr)
    if errors:
        return 1
    unknown = unresolved(hosts, lines)
    for number, message in unknown:
        print(f"{path}:{number}: {'error' if strict else 'warning'}: {message}", file=sys.stderr)
    if unknown and strict:
        return 1
    print(f"{path}: {len(hosts)} host(s), {sum(s for _, s in hosts)} slot(s): "
          + ", ".join(f"{h}:{s}" for h, s in hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
