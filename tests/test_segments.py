"""Segment lifecycle (shm/segments.py, shm/node_store.py): create, fill, reattach without
reload, refusals, dead owners, foreign segments, `strata shm list/clean`, room checks.

Every segment a test makes is named after a model digest drawn fresh for that
test (``shm_guard.digest()``), so the guard can tell this test's segments from
anyone else's: after each test it removes what is left of them and fails the
test if anything was.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import re
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import posix_ipc
import pytest

import shm.node_store
from coordinator.cli.main import main
from coordinator.cli.make_model import make_model
from coordinator.model.model_config import load_model_config
from coordinator.model.weights import load_weights
from shm import segments
from shm.checkpoint import Checkpoint
from shm.expert_source import read_expert_slice
from shm.node_store import open_node_store
from shm.plan import NodeShare, make_plan
from shm.segments import (
    MAGIC,
    PREFIX,
    SHM_DIR,
    SegmentError,
    SegmentNoSpace,
    attach,
    check_room,
    clean,
    create,
    human_bytes,
    list_segments,
    open_or_create,
    owner_alive,
    read_header,
    segment_name,
    unlink,
)

pytestmark = pytest.mark.usefixtures("dev_shm_alone")  # SIGKILLs, cleans or counts segments

REPO = Path(__file__).resolve().parents[1]
LAYOUT = {"kind": "test", "note": "not an expert layout"}
PLAN_DIGEST = "00112233445566778899aabbccddeeff"
GEOMETRY = dict(num_layers=2, num_experts=4)  # moe_intermediate_size 80: node 0 gets 32 rows, node 1 48
CHILD_TIMEOUT_S = 60


class Guard:
    def __init__(self):
        self.tokens: list[str] = []

    def digest(self) -> str:
        """A fresh model digest; every segment named with it belongs to this test."""
        d = secrets.token_hex(8)
        self.tokens.append(d)
        return d

    def mine(self) -> list[str]:
        if not SHM_DIR.is_dir():
            return []
        return ["/" + e.name for e in SHM_DIR.iterdir()
                if e.name.startswith(PREFIX) and any(t in e.name for t in self.tokens)]


@pytest.fixture(autouse=True)
def shm_guard():
    guard = Guard()
    yield guard
    left = guard.mine()
    for name in left:
        unlink(name)
    assert not left, f"the test left segments behind: {left}"


def shm_path(name: str) -> Path:
    return SHM_DIR / name.lstrip("/")


def cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


class Tiny:
    """A tiny checkpoint with its config, expert refs and a 2-node plan."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.cfg = load_model_config(directory)
        self.ckpt = Checkpoint(directory)
        weights = load_weights(self.cfg, self.ckpt)
        self.refs = weights.experts
        del weights  # F16: the dense arrays are copies; nothing keeps a view of the file maps
        self.experts = {k: (r, self.cfg.moe_intermediate_size) for k, r in self.refs.items()}
        self.plan = make_plan([NodeShare(0, 1), NodeShare(1, 1)], [self.cfg.moe_intermediate_size])

    def open(self, node: int, digest: str, **kw):
        return open_node_store(self.ckpt, self.plan, node, self.experts, self.cfg.hidden_size, cpus(),
                               model_digest=digest, **kw)

    def expected(self, node: int):
        slices = {k: self.plan.slice_of(self.cfg.moe_intermediate_size, node, k[1]) for k in self.refs}
        return {k: read_expert_slice(self.ckpt, r, slices[k].start, slices[k].stop) for k, r in self.refs.items()}


@pytest.fixture
def tiny(tmp_path):
    m = Tiny(make_model(tmp_path / "m", seed=7, dtype="F16", **GEOMETRY))
    yield m
    m.ckpt.close()


def snapshot(store) -> dict:
    return {k: tuple(np.array(a) for a in (v.gate, v.up, v.down)) for k in store.keys() for v in [store.get(*k)]}


def assert_store_equals(store, expected: dict) -> None:
    assert store.keys() == sorted(expected)
    for key, want in expected.items():
        got = store.get(*key)
        np.testing.assert_array_equal(got.gate, want.gate)
        np.testing.assert_array_equal(got.up, want.up)
        np.testing.assert_array_equal(got.down, want.down)


def listed(name: str, capsys) -> dict:
    assert main(["shm", "list", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["segments"] if r["name"] == name]
    assert len(rows) == 1, f"{name} listed {len(rows)} times"
    return rows[0]


def read_line(proc: subprocess.Popen, deadline_s: float = CHILD_TIMEOUT_S) -> str:
    """The child's next stdout line, failing (not hanging) if it does not come."""
    ready, _, _ = select.select([proc.stdout], [], [], deadline_s)
    if not ready:
        raise AssertionError(f"child pid {proc.pid} printed nothing in {deadline_s}s")
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(f"child exited {proc.returncode}: {proc.stderr.read()}")
    return line.strip()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()


# A node worker stand-in: makes and fills node 0's segment, says so, then waits to be killed.
OWNER_SCRIPT = textwrap.dedent("""
    import os, sys
    from coordinator.model.model_config import load_model_config
    from coordinator.model.weights import load_weights
    from shm.checkpoint import Checkpoint
    from shm.node_store import open_node_store
    from shm.plan import NodeShare, make_plan

    model_dir, digest = sys.argv[1], sys.argv[2]
    cfg = load_model_config(model_dir)
    ckpt = Checkpoint(model_dir)
    experts = {k: (r, cfg.moe_intermediate_size) for k, r in load_weights(cfg, ckpt).experts.items()}
    plan = make_plan([NodeShare(0, 1), NodeShare(1, 1)], [cfg.moe_intermediate_size])
    store, report = open_node_store(ckpt, plan, 0, experts, cfg.hidden_size, sorted(os.sched_getaffinity(0)),
                                    model_digest=digest)
    print("ready", report.segment, report.reloaded, os.getpid(), flush=True)
    sys.stdin.read()
""")

# Dies half way through writing a segment: never marks it complete, never unlinks it.
HALF_WRITER_SCRIPT = textwrap.dedent("""
    import os, sys
    from shm.segments import create
    name, digest, plan = sys.argv[1:4]
    seg = create(name, 0, digest, plan, {"kind": "test"}, 8192)
    seg.data[:] = 0xAB
    print("written", flush=True)
    os._exit(0)
""")


def spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def owner(tiny, shm_guard):
    """A live child process that owns node 0's complete segment."""
    digest = shm_guard.digest()
    proc = spawn(OWNER_SCRIPT, str(tiny.dir), digest)
    try:
        word, name, reloaded, pid = read_line(proc).split()
        assert (word, reloaded, int(pid)) == ("ready", "True", proc.pid)
        assert name == segment_name(digest, tiny.plan.digest, 0)
        yield SimpleNamespace(proc=proc, name=name, digest=digest)
    finally:
        stop(proc)


def sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL


# --- create, fill, reattach -------------------------------------------------------------------


def test_fill_then_reattach_without_reload(tiny, shm_guard, monkeypatch):
    digest = shm_guard.digest()
    expected = {k: tuple(np.array(a) for a in (v.gate, v.up, v.down)) for k, v in tiny.expected(0).items()}
    store, report = tiny.open(0, digest)
    try:
        assert report.reloaded and report.threads >= 1
        assert report.segment == segment_name(digest, tiny.plan.digest, 0)
        assert report.bytes == store.nbytes > 0
        first = snapshot(store)
        for k, (g, u, d) in expected.items():
            np.testing.assert_array_equal(first[k][0], g)
            np.testing.assert_array_equal(first[k][1], u)
            np.testing.assert_array_equal(first[k][2], d)
        assert read_header(report.segment).complete
        store.segment.keep = True
    finally:
        store.close()
    assert shm_path(report.segment).exists(), "keep=True: the segment must outlive close()"

    # take the checkpoint away: its files are gone, its maps are closed, and the fill refuses to run
    probe = tiny.refs[(0, 0)].gate.name
    for f in tiny.dir.glob("*.safetensors"):
        f.unlink()
    tiny.ckpt.close()
    with pytest.raises(ValueError):
        tiny.ckpt.raw(probe)  # any read from the checkpoint would now fail

    def no_reads(*a, **kw):
        raise AssertionError("the reattach read the checkpoint")

    monkeypatch.setattr(shm.node_store, "write_expert_slice", no_reads)
    store, report2 = tiny.open(0, digest)
    try:
        assert report2.reloaded is False
        assert report2.threads == 0
        assert report2.segment == report.segment and report2.bytes == report.bytes
        assert snapshot(store).keys() == first.keys()
        for k, arrays in snapshot(store).items():
            for got, want in zip(arrays, first[k]):
                np.testing.assert_array_equal(got, want)
        assert store.segment.owner and store.segment.header.owner_pid == os.getpid()
    finally:
        store.close()
    assert not shm_path(report.segment).exists(), "the owner's close() (keep False) unlinks"


def test_both_nodes_get_their_own_segment(tiny, shm_guard):
    digest = shm_guard.digest()
    stores = []
    try:
        for node in (0, 1):
            store, report = tiny.open(node, digest)
            stores.append(store)
            assert report.segment == segment_name(digest, tiny.plan.digest, node)
            assert read_header(report.segment).node == node
            assert_store_equals(store, tiny.expected(node))
        rows = [s.get(0, 0).rows for s in stores]
        assert rows == [tiny.plan.slice_of(tiny.cfg.moe_intermediate_size, n).rows for n in (0, 1)]
    finally:
        for s in stores:
            s.close()


def test_segment_file_mode_is_0600(tiny, shm_guard):
    store, report = tiny.open(0, shm_guard.digest())
    try:
        assert shm_path(report.segment).stat().st_mode & 0o777 == 0o600
    finally:
        store.close()
    name = segment_name(shm_guard.digest(), PLAN_DIGEST, 3)
    with create(name, 3, "m", PLAN_DIGEST, LAYOUT, 4096) as seg:
        assert shm_path(name).stat().st_mode & 0o777 == 0o600
        assert seg.owner
    assert not shm_path(name).exists()


def test_attach_shares_the_data_and_does_not_unlink(tiny, shm_guard):
    digest = shm_guard.digest()
    store, report = tiny.open(0, digest)
    try:
        seg = attach(report.segment, digest, tiny.plan.digest)
        try:
            assert not seg.owner
            assert seg.header == store.segment.header
            np.testing.assert_array_equal(seg.data, store.segment.data)
            store.segment.data[:4] = [1, 2, 3, 4]  # a write through one mapping shows in the other
            assert list(seg.data[:4]) == [1, 2, 3, 4]
        finally:
            seg.close()
        assert shm_path(report.segment).exists(), "an attacher must not unlink"
    finally:
        store.close()
    assert not shm_path(report.segment).exists()


# --- half-written, mismatched, foreign -------------------------------------------------------------


def test_half_written_with_live_owner_is_refused(shm_guard, capsys):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    seg = create(name, 0, digest, PLAN_DIGEST, LAYOUT, 4096)
    try:
        h = read_header(name)
        assert not h.complete and h.owner_pid == os.getpid() and owner_alive(h)
        with pytest.raises(SegmentError, match=r"half-written \(its owner pid %d is still writing it\)" % os.getpid()):
            attach(name, digest, PLAN_DIGEST)
        with pytest.raises(SegmentError, match=r"half-written and its owner pid %d is still writing" % os.getpid()):
            open_or_create(name, 0, digest, PLAN_DIGEST, LAYOUT, 4096)
        row = listed(name, capsys)
        assert row["state"] == "partial" and row["owner_alive"] is True and row["owner_pid"] == os.getpid()
        assert shm_path(name).exists(), "a refusal must not remove the segment"
        seg.mark_complete()
        with attach(name, digest, PLAN_DIGEST) as other:
            assert other.header.complete and not other.owner
    finally:
        seg.close()
    assert not shm_path(name).exists()


def test_half_written_with_dead_owner_is_rebuilt(shm_guard):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    proc = spawn(HALF_WRITER_SCRIPT, name, digest, PLAN_DIGEST)
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
        assert proc.returncode == 0 and out.strip() == "written", err
    finally:
        stop(proc)
    try:
        h = read_header(name)
        assert not h.complete and h.owner_pid == proc.pid and not owner_alive(h)
        with pytest.raises(SegmentError, match=rf"half-written \(its owner pid {proc.pid} died while writing it\)"):
            attach(name, digest, PLAN_DIGEST)
        seg, needs_fill = open_or_create(name, 0, digest, PLAN_DIGEST, {"kind": "test"}, 8192)
        try:
            assert needs_fill is True
            assert seg.owner and seg.header.owner_pid == os.getpid() and not seg.header.complete
            assert not seg.data.any(), "rebuilt from scratch, not the dead writer's bytes"
            assert read_header(name).owner_pid == os.getpid()
        finally:
            seg.close()
        assert not shm_path(name).exists()
    finally:
        unlink(name)


@pytest.mark.parametrize("how", ["attach", "open_or_create"])
@pytest.mark.parametrize("what", ["model", "plan"])
def test_mismatched_digest_is_refused(shm_guard, what, how):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    other = "ffffeeeeddddcccc"
    seg = create(name, 0, digest, PLAN_DIGEST, LAYOUT, 4096)
    try:
        seg.mark_complete()
        model, plan = (other, PLAN_DIGEST) if what == "model" else (digest, other)
        held = digest if what == "model" else PLAN_DIGEST
        with pytest.raises(SegmentError) as err:
            if how == "attach":
                attach(name, model, plan)
            else:
                open_or_create(name, 0, model, plan, LAYOUT, 4096)
        msg = str(err.value)
        assert f"segment {name} holds {what} {held}, not {other}" in msg
        assert f"`strata shm clean {name.lstrip('/')}`" in msg
        h = read_header(name)
        assert h.complete and h.model_digest == digest and h.plan_digest == PLAN_DIGEST
    finally:
        seg.close()
    assert not shm_path(name).exists()


def test_different_layout_is_refused(shm_guard):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    with create(name, 0, digest, PLAN_DIGEST, LAYOUT, 4096) as seg:
        seg.mark_complete()
        with pytest.raises(SegmentError, match=r"different layout.*strata shm clean"):
            open_or_create(name, 0, digest, PLAN_DIGEST, {"kind": "test", "other": 1}, 4096)
        with pytest.raises(SegmentError, match=r"different layout"):
            open_or_create(name, 0, digest, PLAN_DIGEST, LAYOUT, 8192)


def test_existing_name_is_not_overwritten(shm_guard):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    with create(name, 0, digest, PLAN_DIGEST, LAYOUT, 4096) as seg:
        seg.data[:3] = [7, 8, 9]
        with pytest.raises(SegmentError, match=r"already exists.*strata shm clean"):
            create(name, 0, digest, PLAN_DIGEST, LAYOUT, 8192)
        assert read_header(name).data_bytes == 4096
        assert list(seg.data[:3]) == [7, 8, 9]


def make_foreign(name: str, size: int) -> None:
    mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        if size:
            with mmap.mmap(mem.fd, size) as m:
                junk = bytearray(os.urandom(size))
                if junk[:8] == MAGIC:
                    junk[0] ^= 0xFF
                m[:] = bytes(junk)
    finally:
        mem.close_fd()


def test_foreign_segment_is_refused_listed_and_cleaned(shm_guard, capsys):
    name = f"/{PREFIX}{shm_guard.digest()}.foreign"
    make_foreign(name, 4096)
    try:
        with pytest.raises(SegmentError, match=r"is not a strata segment \(bad magic .*strata shm clean"):
            read_header(name)
        with pytest.raises(SegmentError, match=r"not a strata segment"):
            attach(name, "m", PLAN_DIGEST)
        with pytest.raises(SegmentError, match=r"not a strata segment"):
            open_or_create(name, 0, "m", PLAN_DIGEST, LAYOUT, 4096)
        row = listed(name, capsys)
        assert "not a strata segment" in row["error"]
        assert row["size"] == 4096 and "owner_pid" not in row
        assert main(["shm", "list"]) == 0
        line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(name + " ")]
        assert len(line) == 1 and "unreadable" in line[0]
        assert main(["shm", "clean", name.lstrip("/")]) == 0
        assert capsys.readouterr().out.strip() == f"{name}: removed"
        assert not shm_path(name).exists()
    finally:
        unlink(name)


@pytest.mark.parametrize("size,message", [(0, r"is empty"), (16, r"too small for a strata header")])
def test_tiny_foreign_segments_are_refused(shm_guard, size, message):
    name = f"/{PREFIX}{shm_guard.digest()}.tiny"
    make_foreign(name, size)
    try:
        with pytest.raises(SegmentError, match=message):
            read_header(name)
        info = [i for i in list_segments() if i.name == name]
        assert len(info) == 1 and info[0].header is None and re.search(message, info[0].error)
        assert clean([name]) == [(name, "removed")]
    finally:
        unlink(name)


def test_other_layout_version_is_refused(shm_guard):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    with create(name, 0, digest, PLAN_DIGEST, LAYOUT, 4096) as seg:
        struct.pack_into("<I", seg.map, len(MAGIC), segments.LAYOUT_VERSION + 1)
        with pytest.raises(SegmentError, match=rf"layout version {segments.LAYOUT_VERSION + 1}, this build reads"):
            read_header(name)


def test_missing_segment(shm_guard):
    name = segment_name(shm_guard.digest(), PLAN_DIGEST, 0)
    with pytest.raises(SegmentError, match=r"does not exist"):
        attach(name, "m", PLAN_DIGEST)
    assert clean([name]) == [(name, "no such segment")]


# --- dead owners ----------------------------------------------------------------------------


def test_live_owner_blocks_others_then_sigkill_and_clean_all(tiny, owner, capsys, monkeypatch):
    name, proc = owner.name, owner.proc
    row = listed(name, capsys)
    assert row["owner_alive"] is True and row["owner_pid"] == proc.pid and row["state"] == "complete"
    assert row["model"] == owner.digest and row["plan"] == tiny.plan.digest and row["node"] == 0
    h = read_header(name)
    assert row["size"] == h.total_bytes == shm_path(name).stat().st_size

    # while the owner lives: others share it without taking it over, and clean keeps it
    shared, report = tiny.open(0, owner.digest)
    assert report.reloaded is False and shared.segment.owner is False
    assert read_header(name).owner_pid == proc.pid
    shared.close()
    assert shm_path(name).exists()  # a sharer never unlinks
    seg = attach(name, owner.digest, tiny.plan.digest)
    try:
        view_bytes = np.array(seg.data)
    finally:
        seg.close()
    assert view_bytes.any()
    assert clean([name]) == [(name, f"kept: owner pid {proc.pid} is alive (use --force)")]
    assert shm_path(name).exists()

    sigkill(proc)
    row = listed(name, capsys)
    assert row["owner_alive"] is False and row["state"] == "complete" and row["owner_pid"] == proc.pid

    # --all: every dead owner's segment goes, a live owner's stays. /dev/shm is shared with whatever
    # else runs on this machine, so `clean --all` is shown only this test's segments.
    live = segment_name(owner.digest, tiny.plan.digest, 5)
    seg = create(live, 5, owner.digest, tiny.plan.digest, LAYOUT, 4096)
    try:
        seg.mark_complete()
        real_list = segments.list_segments
        monkeypatch.setattr(segments, "list_segments",
                            lambda: [i for i in real_list() if owner.digest in i.name])
        assert main(["shm", "clean", "--all"]) == 1  # 1: something was kept
        out = capsys.readouterr().out.splitlines()
        assert sorted(out) == sorted([f"{name}: removed", f"{live}: kept: owner pid {os.getpid()} is alive (use --force)"])
        assert not shm_path(name).exists()
        assert shm_path(live).exists()
    finally:
        seg.close()
    assert not shm_path(live).exists()


def test_sigkilled_owner_segment_is_adopted_without_reload(tiny, owner, capsys):
    name, proc = owner.name, owner.proc
    sigkill(proc)
    assert listed(name, capsys)["owner_alive"] is False
    store, report = tiny.open(0, owner.digest)
    try:
        assert report.segment == name
        assert report.reloaded is False and report.threads == 0
        assert store.segment.owner and store.segment.header.owner_pid == os.getpid()
        assert read_header(name).owner_pid == os.getpid()
        assert_store_equals(store, tiny.expected(0))
        row = listed(name, capsys)
        assert row["owner_alive"] is True and row["owner_pid"] == os.getpid()
    finally:
        store.close()
    assert not shm_path(name).exists(), "the adopter's close() unlinks"


def test_clean_keeps_live_owner_unless_forced(shm_guard, capsys):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    seg = create(name, 0, digest, PLAN_DIGEST, LAYOUT, 4096)
    seg.mark_complete()
    seg.keep = True
    seg.close()
    try:
        assert shm_path(name).exists()
        assert clean([name]) == [(name, f"kept: owner pid {os.getpid()} is alive (use --force)")]
        assert main(["shm", "clean", name.lstrip("/")]) == 1
        assert "kept" in capsys.readouterr().out
        assert shm_path(name).exists()
        assert main(["shm", "clean", "--force", name.lstrip("/")]) == 0
        assert capsys.readouterr().out.strip() == f"{name}: removed"
        assert not shm_path(name).exists()
        assert clean([name], force=True) == [(name, "no such segment")]
    finally:
        unlink(name)


def test_clean_cli_needs_names_or_all(capsys):
    assert main(["shm", "clean"]) == 2
    assert "name the segments to remove, or pass --all" in capsys.readouterr().err


# --- room checks -------------------------------------------------------------------------------


def test_check_room_refuses_more_than_the_machine_has():
    with pytest.raises(SegmentError) as err:
        check_room(nbytes=10**18, node_free=None, what="x")
    msg = str(err.value)
    assert msg.startswith(f"x needs 888.18 PiB ({10**18} bytes) but the machine has ")
    assert re.search(r"has \d+\.\d+ [KMGT]iB \(\d+ bytes\) free; free memory, use more nodes", msg)
    assert isinstance(err.value, SegmentNoSpace) and err.value.needed == 10**18


def test_check_room_node_and_dev_shm(monkeypatch):
    with pytest.raises(SegmentNoSpace, match=rf"seg needs 2.00 GiB \({2**31} bytes\) but the node has 1.00 GiB "
                                             rf"\({2**30} bytes\) free"):
        check_room(nbytes=2**31, node_free=2**30, what="seg")
    check_room(nbytes=4096, node_free=2**30, what="seg")  # fits: no error
    check_room(nbytes=4096, node_free=None, what="seg")
    st = os.statvfs(SHM_DIR)
    shm_free = st.f_bavail * st.f_frsize
    monkeypatch.setattr(segments.psutil, "virtual_memory", lambda: SimpleNamespace(available=2**62))
    with pytest.raises(SegmentNoSpace, match=rf"but {re.escape(str(SHM_DIR))} has \d+\.\d+ [KMGT]iB \(\d+ bytes\) "
                                             "free"):
        check_room(nbytes=shm_free + 2**30, node_free=None, what="seg")


def test_create_refuses_before_making_anything(shm_guard):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    with pytest.raises(SegmentError, match=rf"segment {re.escape(name)} needs .* but the node has"):
        create(name, 0, digest, PLAN_DIGEST, LAYOUT, 2**20, node_free=2**19)
    assert not shm_path(name).exists()
    with pytest.raises(SegmentError, match="does not exist"):
        read_header(name)


def test_open_node_store_refuses_before_making_anything(tiny, shm_guard):
    digest = shm_guard.digest()
    with pytest.raises(SegmentNoSpace, match=r"but the node has 1.0 KiB \(1024 bytes\) free"):
        tiny.open(0, digest, node_free=1024)
    assert shm_guard.mine() == []


def test_segment_we_may_not_open_is_listed_as_unreadable(shm_guard, monkeypatch, capsys):
    # As root we cannot be refused by the mode bits, so stand in for another user's segment: opening
    # this one name fails the way shm_open fails with EACCES.
    name = f"/{PREFIX}{shm_guard.digest()}.otheruser"
    make_foreign(name, 4096)
    real = posix_ipc.SharedMemory

    def shm_open(n, *args, **kw):
        if n == name and not args:
            raise posix_ipc.PermissionsError("Permission denied")
        return real(n, *args, **kw)

    monkeypatch.setattr(segments.posix_ipc, "SharedMemory", shm_open)
    try:
        with pytest.raises(SegmentError, match=name):
            read_header(name)
        assert main(["shm", "list", "--json"]) == 0
        rows = [r for r in json.loads(capsys.readouterr().out)["segments"] if r["name"] == name]
        assert len(rows) == 1 and rows[0]["error"]
    finally:
        monkeypatch.undo()
        unlink(name)


# --- reserving a segment's bytes ---------------------------------------------------------------


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (512 * 2**10, "512.0 KiB"),
    (int(3.2 * 2**20), "3.2 MiB"), (2**20 - 1, "1.0 MiB"), (int(1.5 * 2**30), "1.50 GiB"), (2**40, "1.00 TiB"),
    (10**18, "888.18 PiB"),
])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.ENOMEM, errno.EFBIG])
@pytest.mark.parametrize("how", ["create", "open_or_create"])
def test_failed_reservation_is_a_clear_error_and_leaves_nothing(shm_guard, monkeypatch, code, how):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    data_bytes = 3 * 2**20
    needed = segments.header_bytes_for(LAYOUT) + data_bytes
    calls = []

    def full(fd, offset, length):
        calls.append((shm_path(name).exists(), offset, length))
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(segments.os, "posix_fallocate", full)
    make = create if how == "create" else lambda *a: open_or_create(*a)[0]
    with pytest.raises(SegmentNoSpace) as err:
        make(name, 0, digest, PLAN_DIGEST, LAYOUT, data_bytes)
    assert calls == [(True, 0, needed)]  # reserved on the new segment, before anything was written
    e = err.value
    assert (e.needed, e.errno) == (needed, code)
    msg = str(e)
    assert msg.startswith(f"cannot reserve segment {name}: it needs 3.0 MiB ({needed} bytes) but {SHM_DIR} has ")
    assert f"has {human_bytes(e.free)} ({e.free} bytes) free ({errno.errorcode[code]}: " in msg
    assert "nothing was left behind" in msg and "0.00 GiB" not in msg
    assert not shm_path(name).exists()
    with pytest.raises(SegmentError, match="does not exist"):
        read_header(name)


@pytest.mark.parametrize("error, raised", [(OSError(errno.EIO, "I/O error"), SegmentError),
                                           (KeyboardInterrupt(), KeyboardInterrupt)])
def test_any_failure_while_creating_removes_the_segment(shm_guard, monkeypatch, error, raised):
    digest = shm_guard.digest()
    name = segment_name(digest, PLAN_DIGEST, 0)
    seen = []

    def broken_map(fd, size, *args, **kw):
        seen.append(shm_path(name).stat().st_size)
        raise error

    monkeypatch.setattr(segments.mmap, "mmap", broken_map)
    with pytest.raises(raised) as err:
        create(name, 0, digest, PLAN_DIGEST, LAYOUT, 8192)
    monkeypatch.undo()
    if raised is SegmentError:
        assert str(err.value).startswith(f"cannot create segment {name} (12.0 KiB): ")
    assert seen == [segments.header_bytes_for(LAYOUT) + 8192]  # made and reserved, then removed
    assert not shm_path(name).exists()


# Two node workers sharing a small /dev/shm (a private 8 MiB tmpfs in a mount namespace of its own).
# Worker A makes and fills a 5 MiB segment. Worker B wants 5 MiB too: once through the room check
# (which now sees A's reserved bytes), once as the race in which B's check ran before A reserved
# (the check is skipped). Without a reservation both B's get a sparse segment and die of SIGBUS filling it.
SMALL_TMPFS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from shm import segments
    from shm.segments import SHM_DIR, open_or_create, segment_name

    digest, plan = sys.argv[1:3]
    layout, mib = {"kind": "test"}, 2**20
    st = os.statvfs(SHM_DIR)
    out = {"mounted": st.f_blocks * st.f_frsize}

    def free():
        st = os.statvfs(SHM_DIR)
        return st.f_bavail * st.f_frsize

    def worker_b(node):
        name = segment_name(digest, plan, node)
        try:
            seg, _ = open_or_create(name, node, digest, plan, layout, 5 * mib)
        except segments.SegmentError as exc:
            return {"name": name, "type": type(exc).__name__, "message": str(exc),
                    "errno": getattr(exc, "errno", None), "needed": getattr(exc, "needed", None),
                    "free": getattr(exc, "free", None), "free_after": free(),
                    "listing": sorted(os.listdir(SHM_DIR))}
        seg.data[:] = 1  # fills it: SIGBUS where the bytes were never reserved
        seg.close()
        return {"name": name, "type": None}

    a, _ = open_or_create(segment_name(digest, plan, 0), 0, digest, plan, layout, 5 * mib)
    a.data[:] = 1
    out["a"] = a.name
    out["checked"] = worker_b(1)
    segments.check_room = lambda *args, **kw: None
    out["race"] = worker_b(2)
    a.close()
    out["listing"] = sorted(os.listdir(SHM_DIR))
    print(json.dumps(out), flush=True)
""")


def test_full_small_tmpfs_is_enospc_naming_the_segment_and_leaves_nothing(shm_guard):
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs util-linux unshare and mount")
    digest = shm_guard.digest()
    setup = ('mount --make-rprivate / && mount -t tmpfs -o size=8m,mode=1777 tmpfs /dev/shm || exit 77; '
             'exec "$0" -c "$1" "$2" "$3"')
    proc = subprocess.run(["unshare", "-m", "sh", "-c", setup, sys.executable, SMALL_TMPFS_SCRIPT, digest, PLAN_DIGEST],
                          cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode == 77 or (proc.returncode != 0 and not proc.stdout and proc.stderr.startswith("unshare:")):
        pytest.skip(f"cannot mount a private tmpfs on /dev/shm here: {proc.stderr.strip()}")
    # -SIGBUS: a worker filled a segment whose bytes were never reserved
    assert proc.returncode == 0, f"child exited {proc.returncode}: {proc.stderr}"
    out = json.loads(proc.stdout)
    assert out["mounted"] == 8 * 2**20
    needed = segments.header_bytes_for({"kind": "test"}) + 5 * 2**20  # A's size and B's
    for case in ("checked", "race"):
        r = out[case]
        assert r["type"] == "SegmentNoSpace", r
        assert r["needed"] == needed and r["free"] == 8 * 2**20 - needed
        assert r["listing"] == [out["a"].lstrip("/")]  # B left nothing; A is still there
        assert r["name"] in r["message"] and "0.00 GiB" not in r["message"]
        assert f"needs 5.0 MiB ({needed} bytes) but {SHM_DIR} has 3.0 MiB ({r['free']} bytes) free" in r["message"]
    race = out["race"]
    assert race["errno"] == errno.ENOSPC and race["free_after"] == race["free"]
    assert race["message"].startswith(f"cannot reserve segment {race['name']}: ")
    assert "(ENOSPC: no space left on device;" in race["message"]
    assert out["listing"] == []
