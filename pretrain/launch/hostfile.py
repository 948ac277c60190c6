"""DeepSpeed hostfiles: one `host slots=N` line per node; blank lines and `#` comments allowed.

    python -m pretrain.launch.hostfile HOSTFILE --nodes N [--slots G] [--exact-nodes]

checks the file for a launch on its first N hosts and prints their slots per node (G, or the
first host's when G is not given). The launcher (pretrain/launch/launcher.py) runs the same check
before anything starts: DeepSpeed's own parser (deepspeed/launcher/runner.py, `_parse_hostfile`)
only runs once the launch is under way, names no line, and a missing file makes it train on local
devices instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# DeepSpeed matches r'^(\S+)\s+slots=(\d+)' and ignores the rest of the line; only a comment may follow here.
HOST_LINE = re.compile(r"(\S+)\s+slots=(\d+)\s*(#.*)?")


class HostfileError(ValueError):
    """A hostfile that cannot be used for the launch; the message names the file and line."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int


def parse_hostfile(path: Path) -> list[Host]:
    try:
        text = path.read_text()
    except OSError as e:
        raise HostfileError(f"{path}: {e.strerror}") from e
    hosts: dict[str, Host] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = HOST_LINE.fullmatch(line)
        if match is None:
            raise HostfileError(f"{path}:{number}: expected 'host slots=N', got {raw!r}")
        name, slots = match.group(1), int(match.group(2))
        if name in hosts:
            raise HostfileError(f"{path}:{number}: host {name} is already listed on line {hosts[name].line}")
        if slots == 0:
            raise HostfileError(f"{path}:{number}: host {name} has slots=0")
        hosts[name] = Host(name, slots, number)
    if not hosts:
        raise HostfileError(f"{path}: lists no hosts")
    return list(hosts.values())


def slots_per_node(hosts: list[Host], path: Path, nodes: int, slots: int | None, exact_nodes: bool) -> int:
    """The slot count shared by the first `nodes` hosts (the ones DeepSpeed's --num_nodes uses)."""
    if len(hosts) < nodes or (exact_nodes and len(hosts) != nodes):
        wanted = f"exactly {nodes}" if exact_nodes else f"at least {nodes}"
        raise HostfileError(f"{path}: NNODES={nodes} needs {wanted} hosts, the file lists {len(hosts)}")
    used = hosts[:nodes]
    expected = slots if slots is not None else used[0].slots
    source = "GPUS_PER_NODE" if slots is not None else f"the slots of {used[0].name}"
    for host in used:
        if host.slots != expected:
            raise HostfileError(f"{path}:{host.line}: host {host.name} has slots={host.slots}, expected {expected} "
                                f"({source}; every node runs the same number of processes)")
    return expected


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hostfile", type=Path)
    parser.add_argument("--nodes", type=int, required=True, help="nodes the launch uses (the first N hosts)")
    parser.add_argument("--slots", type=int, help="processes per node; default: the first host's slots")
    parser.add_argument("--exact-nodes", action="store_true",
                        help="the launcher uses every host in the file (DeepSpeed's OpenMPI backend)")
    args = parser.parse_args(argv)
    try:
        hosts = parse_hostfile(args.hostfile)
        print(slots_per_node(hosts, args.hostfile, args.nodes, args.slots, args.exact_nodes))
    except HostfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
