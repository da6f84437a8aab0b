"""How many intra-op threads a CPU shard runs: every core it has, or one fewer while other processes
need a share of those cores (docs/design.md, "Threads on a shared CPU").

OpenMP workers spin between parallel regions, and every region waits for its slowest thread. When
the router's streams, a load generator or another pod also run on the shard's cores, a thread that
the kernel deschedules stalls every region it is part of, and the spinning peers take the time the
other processes needed. One thread fewer then serves faster; on a machine with nothing else to do,
every core does. `next_threads` decides (pure); `CoreUse` measures what the others take (/proc).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThreadPolicy:
    most: int  # the threads of a shard whose cores are free: its share of them
    drop_at: float = 0.35  # cores the other processes use, averaged over a window: one thread fewer
    restore_at: float = 0.15  # ...and back to every core at or below this
    window_s: float = 1.0


def next_threads(policy: ThreadPolicy, current: int, others: float) -> int:
    """The thread count after a window in which other processes used `others` cores on average.
    Between the two thresholds the count stays, so a load near one does not flip it each window."""
    if others >= policy.drop_at:
        return max(1, policy.most - 1)
    if others <= policy.restore_at:
        return policy.most
    return current


def busy_ticks(stat_text: str, cpus: set[int]) -> int:
    """Busy clock ticks (all but idle and iowait) of the given CPUs, from /proc/stat's text."""
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(f) for f in rest.split()]
        # user nice system idle iowait irq softirq steal (guest time is already in user)
        total += sum(ticks[:8]) - ticks[3] - ticks[4]
    return total


def own_ticks(self_stat_text: str) -> int:
    """This process's user + system ticks, from /proc/self/stat's text (the name may hold spaces)."""
    fields = self_stat_text.rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


class CoreUse:
    """Cores the rest of the machine used on this process's CPUs since the last reading. `shards`: the
    shards on these CPUs, each taken to use about what this one uses."""

    def __init__(self, cpus: set[int], shards: int):
        self.cpus, self.shards = cpus, shards
        self.hz = os.sysconf("SC_CLK_TCK")
        self._last = self._read()

    def _read(self) -> tuple[float, int, int]:
        with open("/proc/stat") as f:
            machine = busy_ticks(f.read(), self.cpus)
        with open("/proc/self/stat") as f:
            own = own_ticks(f.read())
        return time.monotonic(), machine, own

    def others(self) -> tuple[float, float]:
        """(seconds since the last reading, cores others used on average over them)."""
        now = self._read()
        then, self._last = self._last, now
        elapsed = now[0] - then[0]
        ticks = (now[1] - then[1]) - self.shards * (now[2] - then[2])
        return elapsed, max(0.0, ticks / self.hz / max(elapsed, 1e-9))


class AdaptiveThreads:
    """Sets torch's intra-op threads by `next_threads` once a window; cheap to call before every pass."""

    def __init__(self, policy: ThreadPolicy, use: CoreUse, set_threads, clock=time.monotonic):
        self.policy, self.use, self.set_threads, self.clock = policy, use, set_threads, clock
        self.current = policy.most
        self.set_threads(self.current)
        self._due = clock() + policy.window_s

    def adjust(self) -> int:
        now = self.clock()
        if now < self._due:
            return self.current
        self._due = now + self.policy.window_s
        elapsed, others = self.use.others()
        if elapsed > 2 * self.policy.window_s:
            # The shard was idle for part of it: what ran then (a client starting, say) is over.
            return self.current
        threads = next_threads(self.policy, self.current, others)
        if threads != self.current:
            log.info("torch threads: %d (other processes used %.2f of these %d cores)", threads, others,
                     len(self.use.cpus))
            self.current = threads
            self.set_threads(threads)
        return self.current


def adaptive_threads(most: int, shards: int, cpus: set[int], set_threads) -> AdaptiveThreads | None:
    """The adjuster of a CPU shard with `most` threads, or None where there is no thread to give up or
    the machine has no /proc to measure the others by."""
    if most < 2:
        return None
    try:
        use = CoreUse(cpus, shards)
    except (OSError, ValueError, IndexError) as e:
        log.info("torch threads stay at %d: cannot read the CPUs' use (%s)", most, e)
        return None
    return AdaptiveThreads(ThreadPolicy(most=most), use, set_threads)
