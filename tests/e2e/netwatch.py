"""Evidence for the suite's network hygiene: a background sampler of the sockets of our process
groups (control plane, operator, runtime), recording any that listens on, or talks to, an
address outside 127.0.0.0/8. Linux /proc only."""

from __future__ import annotations

import ipaddress
import os
import threading
from pathlib import Path

LISTEN = "0A"
TABLES = ("tcp", "tcp6", "udp", "udp6")


def _addr(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    host, _, _port = hexaddr.partition(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    # IPv6 in /proc is four little-endian 32-bit words.
    return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def _loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _unspecified(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return ip.is_unspecified  # 0.0.0.0 / :: (a remote end of 0 means: not connected)


def socket_table() -> dict[str, tuple[str, str, str, str]]:
    """inode -> (table, local, remote, state) for every socket of this network namespace."""
    out = {}
    for table in TABLES:
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            out[f[9]] = (table, f[1], f[2], f[3])
    return out


def group_pids(pgids: set[int]) -> list[int]:
    """Processes of these groups, or of the sessions they lead (the launcher's children run in
    process groups of their own, in its session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) in pgids or int(fields[3]) in pgids:  # after the command: state, ppid, pgrp, session
            pids.append(int(entry))
    return pids


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening(pgids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets these process groups listen on."""
    table = socket_table()
    out = set()
    for pid in group_pids(pgids):
        for inode in socket_inodes(pid):
            kind, local, _remote, state = table.get(inode, ("", "", "", ""))
            if kind.startswith("tcp") and state == LISTEN:
                out.add((str(_addr(local)), int(local.rsplit(":", 1)[1], 16)))
    return out


def violations(pgids: set[int], pids: set[int] = frozenset()) -> list[str]:
    """Sockets of these process groups (and pids) bound or connected outside 127.0.0.0/8."""
    table = socket_table()
    found = []
    for pid in sorted(set(group_pids(pgids)) | set(pids)):
        for inode in socket_inodes(pid):
            if inode not in table:
                continue  # a unix socket
            kind, local, remote, state = table[inode]
            lip, rip = _addr(local), _addr(remote)
            if not _unspecified(rip):  # connected
                if not _loopback(rip):
                    found.append(f"pid {pid} {kind} {lip} -> {rip}")
            elif (state == LISTEN or kind.startswith("udp")) and not _loopback(lip):
                found.append(f"pid {pid} {kind} bound to {lip}")
    return found


class NetWatch:
    """Samples `violations` of the watched process groups and of this process every `interval` seconds."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.pgids: set[int] = set()
        self.found: set[str] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="netwatch", daemon=True)

    def watch(self, pgid: int) -> None:
        self.pgids.add(pgid)

    def start(self) -> NetWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.found.update(violations(set(self.pgids), {os.getpid()}))
            self.samples += 1

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=10)
        self.found.update(violations(set(self.pgids), {os.getpid()}))
        return sorted(self.found)


WATCH = NetWatch()  # the session's: every process the suite starts registers its group here
