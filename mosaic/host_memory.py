"""Host memory the process may still take (bytes): the one reading of it (the loader's room
check, offload's host K/V and weights, the block cache's host tier, the CPU request check).

The OS's MemAvailable counts the whole machine's memory; a container, a systemd slice or a batch
scheduler's job runs under a cgroup memory limit that is often far below it, and passing that
limit ends the process (the kernel's OOM killer), not one request. So the room is the smaller of
MemAvailable and, for this process's memory cgroup and each cgroup above it, its limit less what
it holds (its usage less the page cache it may reclaim: `inactive_file`, as MemAvailable counts
reclaimable cache as available). cgroup v2 (memory.max, memory.current) and v1
(memory.limit_in_bytes, memory.usage_in_bytes) are read; no limit (max, or v1's 2^63 - page) or
no readable cgroup leaves MemAvailable alone."""

from __future__ import annotations

import os
from pathlib import Path

NO_LIMIT = 2**60          # v1 reports "no limit" as 2^63 less a page; anything this large is none


def host_available_bytes(root: str = "/sys/fs/cgroup", proc: str = "/proc") -> int | None:
    """Host memory this process may still take (module docstring); None where it cannot tell."""
    have = _mem_available(Path(proc))
    room = cgroup_room_bytes(Path(root), Path(proc) / "self" / "cgroup")
    if room is None:
        return have
    return room if have is None else min(have, room)


def _mem_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cgroup_room_bytes(root: Path, self_cgroup: Path) -> int | None:
    """The least room (limit - (usage - inactive_file)) over this process's memory cgroup and
    the cgroups above it, or None when none of them has a limit (or none can be read)."""
    for base, mount, limit_file, usage_file in _memory_dirs(root, self_cgroup):
        chain = [base, *(d for d in base.parents if d == mount or mount in d.parents)]   # up to the mount
        rooms = [r for r in (_room(d, limit_file, usage_file) for d in chain) if r is not None]
        if rooms:
            return max(0, min(rooms))
    return None


def _memory_dirs(root: Path, self_cgroup: Path) -> list[tuple[Path, Path, str, str]]:
    """(this process's memory cgroup directory, its mount, limit file, usage file) for the v2
    and v1 mounts under `root`."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        rel = path.lstrip("/")
        if hier == "0" and controllers == "" and (root / "cgroup.controllers").exists():
            out.append((_existing(root / rel, root), root, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            mount = root / "memory"
            out.append((_existing(mount / rel, mount), mount, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    return out


def _existing(path: Path, mount: Path) -> Path:
    """The cgroup's directory, or its mount's root when the path is not visible here (a cgroup
    namespace shows the container's own cgroup as the root)."""
    return path if path.is_dir() else mount


def _room(d: Path, limit_file: str, usage_file: str) -> int | None:
    try:
        raw = (d / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= NO_LIMIT:
            return None
        usage = int((d / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    return int(raw) - max(0, usage - _inactive_file(d))


def _inactive_file(d: Path) -> int:
    try:
        for line in (d / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
