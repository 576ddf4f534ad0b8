"""Host memory the process may take (mosaic/host_memory.py), on fake /proc and /sys/fs/cgroup
trees: MemAvailable alone without a limit, the cgroup's limit less what it holds (less its
reclaimable page cache) when that is smaller, the tightest limit of the cgroups above it, v1
and v2, a cgroup namespace's root, and unreadable trees."""

from pathlib import Path

from mosaic.host_memory import cgroup_room_bytes, host_available_bytes

GiB = 2**30


def _proc(tmp: Path, cgroup: str, available_kib: int = 20 * 2**20) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def _v2(tmp: Path, rel: str, levels: dict[str, tuple[str, int, int]]) -> Path:
    """levels: relative dir -> (memory.max, memory.current, inactive_file)."""
    root = tmp / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for d, (limit, current, inactive) in levels.items():
        p = root / d
        p.mkdir(parents=True, exist_ok=True)
        (p / "memory.max").write_text(f"{limit}\n")
        (p / "memory.current").write_text(f"{current}\n")
        (p / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 5\n")
    return root


def test_no_limit_leaves_mem_available(tmp_path):
    proc = _proc(tmp_path, "0::/job\n")
    root = _v2(tmp_path, "job", {"job": ("max", 5 * GiB, 0)})
    assert host_available_bytes(str(root), str(proc)) == 20 * GiB


def test_a_limit_below_mem_available_is_the_room(tmp_path):
    proc = _proc(tmp_path, "0::/job\n")
    root = _v2(tmp_path, "job", {"job": (str(8 * GiB), 5 * GiB, 1 * GiB)})
    assert host_available_bytes(str(root), str(proc)) == 8 * GiB - (5 * GiB - 1 * GiB)   # cache counts as room


def test_the_tightest_cgroup_above_counts(tmp_path):
    proc = _proc(tmp_path, "0::/slice/job\n")
    root = _v2(tmp_path, "slice/job", {"slice": (str(6 * GiB), 5 * GiB, 0), "slice/job": (str(16 * GiB), 2 * GiB, 0)})
    assert cgroup_room_bytes(root, proc / "self" / "cgroup") == 1 * GiB
    assert host_available_bytes(str(root), str(proc)) == 1 * GiB


def test_a_namespaced_cgroup_reads_the_mounts_root(tmp_path):
    proc = _proc(tmp_path, "0::/not/visible/here\n")
    root = _v2(tmp_path, "", {"": (str(4 * GiB), 1 * GiB, 0)})
    assert host_available_bytes(str(root), str(proc)) == 3 * GiB


def test_v1_limits_and_no_limit(tmp_path):
    proc = _proc(tmp_path, "4:memory:/docker/abc\n1:cpu:/\n")
    mem = tmp_path / "cgroup" / "memory" / "docker" / "abc"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(str(2 * GiB))
    (mem / "memory.usage_in_bytes").write_text(str(GiB))
    (mem / "memory.stat").write_text("cache 9\ntotal_inactive_file 0\n")
    top = tmp_path / "cgroup" / "memory"
    (top / "memory.limit_in_bytes").write_text("9223372036854771712")      # v1's "no limit"
    (top / "memory.usage_in_bytes").write_text(str(50 * GiB))
    assert host_available_bytes(str(tmp_path / "cgroup"), str(proc)) == 1 * GiB


def test_unreadable_trees_leave_mem_available(tmp_path):
    proc = _proc(tmp_path, "garbage line\n")
    assert host_available_bytes(str(tmp_path / "nowhere"), str(proc)) == 20 * GiB
    assert cgroup_room_bytes(tmp_path / "nowhere", tmp_path / "missing") is None
