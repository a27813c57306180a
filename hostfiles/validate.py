"""Check a hostfile before a job waits on it: `python hostfiles/validate.py FILE`.

Accepts the format both horovodrun (-hostfile) and OpenMPI's mpirun read: one host per line, `HOST slots=N`
(OpenMPI's optional `max_slots=M` too), blank lines and `#` comments. Exit 0 and a one-line total when the file
is valid; otherwise every problem as FILE:LINE: message, and exit 1.
"""
import re
import sys

# A host name or IPv4/IPv6 address: letters, digits, dots, dashes, underscores, colons (IPv6), brackets.
HOST = re.compile(r"^[A-Za-z0-9_.\-:\[\]]+$")
OPTION = re.compile(r"^(slots|max_slots|max-slots)=(\S*)$")
HOST_COLON_SLOTS = re.compile(r"^([A-Za-z0-9_.\-]+):(\d+)$")


def parse(lines, live=False):
    """(hosts as [(host, slots)], errors as [(line number, message)]): the one reader of host lists.

    A hostfile (live=False) is what horovodrun -hostfile and mpirun -hostfile read: every line `HOST slots=N`.
    The live host list an operator edits for elastic discovery (live=True) also takes horovodrun -H's `HOST:N`
    and a bare `HOST` (one slot), and `slots=0` there drains the host (it is left out).
    """
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
        if host in seen:
            errors.append((number, f"{host} is listed again (first on line {seen[host]}); list each host once"))
            continue
        seen[host] = number
        if values["slots"] > 0:
            hosts.append((host, values["slots"]))
    return hosts, errors


def main(argv):
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    path = argv[0]
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        print(f"{path}: cannot read: {e.strerror}", file=sys.stderr)
        return 1
    hosts, errors = parse(lines)
    if not hosts and not errors:
        errors.append((1, "no hosts: the file has only blank lines and comments"))
    for number, message in errors:
        print(f"{path}:{number}: {message}", file=sys.stderr)
    if errors:
        return 1
    print(f"{path}: {len(hosts)} host(s), {sum(s for _, s in hosts)} slot(s): "
          + ", ".join(f"{h}:{s}" for h, s in hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
