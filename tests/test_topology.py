"""NUMA nodes from sysfs (shm/topology.py), on fixture trees and on this machine.

The fixture trees under tests/fixtures/sys/<machine>/ are written from MACHINES
below (``python tests/test_topology.py`` rewrites them); a test checks the
committed files still match. Expected CPUs are spelled as Python ranges, not
parsed from the files, so a parsing mistake cannot hide itself.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shm.topology import (
    DEFAULT_SYS,
    Node,
    TopologyError,
    format_cpulist,
    format_table,
    parse_cpulist,
    real_nodes,
    select_nodes,
    usable_cpus,
)

FIXTURES = Path(__file__).parent / "fixtures" / "sys"


@dataclass(frozen=True)
class FixtureNode:
    cpulist: str  # the file's text, as the kernel writes it
    cpus: tuple[int, ...]  # the same CPUs, spelled independently
    mem_total_kb: int | None  # None: no meminfo file
    mem_free_kb: int | None


@dataclass(frozen=True)
class Machine:
    nodes: tuple[FixtureNode, ...]
    online: str
    online_cpus: tuple[int, ...]
    cgroup: str | None = None  # fs/cgroup/cpuset.cpus.effective
    cgroup_cpus: tuple[int, ...] | None = None


def r(a: int, b: int) -> tuple[int, ...]:
    """CPUs a..b inclusive."""
    return tuple(range(a, b + 1))


XEON_NODES = (
    FixtureNode("0-27,56-83\n", r(0, 27) + r(56, 83), 263776072, 250112340),
    FixtureNode("28-55,84-111\n", r(28, 55) + r(84, 111), 264206112, 251004876),
)
MACHINES: dict[str, Machine] = {
    # 2-socket Xeon, 28 cores a socket, hyperthread siblings numbered from 56
    "xeon-2s": Machine(XEON_NODES, "0-111\n", r(0, 111)),
    # the same machine seen from a container whose cpuset is a few CPUs of each socket
    "xeon-2s-container": Machine(XEON_NODES, "0-111\n", r(0, 111), "2-5,30-33,60-61\n", r(2, 5) + r(30, 33) + r(60, 61)),
    # 2-socket EPYC 7763 in NPS4: 8 nodes of 16 cores, SMT siblings numbered from 128
    "epyc-nps4": Machine(
        tuple(
            FixtureNode(f"{16 * k}-{16 * k + 15},{128 + 16 * k}-{128 + 16 * k + 15}\n",
                        r(16 * k, 16 * k + 15) + r(128 + 16 * k, 128 + 16 * k + 15),
                        65842092 + 1024 * k, 61234560 + 2048 * k)
            for k in range(8)
        ),
        "0-255\n",
        r(0, 255),
    ),
    # two CPU nodes and a CXL memory expander: node2 has memory and no CPUs
    "cxl": Machine(
        (
            FixtureNode("0-7\n", r(0, 7), 32778420, 30112004),
            FixtureNode("8-15\n", r(8, 15), 32781560, 29998812),
            FixtureNode("\n", (), 134217728, 134000000),
        ),
        "0-15\n",
        r(0, 15),
    ),
    # CPUs 3 and 8 offline
    "offline": Machine(
        (
            FixtureNode("0-7\n", r(0, 7), 16384000, 12000000),
            FixtureNode("8-15\n", r(8, 15), 16384000, 13000000),
        ),
        "0-2,4-7,9-15\n",
        r(0, 2) + r(4, 7) + r(9, 15),
    ),
    # node0 owns the even CPUs, node1 the odd ones
    "interleaved": Machine(
        (
            FixtureNode(",".join(str(c) for c in range(0, 16, 2)) + "\n", tuple(range(0, 16, 2)), 8388608, 6000000),
            FixtureNode(",".join(str(c) for c in range(1, 16, 2)) + "\n", tuple(range(1, 16, 2)), 8388608, 7000000),
        ),
        "0-15\n",
        r(0, 15),
    ),
}


def meminfo(node: int, total_kb: int, free_kb: int) -> str:
    lines = [
        ("MemTotal", f"{total_kb} kB"),
        ("MemFree", f"{free_kb} kB"),
        ("MemUsed", f"{total_kb - free_kb} kB"),
        ("Active", f"{(total_kb - free_kb) // 2} kB"),
        ("FilePages", f"{(total_kb - free_kb) // 4} kB"),
        ("HugePages_Total", "0"),
        ("HugePages_Free", "0"),
    ]
    return "".join(f"Node {node} {k + ':':<16}{v:>14}\n" for k, v in lines)


def tree_files(m: Machine) -> dict[str, str]:
    """relative path -> text of one machine's fixture tree."""
    files = {"devices/system/cpu/online": m.online}
    for k, n in enumerate(m.nodes):
        files[f"devices/system/node/node{k}/cpulist"] = n.cpulist
        if n.mem_total_kb is not None:
            files[f"devices/system/node/node{k}/meminfo"] = meminfo(k, n.mem_total_kb, n.mem_free_kb)
    if m.cgroup is not None:
        files["fs/cgroup/cpuset.cpus.effective"] = m.cgroup
    return files


def write_tree(root: Path, m: Machine) -> Path:
    for rel, text in tree_files(m).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def sys_root(name: str) -> Path:
    return FIXTURES / name


def node_ids(nodes: list[Node]) -> list[int]:
    return [n.id for n in nodes]


# --- the fixture files themselves ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_fixture_tree_matches_its_description(name):
    root = sys_root(name)
    want = tree_files(MACHINES[name])
    have = {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}
    assert have == want, f"tests/fixtures/sys/{name} is stale: run `python tests/test_topology.py`"


# --- parse_cpulist / format_cpulist -------------------------------------------------------


@pytest.mark.parametrize(
    "text,cpus",
    [
        ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
        ("0-27,56-83\n", list(r(0, 27) + r(56, 83))),
        ("5", [5]),
        ("0,2,4", [0, 2, 4]),
        ("", []),
        ("\n", []),
        ("1-1", [1]),
        ("0-1, 4", [0, 1, 4]),
        ("3,,4", [3, 4]),
    ],
)
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize(
    "text,message",
    [("3-1", r"runs backwards"), ("3-2", r"range '3-2' runs backwards"), ("x", r"cannot parse CPU list 'x'"), ("1-", r"cannot parse"),
     ("-1", r"cannot parse"), ("1-2-3", r"cannot parse"), ("0,a", r"at 'a'")],
)
def test_parse_cpulist_errors(text, message):
    with pytest.raises(TopologyError, match=message):
        parse_cpulist(text)


@pytest.mark.parametrize(
    "cpus,text",
    [([0, 1, 2, 5], "0-2,5"), ([], ""), ([7], "7"), ([3, 1, 2], "1-3"), ([0, 2, 4], "0,2,4"),
     (list(r(0, 27) + r(56, 83)), "0-27,56-83"), ((9, 10), "9-10")],
)
def test_format_cpulist(cpus, text):
    assert format_cpulist(cpus) == text


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 1023), max_size=200))
def test_cpulist_round_trip(cpus):
    text = format_cpulist(sorted(cpus))
    assert parse_cpulist(text) == sorted(cpus)
    assert format_cpulist(parse_cpulist(text)) == text
    # the shortest form: no two ranges could be merged
    parts = [p for p in text.split(",") if p]
    bounds = [(int(p.split("-")[0]), int(p.split("-")[-1])) for p in parts]
    for (_, hi), (lo, _) in zip(bounds, bounds[1:]):
        assert lo > hi + 1


# --- usable_cpus --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_usable_cpus_of_fixture(name):
    m = MACHINES[name]
    want = set(m.online_cpus)
    if m.cgroup_cpus is not None:
        want &= set(m.cgroup_cpus)
    assert usable_cpus(sys_root(name)) == want


def test_usable_cpus_cgroup_restricts():
    cpus = usable_cpus(sys_root("xeon-2s-container"))
    assert cpus == set(r(2, 5) + r(30, 33) + r(60, 61))
    assert cpus < usable_cpus(sys_root("xeon-2s"))


def test_usable_cpus_cgroup_v1_and_online_intersect(tmp_path):
    root = write_tree(tmp_path / "v1", MACHINES["offline"])
    (root / "fs/cgroup/cpuset").mkdir(parents=True)
    (root / "fs/cgroup/cpuset/cpuset.effective_cpus").write_text("2-9\n")
    # cgroup 2-9 and online 0-2,4-7,9-15
    assert usable_cpus(root) == {2, 4, 5, 6, 7, 9}


def test_empty_cgroup_file_does_not_restrict(tmp_path):
    root = write_tree(tmp_path / "m", MACHINES["cxl"])
    (root / "fs/cgroup").mkdir(parents=True)
    (root / "fs/cgroup/cpuset.cpus.effective").write_text("\n")
    assert usable_cpus(root) == set(r(0, 15))


def test_usable_cpus_needs_something_to_go_on(tmp_path):
    with pytest.raises(TopologyError, match="cannot tell which CPUs are usable"):
        usable_cpus(tmp_path)


# --- real_nodes ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_real_nodes_of_fixture(name):
    m = MACHINES[name]
    usable = set(m.online_cpus) & (set(m.cgroup_cpus) if m.cgroup_cpus is not None else set(m.online_cpus))
    nodes = real_nodes(sys_root(name))
    assert node_ids(nodes) == list(range(len(m.nodes)))
    for node, spec in zip(nodes, m.nodes):
        assert node.cpus == tuple(c for c in spec.cpus if c in usable)
        assert node.mem_total == spec.mem_total_kb * 1024
        assert node.mem_free == spec.mem_free_kb * 1024
        assert not node.virtual and node.parent is None and not node.shares_cpus
    # nodes never share a CPU
    all_cpus = [c for n in nodes for c in n.cpus]
    assert len(all_cpus) == len(set(all_cpus))


def test_real_nodes_allowed_limits_cpus():
    allowed = set(r(0, 3) + r(28, 31) + r(84, 85))
    nodes = real_nodes(sys_root("xeon-2s"), allowed=allowed)
    assert [n.cpus for n in nodes] == [r(0, 3), r(28, 31) + r(84, 85)]


def test_node_outside_allowed_is_listed_without_cpus():
    nodes = real_nodes(sys_root("xeon-2s"), allowed=set(r(0, 3)))
    assert [n.cpus for n in nodes] == [r(0, 3), ()]
    assert nodes[1].mem_total == XEON_NODES[1].mem_total_kb * 1024


def test_offline_cpus_are_not_usable():
    nodes = real_nodes(sys_root("offline"))
    assert nodes[0].cpus == (0, 1, 2, 4, 5, 6, 7)
    assert nodes[1].cpus == r(9, 15)


def test_interleaved_numbering():
    nodes = real_nodes(sys_root("interleaved"))
    assert nodes[0].cpus == tuple(range(0, 16, 2))
    assert nodes[1].cpus == tuple(range(1, 16, 2))


def test_cxl_node_has_memory_and_no_cpus():
    nodes = real_nodes(sys_root("cxl"))
    assert len(nodes) == 3
    assert nodes[2].cpus == ()
    assert nodes[2].mem_total == 134217728 * 1024
    assert nodes[2].mem_free == 134000000 * 1024


def test_missing_meminfo_gives_unknown_memory(tmp_path):
    m = MACHINES["cxl"]
    root = write_tree(tmp_path / "m", m)
    (root / "devices/system/node/node1/meminfo").unlink()
    nodes = real_nodes(root)
    assert nodes[1].mem_total is None and nodes[1].mem_free is None
    assert nodes[0].mem_total == m.nodes[0].mem_total_kb * 1024


def test_nodes_sorted_numerically_not_by_name(tmp_path):
    root = tmp_path / "m"
    cpus = {k: (k,) for k in range(12)}
    for k in cpus:
        d = root / f"devices/system/node/node{k}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(f"{k}\n")
    (root / "devices/system/node/possible").write_text("0-11\n")  # not a node directory
    (root / "devices/system/cpu").mkdir(parents=True)
    (root / "devices/system/cpu/online").write_text("0-11\n")
    nodes = real_nodes(root)
    assert node_ids(nodes) == list(range(12))
    assert [n.cpus for n in nodes] == [cpus[k] for k in range(12)]


def test_kernel_without_numa_gives_one_node(tmp_path):
    root = tmp_path / "m"
    (root / "devices/system/cpu").mkdir(parents=True)
    (root / "devices/system/cpu/online").write_text("0-5\n")
    nodes = real_nodes(root)
    assert len(nodes) == 1
    assert nodes[0].id == 0 and nodes[0].cpus == r(0, 5) and nodes[0].mem_total is None


# --- select_nodes ---------------------------------------------------------------------------


def test_select_all_nodes_with_cpus_skips_cxl():
    nodes = select_nodes(None, sys_root("cxl"))
    assert node_ids(nodes) == [0, 1]
    assert all(n.cpus and not n.virtual for n in nodes)


def test_select_none_is_every_real_node():
    assert select_nodes(None, sys_root("epyc-nps4")) == real_nodes(sys_root("epyc-nps4"))


@pytest.mark.parametrize("name,count", [("epyc-nps4", 1), ("epyc-nps4", 3), ("epyc-nps4", 8), ("xeon-2s", 2),
                                        ("cxl", 2), ("interleaved", 1)])
def test_select_first_nodes_when_enough(name, count):
    real = [n for n in real_nodes(sys_root(name)) if n.cpus]
    nodes = select_nodes(count, sys_root(name))
    assert nodes == real[:count]
    assert not any(n.virtual for n in nodes)


def check_virtual(nodes: list[Node], count: int, real: list[Node]) -> None:
    usable = [c for n in real for c in n.cpus]
    by_id = {n.id: n for n in real}
    assert len(nodes) == count
    assert node_ids(nodes) == list(range(count))
    for n in nodes:
        assert n.virtual
        assert n.parent in by_id
        assert n.cpus, "a virtual node without CPUs"
        assert n.cpus[0] in by_id[n.parent].cpus  # cut from its parent's CPUs
        assert set(n.cpus) <= set(usable)
    if count <= len(usable):
        # a disjoint split of every usable CPU; no virtual node spans two real nodes (its memory
        # stays local), every real node gets at least one, and within a real node the split is even
        cut = [c for n in nodes for c in n.cpus]
        assert len(cut) == len(set(cut))
        assert set(cut) == set(usable)
        for n in nodes:
            assert set(n.cpus) <= set(by_id[n.parent].cpus), "a virtual node spans two real nodes"
        assert {n.parent for n in nodes} == set(by_id)
        for p in by_id:
            sizes = [len(n.cpus) for n in nodes if n.parent == p]
            assert max(sizes) - min(sizes) <= 1
        # parts follow CPU counts: no real node has more than one part more than its fair share
        for p, r in by_id.items():
            parts = sum(1 for n in nodes if n.parent == p)
            assert parts <= max(1, round(count * len(r.cpus) / len(usable))) + 1
        assert not any(n.shares_cpus for n in nodes)
    else:
        assert all(n.shares_cpus and len(n.cpus) == 1 for n in nodes)
        assert {c for n in nodes for c in n.cpus} == set(usable)


@pytest.mark.parametrize("name,count", [("xeon-2s", 3), ("xeon-2s", 4), ("xeon-2s", 5), ("xeon-2s", 112),
                                        ("epyc-nps4", 9), ("epyc-nps4", 16), ("cxl", 3), ("cxl", 7),
                                        ("offline", 4), ("interleaved", 4), ("xeon-2s-container", 5)])
def test_select_more_nodes_than_the_machine_has_gives_virtual_nodes(name, count):
    real = [n for n in real_nodes(sys_root(name)) if n.cpus]
    nodes = select_nodes(count, sys_root(name))
    check_virtual(nodes, count, real)


def test_virtual_nodes_of_two_equal_nodes_stay_inside_their_parent():
    real = real_nodes(sys_root("xeon-2s"))
    nodes = select_nodes(4, sys_root("xeon-2s"))
    assert [n.parent for n in nodes] == [0, 0, 1, 1]
    for n in nodes:
        assert set(n.cpus) <= set(real[n.parent].cpus)
    # each real node's memory is shared out among its virtual nodes
    for p in (0, 1):
        kids = [n for n in nodes if n.parent == p]
        assert sum(n.mem_total for n in kids) == pytest.approx(real[p].mem_total, abs=len(kids))
        assert sum(n.mem_free for n in kids) == pytest.approx(real[p].mem_free, abs=len(kids))


def test_interleaved_virtual_nodes_follow_node_order():
    nodes = select_nodes(4, sys_root("interleaved"))
    assert [n.parent for n in nodes] == [0, 0, 1, 1]
    assert set(nodes[0].cpus) | set(nodes[1].cpus) == set(range(0, 16, 2))
    assert set(nodes[2].cpus) | set(nodes[3].cpus) == set(range(1, 16, 2))


def test_more_nodes_than_cpus_share_cpus():
    allowed = {0, 1, 2}
    real = [n for n in real_nodes(sys_root("interleaved"), allowed) if n.cpus]
    nodes = select_nodes(5, sys_root("interleaved"), allowed)
    check_virtual(nodes, 5, real)
    assert all(n.shares_cpus for n in nodes)


def test_select_with_cgroup_uses_only_its_cpus():
    nodes = select_nodes(None, sys_root("xeon-2s-container"))
    assert [n.cpus for n in nodes] == [r(2, 5) + r(60, 61), r(30, 33)]


@pytest.mark.parametrize("count", [0, -1])
def test_select_refuses_fewer_than_one_node(count):
    with pytest.raises(TopologyError, match=f"asked for {count} nodes"):
        select_nodes(count, sys_root("xeon-2s"))


def test_select_refuses_when_no_node_has_a_cpu():
    with pytest.raises(TopologyError, match="no NUMA node has a CPU"):
        select_nodes(None, sys_root("xeon-2s"), allowed=set())
    with pytest.raises(TopologyError, match="no NUMA node has a CPU"):
        select_nodes(4, sys_root("cxl"), allowed={100})


# --- format_table / as_dict -----------------------------------------------------------------


def table_rows(text: str) -> dict[str, str]:
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["node", "cpus"]
    return {line.split()[0]: line for line in lines[1:]}


def test_format_table_marks_memory_only_node():
    rows = table_rows(format_table(real_nodes(sys_root("cxl"))))
    assert set(rows) == {"0", "1", "2"}
    assert "memory only" in rows["2"]
    assert "memory only" not in rows["0"] and "memory only" not in rows["1"]
    assert "0-7" in rows["0"] and "8-15" in rows["1"]
    assert f"{134217728 * 1024 / 2**30:.1f}" in rows["2"]
    assert "virtual" not in format_table(real_nodes(sys_root("cxl")))


def test_format_table_marks_virtual_nodes():
    rows = table_rows(format_table(select_nodes(3, sys_root("cxl"))))
    assert len(rows) == 3
    assert all("virtual (of node" in row for row in rows.values())
    assert "virtual (of node 0" in rows["0"]
    assert "shared CPUs" not in "".join(rows.values())
    shared = table_rows(format_table(select_nodes(4, sys_root("cxl"), allowed={0, 1})))
    assert all("shared CPUs" in row for row in shared.values())


def test_format_table_unknown_memory(tmp_path):
    root = tmp_path / "m"
    (root / "devices/system/cpu").mkdir(parents=True)
    (root / "devices/system/cpu/online").write_text("0-3\n")
    rows = table_rows(format_table(real_nodes(root)))
    assert rows["0"].split()[1:4] == ["0-3", "-", "-"]


def test_as_dict_is_json():
    node = select_nodes(3, sys_root("xeon-2s"))[1]
    d = json.loads(json.dumps(node.as_dict()))
    assert d["cpus"] == list(node.cpus)
    assert d["virtual"] is True and d["parent"] == node.parent


# --- this machine ---------------------------------------------------------------------------


def test_this_machine_real_nodes():
    nodes = select_nodes(None)
    affinity = os.sched_getaffinity(0)
    assert len(nodes) >= 1
    for n in nodes:
        assert not n.virtual
        assert n.cpus and set(n.cpus) <= affinity
    cut = [c for n in nodes for c in n.cpus]
    assert len(cut) == len(set(cut))
    assert usable_cpus() <= affinity
    assert DEFAULT_SYS == Path("/sys")


def test_this_machine_virtual_nodes():
    real = select_nodes(None)
    count = 2 * len(real)
    nodes = select_nodes(count)
    check_virtual(nodes, count, real)
    assert {c for n in nodes for c in n.cpus} <= os.sched_getaffinity(0)


def test_cli_topo_json(capsys):
    from coordinator.cli.main import main

    if len(select_nodes(None)) >= 3:
        pytest.skip("this machine has 3 or more NUMA nodes with CPUs; --nodes 3 would not be virtual")
    assert main(["topo", "--json", "--nodes", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    nodes = doc["nodes"]
    assert len(nodes) == 3
    assert [n["id"] for n in nodes] == [0, 1, 2]
    assert all(n["virtual"] for n in nodes)
    real_ids = {n.id for n in real_nodes()}
    assert all(n["parent"] in real_ids for n in nodes)
    assert all(set(n["cpus"]) <= os.sched_getaffinity(0) for n in nodes)


def test_cli_topo_table(capsys):
    from coordinator.cli.main import main

    assert main(["topo"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert set(rows) == {str(n.id) for n in real_nodes()}


if __name__ == "__main__":
    # rewrite the fixture trees from MACHINES
    for name, machine in MACHINES.items():
        shutil.rmtree(FIXTURES / name, ignore_errors=True)
        write_tree(FIXTURES / name, machine)
        print("wrote", FIXTURES / name)


def test_available_memory_counts_reclaimable_page_cache(tmp_path):
    """A page cache full of recently read files is room: MemFree 3.2 GB with 15 GB of file pages and 1 GB
    of reclaimable slab is 19.2 GB available (issue 18: a 24 GB machine refused a 4.5 GB segment)."""
    from shm.topology import _meminfo

    kb = 1000 * 1000
    path = tmp_path / "meminfo"
    path.write_text("\n".join(f"Node 0 {k}: {v} kB" for k, v in (
        ("MemTotal", 24 * kb), ("MemFree", 3_200_000), ("Active(file)", 10 * kb), ("Inactive(file)", 5 * kb),
        ("Shmem", 2 * kb), ("SReclaimable", 1 * kb))) + "\n")
    total, available = _meminfo(path)
    assert total == 24 * kb * 1024 and available == (3_200_000 + 16 * kb) * 1024
