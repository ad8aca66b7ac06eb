"""measure.emulated: namespaces per node, a bridge, a tc-shaped link between nodes, cleanup on every exit.

The tests that build namespaces need root and iproute2 (skipped otherwise, with the reason); the argument
checks run everywhere. Every cluster here is small (2 nodes) and the link tests move a few MiB.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from measure import emulated
from measure.emulated import (
    EmulatedCluster,
    EmulationUnavailable,
    TopologyError,
    check_capacity,
    clean_leftovers,
    parse_rate_Bps,
    probe_link,
)

_REPO_ROOT = Path(__file__).resolve().parents[2]


def _why_not() -> str | None:
    try:
        emulated.check_environment()
    except EmulationUnavailable as reason:
        return str(reason)
    return None


needs_root = pytest.mark.skipif(_why_not() is not None, reason=f"emulated cluster: {_why_not()}")

# Rank r of 4 (2 nodes x 2): one gloo all-gather of SIZE bytes per rank, checked; then, reading node 0's
# veth tx counter (sysfs of the rank's namespace) around each, an exchange of SIZE bytes between ranks 0
# and 1 (both on node 0) and one between ranks 0 and 2 (node 0 and node 1). Rank 0 prints a JSON line.
_WORKER = """
import json, os
from datetime import timedelta
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world, n = dist.get_rank(), dist.get_world_size(), int(os.environ["SIZE"])
out = torch.empty(world * n, dtype=torch.uint8)
gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
gather(out, torch.full((n,), rank + 1, dtype=torch.uint8))
gathered = all(bool((out[i * n:(i + 1) * n] == i + 1).all()) for i in range(world))
counter = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes"
tx = lambda: int(open(counter).read())
moved = {}
for name, peer in (("intra", 1), ("inter", 2)):
    dist.barrier()
    if rank == 0:
        before = tx()
        dist.send(torch.zeros(n, dtype=torch.uint8), peer)
        dist.recv(torch.empty(n, dtype=torch.uint8), peer)
        moved[name] = tx() - before
    elif rank == peer:
        dist.recv(torch.empty(n, dtype=torch.uint8), 0)
        dist.send(torch.zeros(n, dtype=torch.uint8), 0)
flags = [None] * world
dist.all_gather_object(flags, [gathered, os.environ["GLOO_SOCKET_IFNAME"]])
dist.destroy_process_group()
if rank == 0:
    print(json.dumps({"ranks": flags, "tx_bytes": moved}), flush=True)
"""

# Holds an open 2-node cluster with a `sleep` on node 1; prints the sleep's pid, then waits.
# The owner of a cluster. Python installs its Ctrl-C handler only where SIGINT was not ignored at start
# (a shell's background job, nohup): the holder sets the state each test wants, whatever pytest inherited.
_HOLDER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN if sys.argv[1] == "ignore-sigint" else signal.default_int_handler)
from measure.emulated import EmulatedCluster
cluster = EmulatedCluster(2, 1, "100mbit").open()
child = cluster.popen(1, ["sleep", "600"])
print(child.pid, flush=True)
time.sleep(600)
"""

_EXCHANGE_BYTES = 4 << 20


def _ours(pid: int) -> list[str]:
    return [name for name in emulated._namespaces() if name.startswith(f"ciera-m-{pid}-")]


def _gone(pid: int) -> bool:
    """The process has exited (absent, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.fixture(scope="module")
def cluster():
    """2 nodes x 2 ranks, 100mbit between nodes (shared by the traffic tests)."""
    if _why_not():
        pytest.skip(_why_not())
    with EmulatedCluster(2, 2, "100mbit") as opened:
        yield opened


# ------------------------------------------------------------------------------------ needs no root


@pytest.mark.parametrize(
    ("rate", "expected_Bps"),
    [("200mbit", 25e6), ("1gbit", 125e6), ("10gbit", 1.25e9), ("125mbps", 125e6), ("1gibit", 2**30 / 8)],
)
def test_parse_rate(rate, expected_Bps):
    assert parse_rate_Bps(rate) == expected_Bps


@pytest.mark.parametrize("rate", ["fast", "200mb", "-1gbit", "", "1 gbit/s", "0bit", "10%"])
def test_bad_rate_is_one_line(rate):
    with pytest.raises(TopologyError) as error:
        parse_rate_Bps(rate)
    assert "\n" not in str(error.value) and "link rate" in str(error.value)
    with pytest.raises(TopologyError):
        EmulatedCluster(2, 1, rate)


@pytest.mark.parametrize(
    ("nodes", "ranks_per_node", "latency", "words"),
    [
        (0, 1, 0.0, "nodes"),
        (1, 0, 0.0, "ranks per node"),
        (-2, 2, 0.0, "nodes"),
        (2, 1.5, 0.0, "ranks per node"),
        (300, 1, 0.0, "at most 254"),
        (2, 1, -1.0, "latency"),
    ],
)
def test_bad_topology_is_one_line(nodes, ranks_per_node, latency, words):
    with pytest.raises(TopologyError) as error:
        EmulatedCluster(nodes, ranks_per_node, "1gbit", latency)
    assert "\n" not in str(error.value) and words in str(error.value)


def test_topology_without_namespaces():
    cluster = EmulatedCluster(3, 4, "200mbit")
    assert [cluster.node_of(rank) for rank in (0, 3, 4, 11)] == [0, 0, 1, 2]
    assert cluster.master_addr == cluster.address(0) == f"10.214.{os.getpid() % 256}.1"
    assert cluster.address(2).endswith(".3")
    assert all(len(cluster.interface(node)) <= 15 for node in range(3))
    with pytest.raises(TopologyError):
        cluster.node_of(12)
    with pytest.raises(RuntimeError):
        cluster.popen(0, ["true"])  # not open
    cluster.close()  # closing an unopened cluster is a no-op
    description = cluster.describe()
    assert description["link_rate_Bps"] == 25e6 and description["qdiscs"] == []


def test_check_capacity_refuses_big_topologies():
    with pytest.raises(TopologyError) as error:
        check_capacity(64, 64, 100e6)
    message = str(error.value)
    cores = len(os.sched_getaffinity(0))
    assert "\n" not in message
    assert "64 nodes" in message and "4096 ranks" in message and f"{8 * cores}" in message
    with pytest.raises(TopologyError) as error:
        check_capacity(2, 2, 10e9, cpu_cores=8, mem_available_bytes=16 * 10**9)
    assert "MemAvailable" in str(error.value) and "40.0 GB" in str(error.value)
    check_capacity(2, 2, 1e9, cpu_cores=2, mem_available_bytes=16 * 10**9)  # fits


def test_check_environment_without_root(monkeypatch):
    monkeypatch.setattr(emulated.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(emulated.sys, "platform", "linux")
    with pytest.raises(EmulationUnavailable) as error:
        emulated.check_environment()
    assert str(error.value).startswith("needs root to create network namespaces; without --nodes")


# ------------------------------------------------------------------------------------ needs root


@pytest.fixture
def interactive_sigint():
    """SIGINT as an interactive Python has it, even when pytest was started with it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@needs_root
def test_open_close_leaves_nothing(interactive_sigint):
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    cluster = EmulatedCluster(2, 2, "200mbit")
    names = {*cluster.node_namespaces, cluster.hub_namespace}
    with cluster:
        assert names <= set(_ours(os.getpid())) and len(names) == 3
        root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert f"cm{os.getpid()}" not in root_links  # nothing in the root namespace
        description = cluster.describe()
        assert description["nodes"] == 2 and description["ranks_per_node"] == 2
        assert description["addresses"] == [cluster.address(0), cluster.address(1)]
        qdiscs = description["qdiscs"]
        assert len(qdiscs) == 4 and all("tbf" in line and "200Mbit" in line for line in qdiscs)
        # 64 KB frames on both ends of every veth (per-packet shaping in software costs the ranks' CPU),
        # and a bucket that holds two of them (tbf drops a packet larger than its bucket).
        assert description["link_mtu_bytes"] == 65000 and description["link_burst_bytes"] >= 2 * 65000
        for node in range(2):
            for ns, dev in (
                (cluster.namespace(node), cluster.interface(node)),
                (cluster.hub_namespace, f"cm{os.getpid()}h{node}"),
            ):
                shown = subprocess.run(
                    ["ip", "-n", ns, "link", "show", "dev", dev], capture_output=True, text=True
                )
                assert " mtu 65000 " in shown.stdout, (ns, dev, shown.stdout)
        assert signal.getsignal(signal.SIGINT) is not handlers[signal.SIGINT]
        # A rank's own address is delivered over the namespace's loopback, another node's over the veth.
        ns = cluster.namespace(0)
        own = subprocess.run(
            ["ip", "-n", ns, "route", "get", cluster.address(0)], capture_output=True, text=True
        )
        other = subprocess.run(
            ["ip", "-n", ns, "route", "get", cluster.address(1)], capture_output=True, text=True
        )
        assert own.stdout.startswith("local") and " dev lo " in own.stdout
        assert f" dev {cluster.interface(0)} " in other.stdout
    assert not names & set(_ours(os.getpid()))
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    cluster.close()  # idempotent


@pytest.fixture(scope="module")
def four_ranks(cluster):
    """One run of _WORKER on all 4 ranks of ``cluster``; rank 0's report."""
    env = os.environ | {"MASTER_PORT": "29750", "SIZE": str(_EXCHANGE_BYTES), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    processes = emulated._start_python(
        cluster, [0, 1, 2, 3], _WORKER, env, stdout=subprocess.PIPE, text=True, cwd=_REPO_ROOT
    )
    failed = emulated.wait_for_ranks(processes, timeout_s=120)
    outputs = [process.communicate()[0].strip() for process in processes]
    assert not failed, failed
    return json.loads(outputs[0])


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@needs_root
def test_all_gather_across_four_ranks(cluster, four_ranks):
    assert [gathered for gathered, _ in four_ranks["ranks"]] == [True] * 4
    # Each rank's gloo is bound to its own node's veth.
    assert [device for _, device in four_ranks["ranks"]] == [
        cluster.interface(cluster.node_of(rank)) for rank in range(4)
    ]


@pytest.mark.heavy  # the four-rank run it reads takes ~5 s: the heavy tier
@needs_root
def test_intra_node_traffic_stays_off_the_link(four_ranks):
    intra, inter = four_ranks["tx_bytes"]["intra"], four_ranks["tx_bytes"]["inter"]
    assert intra < 64 << 10, f"{intra} bytes of an intra-node exchange crossed the link"
    assert _EXCHANGE_BYTES <= inter < 1.2 * _EXCHANGE_BYTES


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@needs_root
def test_probe_link_close_to_nominal(cluster):
    tracked = list(cluster.processes)
    result = probe_link(cluster, size_bytes=2 << 20, repeats=3, timeout_s=60)
    ratio = result["measured_link_Bps"] / cluster.link_rate_Bps
    assert 0.5 <= ratio <= 1.1, result
    assert len(result["times_s"]) == 3 and result["size_bytes"] == 2 << 20
    assert result["best_link_Bps"] >= result["measured_link_Bps"]
    assert result["measured_intra_node_Bps"] > 2 * result["measured_link_Bps"]
    assert cluster.processes == tracked  # the probe's workers are reaped and forgotten


@pytest.mark.heavy  # over 3 s on 2 cores: the heavy tier (CI runs it with -m heavy)
@needs_root
def test_the_link_is_reshaped_in_place(cluster):
    """set_link_rate changes every veth end's tbf: the probe follows the new rate; the namespaces stay."""
    namespaces = list(cluster.node_namespaces)
    try:
        cluster.set_link_rate("400mbit")
        assert cluster.describe()["link_rate"] == "400mbit" and cluster.node_namespaces == namespaces
        fast = probe_link(cluster, size_bytes=2 << 20, repeats=3, timeout_s=60)["measured_link_Bps"]
        assert 0.5 <= fast / cluster.link_rate_Bps <= 1.1, fast
    finally:
        cluster.set_link_rate("100mbit")
    slow = probe_link(cluster, size_bytes=2 << 20, repeats=3, timeout_s=60)["measured_link_Bps"]
    assert 0.5 <= slow / cluster.link_rate_Bps <= 1.1 and fast > 2 * slow, (fast, slow)
    with pytest.raises(TopologyError):
        cluster.set_link_rate("fast")


@needs_root
def test_probe_times_out_in_one_line_and_never_hangs(cluster):
    tracked, start = list(cluster.processes), time.monotonic()
    with pytest.raises(emulated.ProbeError) as error:
        probe_link(cluster, size_bytes=1024, repeats=1, timeout_s=0.5)  # torch alone takes longer to import
    assert time.monotonic() - start < 10
    assert "\n" not in str(error.value) and "still running after 0.5 s" in str(error.value)
    assert cluster.processes == tracked
    assert not subprocess.run(
        ["ip", "netns", "pids", cluster.namespace(0)], capture_output=True, text=True
    ).stdout


def _start_holder(sigint: str = "default") -> tuple[subprocess.Popen, int]:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, sigint],
        cwd=_REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = holder.stdout.readline()
    assert line.strip().isdigit(), holder.stderr.read() if holder.poll() is not None else line
    return holder, int(line)


@needs_root
def test_sigkilled_owner_leaves_leftovers_that_clean_leftovers_removes():
    holder, child = _start_holder()
    holder.kill()
    holder.wait()
    left = _ours(holder.pid)
    assert len(left) == 3 and not _gone(child)  # the rank outlived its owner, inside a namespace
    removed = clean_leftovers()
    assert set(left) <= set(removed)
    assert _ours(holder.pid) == []
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


@needs_root
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_owner_removes_everything(signum):
    holder, child = _start_holder()
    assert len(_ours(holder.pid)) == 3
    holder.send_signal(signum)
    holder.communicate(timeout=30)
    assert holder.returncode != 0
    assert _ours(holder.pid) == []
    assert _gone(child)


@needs_root
def test_an_owner_that_ignores_sigint_keeps_ignoring_it_and_sigterm_still_cleans_up():
    holder, child = _start_holder("ignore-sigint")  # as under nohup or in a shell's background job
    holder.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert holder.poll() is None and len(_ours(holder.pid)) == 3
    holder.send_signal(signal.SIGTERM)
    holder.communicate(timeout=30)
    assert holder.returncode != 0
    assert _ours(holder.pid) == []
    assert _gone(child)


@needs_root
def test_clean_leftovers_spares_live_clusters(cluster):
    assert not set(clean_leftovers()) & {*cluster.node_namespaces, cluster.hub_namespace}
    assert len(_ours(os.getpid())) == 3


def test_describe_is_json(cluster):
    json.dumps(cluster.describe())


@needs_root
def test_a_forked_copy_does_not_tear_the_cluster_down(cluster):
    pid = os.fork()
    if pid == 0:  # the child: what its atexit or an inherited Ctrl-C handler would run
        try:
            cluster.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert len(_ours(os.getpid())) == 3
    assert cluster.link_bytes(0)["tx_bytes"] >= 0  # still there, still ours
