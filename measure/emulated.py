"""A local emulated two-level cluster: one network namespace per node, a shaped link between nodes.

A GPU cluster has two link levels: fast inside a node (NVLink) and slower across nodes (InfiniBand). On one
Linux machine, as root, this module builds the same shape for ranks that run as local processes:

- one network namespace per node, ``ciera-m-<pid>-n<i>``, and one hub namespace ``ciera-m-<pid>-hub``
  holding a Linux bridge; node i is joined to the bridge by a veth pair (node end ``cm<pid>n<i>`` in the
  node's namespace, hub end ``cm<pid>h<i>`` in the hub's, attached to the bridge). Nothing is created in the
  root namespace.
- node i's end has address ``10.214.<x>.<i+1>/24`` with ``x = pid % 256`` (see ``subnet_octet``); ``lo``
  is up in every node namespace.
- ``tc tbf`` at the link rate is the root qdisc of both ends of every veth: the node end shapes what the
  node sends, the hub end what it receives. ``link_latency_s`` adds a netem delay in front of tbf on the
  node end only, so a packet from one node to another is delayed once: one-way latency = link_latency_s.
- every rank of a node runs inside the node's namespace (``popen``). gloo binds to the node's veth address
  (``GLOO_SOCKET_IFNAME``); traffic to another rank of the same node goes to a local address, which the
  kernel delivers over the namespace's loopback (the fast level); traffic to another node crosses the two
  shaped veth ends and the bridge (the slow level).

``close()`` kills every process in the namespaces and deletes them (which deletes the veths and the
bridge); ``open()`` arranges for it to run at exit, on an exception leaving a ``with`` block and on
SIGINT/SIGTERM/SIGHUP. A SIGKILLed owner leaves its namespaces behind: ``clean_leftovers()`` removes those
of owners that no longer run. Only namespaces whose name starts with ``ciera-m-`` are ever touched.
docs/emulated-cluster.md has the details and how to clean up by hand.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from .placement import cpu_cores as usable_cpu_cores

PREFIX = "ciera-m-"
SUBNET = "10.214"
MAX_NODES = 254  # host numbers 1..254 of one /24
TBF_LATENCY = "50ms"
_MIN_BURST_BYTES = 16 << 10
# MTU of every veth end of the shaped link. tbf shapes in software, packet by packet: at 200 Mbit with
# 1500-byte packets, moving 100 MiB each way between two nodes cost this 2-core machine 2.5 s of softirq and
# 0.8 s of system time in 5 s (at 1 Gbit: 0.01 s), CPU taken from the ranks' compute, which a real
# cluster's NIC does not take (docs/emulated-cluster.md). 64 KB frames (veth's maximum is 65535; RoCE and
# IPoIB run 4–64 KiB) make it 0.03 s at the same throughput.
LINK_MTU_BYTES = 65000
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PROBE_PORTS = itertools.count(29650)
_OPEN_NAMESPACES: set[str] = set()  # namespaces of clusters open in this process

__all__ = [
    "EmulatedCluster",
    "EmulationError",
    "EmulationUnavailable",
    "ProbeError",
    "TopologyError",
    "check_capacity",
    "check_environment",
    "clean_leftovers",
    "leftover_namespaces",
    "parse_rate_Bps",
    "probe_link",
    "node_address",
    "subnet_octet",
    "wait_for_ranks",
]


class EmulationError(Exception):
    """Base of this module's errors; the message is one line."""


class EmulationUnavailable(EmulationError):
    """This machine cannot emulate a cluster (not Linux, not root, no iproute2, a missing kernel feature)."""


class TopologyError(EmulationError, ValueError):
    """Bad nodes / ranks per node / rate / latency, or a topology this machine cannot hold."""


class ProbeError(EmulationError):
    """A link probe timed out or one of its workers died."""


# ------------------------------------------------------------------------------------------- helpers


def _run(*command: str, check: bool = True, error=EmulationError, stdin: str | None = None):
    done = subprocess.run(command, capture_output=True, text=True, input=stdin)
    if check and done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip()).replace("\n", "; ")
        raise error(f"{' '.join(command)}: {detail}")
    return done


_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_PREFIXES = {
    "": 1,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
# tc(8) RATES: "bit" or a bare number is bits per second, "bps" bytes per second; SI and IEC prefixes.
_RATE_UNITS_BITS = {f"{p}bit": m for p, m in _PREFIXES.items()} | {
    f"{p}bps": 8 * m for p, m in _PREFIXES.items()
}
_RATE_UNITS_BITS[""] = 1


def parse_rate_Bps(rate: str) -> float:
    """A rate in tc syntax (``200mbit``, ``1gbit``, ``10gbit``, ``125mbps``, ``1gibit``) in bytes/s.

    As in tc, ``bit`` (or no unit) is bits per second and ``bps`` bytes per second; k/m/g/t are powers of
    1000, ki/mi/gi/ti powers of 1024. Anything else raises TopologyError with one line."""
    match = _RATE_RE.match(str(rate))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _RATE_UNITS_BITS:
        raise TopologyError(
            f"link rate {rate!r}: expected a number and a tc rate unit (bit, kbit, mbit, gbit, tbit, bps, "
            "kbps, mbps, gbps, tbps; kibit, mibit, ... for powers of 1024), e.g. 200mbit, 1gbit, 10gbit"
        )
    bytes_per_s = float(match.group(1)) * _RATE_UNITS_BITS[unit] / 8
    if bytes_per_s < 1:
        raise TopologyError(f"link rate {rate!r}: must be at least 8bit (one byte per second)")
    return bytes_per_s


def burst_bytes(rate_Bps: float) -> int:
    """tbf bucket size for a rate: about 1 ms of data, at least two full-size frames (tbf drops a packet
    larger than its bucket, so the bucket must hold an MTU-sized one).

    The kernel's tbf watchdog is a high-resolution timer, so the bucket need not cover a timer tick; a
    bucket much larger than that lets short transfers run faster than the rate."""
    return max(_MIN_BURST_BYTES, 2 * LINK_MTU_BYTES, round(rate_Bps * 1e-3))


def subnet_octet(pid: int) -> int:
    """The third octet of a cluster's addresses: ``pid % 256``.

    Every cluster lives in its own namespaces (its own bridge, its own routing tables), so even equal
    addresses in two clusters could not collide; deriving the subnet from the pid keeps concurrent clusters
    of different processes on different subnets all the same, which keeps listings and logs unambiguous."""
    return pid % 256


def node_address(pid: int, node: int) -> str:
    """Node ``node``'s address in the cluster of process ``pid``: ``10.214.<pid % 256>.<node + 1>``."""
    return f"{SUBNET}.{subnet_octet(pid)}.{node + 1}"


def wait_for_ranks(processes: list, timeout_s: float, poll_s: float = 0.1) -> list[str]:
    """Wait until every process has exited, one has failed, or ``timeout_s`` passed; what went wrong (empty
    when every process exited 0). A failed rank ends the wait at once: the others would wait for it until
    gloo's timeout."""
    deadline = time.monotonic() + timeout_s
    failed = []
    while any(p.poll() is None for p in processes):
        if any(p.poll() not in (None, 0) for p in processes):
            break
        if time.monotonic() > deadline:
            failed.append(f"ranks still running after {timeout_s} s")
            break
        time.sleep(poll_s)
    for rank, process in enumerate(processes):
        if process.poll() not in (None, 0):
            failed.append(f"rank {rank} exited with {process.returncode}")
    return failed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    listing = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _kill_namespace_processes(name: str) -> None:
    """SIGKILL every process in namespace ``name`` (a deleted name would not end the namespace while they
    live); a few rounds, for processes that were forking."""
    for _ in range(5):
        pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.02)


def _delete_namespace(name: str) -> None:
    if not name.startswith(PREFIX):  # never touch anything else
        raise ValueError(f"refusing to delete namespace {name!r}: not {PREFIX}*")
    _kill_namespace_processes(name)
    _run("ip", "netns", "delete", name, check=False)


def _owner_pid(name: str) -> int | None:
    owner = name[len(PREFIX) :].split("-")[0]
    return int(owner) if owner.isdigit() else None


def leftover_namespaces() -> dict[str, float | None]:
    """The ``ciera-m-`` namespaces whose creating process no longer runs, each with when it was created
    (epoch seconds; None: unknown) — what a killed capture's processes left elsewhere (`measure.extensions`)
    is no older. Namespaces of live owners, and of clusters open in this process, are not leftovers."""
    leftovers: dict[str, float | None] = {}
    for name in _namespaces():
        if not name.startswith(PREFIX) or name in _OPEN_NAMESPACES:
            continue
        owner = _owner_pid(name)
        if owner is not None and owner != os.getpid() and _pid_alive(owner):
            continue  # another live capture
        try:
            leftovers[name] = os.stat(f"/run/netns/{name}").st_mtime
        except OSError:
            leftovers[name] = None
    return leftovers


def clean_leftovers(names: Iterable[str] | None = None) -> list[str]:
    """Remove leftover namespaces — `names` (from `leftover_namespaces`), by default every one now — their
    processes killed first; the names removed, for the caller to print."""
    removed = []
    for name in leftover_namespaces() if names is None else names:
        _delete_namespace(name)
        removed.append(name)
    return removed


def check_environment() -> None:
    """Raise EmulationUnavailable (one line) when this machine cannot create the namespaces."""
    if sys.platform != "linux":
        raise EmulationUnavailable("an emulated cluster needs Linux network namespaces")
    if os.geteuid() != 0:
        raise EmulationUnavailable(
            "needs root to create network namespaces; without --nodes the ranks run as plain local processes"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise EmulationUnavailable(f"'{tool}' not found (install iproute2)")
    done = _run("ip", "netns", "list", check=False)
    if done.returncode != 0:
        detail = (done.stderr.strip() or "no output").replace("\n", "; ")
        raise EmulationUnavailable(f"'ip netns' does not work here: {detail}")


def _mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise EmulationUnavailable("/proc/meminfo has no MemAvailable line")


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB"


def check_capacity(
    nodes: int,
    ranks_per_node: int,
    memory_per_rank_bytes: float,
    *,
    cpu_cores: int | None = None,
    mem_available_bytes: int | None = None,
) -> None:
    """Raise TopologyError (one line, naming the numbers) when this machine cannot hold the topology: more
    than 8 ranks per CPU core this process may use, or more than 80 % of MemAvailable (/proc/meminfo)
    for ``memory_per_rank_bytes`` × ranks. ``cpu_cores`` / ``mem_available_bytes`` override the machine's."""
    _check_topology(nodes, ranks_per_node)
    ranks = nodes * ranks_per_node
    cores = cpu_cores if cpu_cores is not None else usable_cpu_cores()
    if ranks > 8 * cores:
        raise TopologyError(
            f"{nodes} nodes x {ranks_per_node} ranks per node = {ranks} ranks is more than this machine "
            f"holds: at most 8 ranks per CPU core x {cores} cores = {8 * cores}"
        )
    available = mem_available_bytes if mem_available_bytes is not None else _mem_available_bytes()
    needed = ranks * memory_per_rank_bytes
    if needed > 0.8 * available:
        raise TopologyError(
            f"{ranks} ranks x {_gb(memory_per_rank_bytes)} per rank = {_gb(needed)} is more than 80 % of "
            f"MemAvailable ({_gb(available)}, 80 % = {_gb(0.8 * available)})"
        )


def _check_topology(nodes, ranks_per_node) -> None:
    for name, value in (("nodes", nodes), ("ranks per node", ranks_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TopologyError(f"{name} must be a whole number >= 1, got {value!r}")
    if nodes > MAX_NODES:
        raise TopologyError(f"nodes must be at most {MAX_NODES} (one /24 subnet), got {nodes}")


@contextlib.contextmanager
def _signals_blocked():
    """Hold SIGINT/SIGTERM/SIGHUP back while namespaces are being created or removed (delivered after)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ------------------------------------------------------------------------------------------- the cluster


class EmulatedCluster:
    """``nodes`` network namespaces of ``ranks_per_node`` ranks each, joined through a bridge by veth links
    shaped to ``link_rate`` (tc syntax) in both directions, plus ``link_latency_s`` one-way between nodes.

    Ranks are node-major: ranks 0..G-1 on node 0, G..2G-1 on node 1, ... Use as a context manager or call
    ``open()`` / ``close()``; ``close()`` is idempotent and also runs at exit and on SIGINT/SIGTERM/SIGHUP.
    """

    def __init__(self, nodes: int, ranks_per_node: int, link_rate: str, link_latency_s: float = 0.0) -> None:
        _check_topology(nodes, ranks_per_node)
        self.link_rate_Bps = parse_rate_Bps(link_rate)
        latency = link_latency_s
        if isinstance(latency, bool) or not isinstance(latency, int | float) or not latency >= 0:
            raise TopologyError(f"link latency must be a number of seconds >= 0, got {link_latency_s!r}")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.link_rate, self.link_latency_s = str(link_rate).strip(), float(latency)
        self.burst_bytes = burst_bytes(self.link_rate_Bps)
        self.pid = os.getpid()
        self.hub_namespace = f"{PREFIX}{self.pid}-hub"
        self.node_namespaces = [f"{PREFIX}{self.pid}-n{i}" for i in range(nodes)]
        self.bridge = f"cm{self.pid}br"
        self.processes: list[subprocess.Popen] = []  # close() kills these (callers may append their own)
        self._state = "new"  # new -> open -> closed
        self._handlers: dict[int, tuple] = {}  # signum -> (previous handler, ours)

    # ---------------------------------------------------------------- topology

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TopologyError(f"rank must be in 0..{self.world_size - 1}, got {rank!r}")
        return rank // self.ranks_per_node

    def _check_node(self, node: int) -> None:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise TopologyError(f"node must be in 0..{self.nodes - 1}, got {node!r}")

    def address(self, node: int) -> str:
        self._check_node(node)
        return node_address(self.pid, node)

    @property
    def master_addr(self) -> str:
        return self.address(0)

    def interface(self, node: int) -> str:
        """The node end of node ``node``'s veth (what GLOO_SOCKET_IFNAME names); at most 15 characters."""
        self._check_node(node)
        return f"cm{self.pid}n{node}"

    def _hub_interface(self, node: int) -> str:
        return f"cm{self.pid}h{node}"

    def namespace(self, node: int) -> str:
        self._check_node(node)
        return self.node_namespaces[node]

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> EmulatedCluster:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> EmulatedCluster:
        """Create the namespaces, bridge, veths and qdiscs. Raises EmulationUnavailable (one line) when this
        machine cannot; whatever was created by then is removed first."""
        if self._state != "new":
            raise RuntimeError(f"cluster already {self._state}")
        if os.getpid() != self.pid:
            raise RuntimeError("open a cluster in the process that created it (its names carry that pid)")
        check_environment()
        self._state = "open"
        _OPEN_NAMESPACES.update(self._all_namespaces())
        self._register_cleanup()
        try:
            with _signals_blocked():  # Ctrl-C now would race with namespace creation: deliver it after
                self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _all_namespaces(self) -> list[str]:
        return [*self.node_namespaces, self.hub_namespace]

    def _create(self) -> None:
        hub = self.hub_namespace
        for ns in self._all_namespaces():
            _run("ip", "netns", "add", ns)
        _run(
            "ip", "-n", hub, "link", "add", self.bridge, "type", "bridge",
            error=EmulationUnavailable,
        )  # fmt: skip
        hub_lines = [f"link set {self.bridge} up"]
        tc_hub = []
        for node, ns in enumerate(self.node_namespaces):
            dev, peer = self.interface(node), self._hub_interface(node)
            # Both ends are created inside their namespaces: nothing ever appears in the root namespace.
            _run(
                "ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer, "netns", hub,
                error=EmulationUnavailable,
            )  # fmt: skip
            hub_lines += [
                f"link set {peer} mtu {LINK_MTU_BYTES}",
                f"link set {peer} master {self.bridge}",
                f"link set {peer} up",
            ]
            _run(
                "ip", "-n", ns, "-batch", "-",
                stdin=f"link set lo up\naddr add {self.address(node)}/24 dev {dev}\n"
                f"link set {dev} mtu {LINK_MTU_BYTES}\nlink set {dev} up\n",
            )  # fmt: skip
            self._shape(ns, dev, delay_s=self.link_latency_s)
            tc_hub.append(peer)
        _run("ip", "-n", hub, "-batch", "-", stdin="\n".join(hub_lines) + "\n")
        for peer in tc_hub:
            self._shape(hub, peer, delay_s=0.0)

    def _tbf(self) -> str:
        rate_bits = round(self.link_rate_Bps * 8)
        return f"tbf rate {rate_bits}bit burst {self.burst_bytes} latency {TBF_LATENCY}"

    def _shape(self, ns: str, dev: str, delay_s: float) -> None:
        if delay_s <= 0:
            _run(
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                *self._tbf().split(),
                error=EmulationUnavailable,
            )
            return
        # netem queue: room for twice the bytes in flight over the delay, in full-size packets.
        limit = max(1000, int(2 * self.link_rate_Bps * delay_s / 1500))
        netem = ["netem", "delay", f"{delay_s * 1e6:.0f}us", "limit", str(limit)]
        done = _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem, check=False)
        if done.returncode != 0:
            raise EmulationUnavailable(
                f"a link latency needs the netem qdisc, which this kernel lacks: {done.stderr.strip()}"
            )
        _run(
            "tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *self._tbf().split(),
            error=EmulationUnavailable,
        )  # fmt: skip

    def set_link_rate(self, link_rate: str) -> None:
        """Re-shape every veth end to ``link_rate`` (tc syntax) in place: the namespaces, addresses and
        running processes stay. A capture interleaves the runs of several link rates of one shape this way,
        so that slow drift of the machine's speed hits every rate alike."""
        if self._state != "open":
            raise RuntimeError(f"set_link_rate on a cluster that is {self._state}, expected open")
        rate_Bps = parse_rate_Bps(link_rate)
        self.link_rate, self.link_rate_Bps = str(link_rate).strip(), rate_Bps
        self.burst_bytes = burst_bytes(rate_Bps)
        for node, ns in enumerate(self.node_namespaces):
            where = ["root"] if self.link_latency_s <= 0 else ["parent", "1:1", "handle", "10:"]
            _run("tc", "-n", ns, "qdisc", "change", "dev", self.interface(node), *where, *self._tbf().split())
            _run(
                "tc", "-n", self.hub_namespace, "qdisc", "change", "dev", self._hub_interface(node), "root",
                *self._tbf().split(),
            )  # fmt: skip

    def close(self) -> None:
        """Kill the tracked processes and any other process in the namespaces, delete the namespaces (and
        with them the veths and the bridge), restore the signal handlers. Idempotent."""
        if self._state != "open":
            self._state = "closed"
            return
        if os.getpid() != self.pid:
            # A forked copy (its atexit or an inherited signal handler, e.g. Ctrl-C reaching a worker
            # forked by the owner) does not own the namespaces: leave them to the owner.
            self._state = "closed"
            return
        with _signals_blocked():
            self._state = "closed"
            for process in self.processes:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            for ns in self._all_namespaces():
                _delete_namespace(ns)
            for process in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=5)
            _OPEN_NAMESPACES.difference_update(self._all_namespaces())
            self._unregister_cleanup()

    # ---------------------------------------------------------------- exit and signals

    def _register_cleanup(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread: atexit and close() only
        for signum in _SIGNALS:
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:
                continue  # the process ignores it (nohup): so do we

            def on_signal(signum, frame, previous=previous):
                self.close()  # restores the previous handler
                if callable(previous):
                    previous(signum, frame)
                elif signum == signal.SIGINT:
                    raise KeyboardInterrupt
                else:
                    raise SystemExit(128 + signum)

            signal.signal(signum, on_signal)
            self._handlers[signum] = (previous, on_signal)

    def _unregister_cleanup(self) -> None:
        atexit.unregister(self.close)
        for signum, (previous, ours) in self._handlers.items():
            # Someone who set a handler after us keeps theirs (ours, if it chains to it, is now a no-op).
            if signal.getsignal(signum) is ours:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._handlers.clear()

    # ---------------------------------------------------------------- processes

    def popen(self, rank: int, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``rank``'s node namespace (``ip netns exec``), with ``env`` (default: this
        process's environment) plus GLOO_SOCKET_IFNAME=<the node's veth> and MASTER_ADDR=master_addr
        (these two always win). RANK, WORLD_SIZE, MASTER_PORT, ... are the caller's. The process is
        tracked: close() kills it. ``kwargs`` go to subprocess.Popen."""
        if self._state != "open":
            raise RuntimeError(f"popen on a cluster that is {self._state}, not open")
        node = self.node_of(rank)
        full_env = dict(os.environ if env is None else env)
        full_env |= {"GLOO_SOCKET_IFNAME": self.interface(node), "MASTER_ADDR": self.master_addr}
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(node), *argv], env=full_env, **kwargs
        )
        self.processes.append(process)
        return process

    # ---------------------------------------------------------------- inspection

    def link_bytes(self, node: int) -> dict:
        """Byte counters of node ``node``'s veth end: ``tx_bytes`` (sent towards other nodes) and
        ``rx_bytes`` (received from them); traffic between ranks of one node never counts here."""
        self._check_node(node)
        done = _run("ip", "-j", "-s", "-n", self.namespace(node), "link", "show", "dev", self.interface(node))
        stats = json.loads(done.stdout)[0]["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"]}

    def qdiscs(self) -> list[str]:
        """``tc qdisc show`` of every veth end, each line prefixed with its namespace and device."""
        if self._state != "open":
            return []
        lines = []
        for node, ns in enumerate(self.node_namespaces):
            for where, dev in ((ns, self.interface(node)), (self.hub_namespace, self._hub_interface(node))):
                shown = _run("tc", "-n", where, "qdisc", "show", "dev", dev).stdout
                lines += [f"{where} {dev}: {line.strip()}" for line in shown.splitlines() if line.strip()]
        return lines

    def describe(self) -> dict:
        """What was built, for the trace record."""
        return {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "world_size": self.world_size,
            "link_rate": self.link_rate,
            "link_rate_Bps": self.link_rate_Bps,
            "link_burst_bytes": self.burst_bytes,
            "link_mtu_bytes": LINK_MTU_BYTES,
            "link_latency_s": self.link_latency_s,
            "namespaces": {"nodes": list(self.node_namespaces), "hub": self.hub_namespace},
            "addresses": [self.address(node) for node in range(self.nodes)],
            "interfaces": [self.interface(node) for node in range(self.nodes)],
            "qdiscs": self.qdiscs(),
        }


# ------------------------------------------------------------------------------------------- link probe


def _probe_worker() -> None:
    """One process of a probe (started by ``probe_link`` through ``popen``). World rank 0 is on node 0,
    1 on node 1 and, in a world of 3, 2 is the second rank of node 0. Pair by pair (``link``: 0 and 1;
    ``intra_node``: 0 and 2) the pair's two ranks run one warm-up all-gather of CIERA_PROBE_SIZE_BYTES
    per rank, then CIERA_PROBE_REPEATS timed ones, each after a barrier of the pair, while the third
    waits; prints its times as one JSON line."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    size = int(os.environ["CIERA_PROBE_SIZE_BYTES"])
    repeats = int(os.environ["CIERA_PROBE_REPEATS"])
    timeout = timedelta(seconds=float(os.environ["CIERA_PROBE_TIMEOUT_S"]))
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    pairs = {"link": [0, 1], "intra_node": [0, 2]}
    if dist.get_world_size() == 2:
        del pairs["intra_node"]
    groups = {name: dist.new_group(members) for name, members in pairs.items()}  # every rank makes each
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name
    times: dict[str, list[float]] = {}
    for name, members in pairs.items():
        if rank in members:
            group = groups[name]
            mine = torch.full((size,), members.index(rank) + 1, dtype=torch.uint8)
            out = torch.empty(2 * size, dtype=torch.uint8)
            gather(out, mine, group=group)  # warm-up: connections, socket buffers
            times[name] = []
            for _ in range(repeats):
                dist.barrier(group=group)
                start = time.perf_counter()
                gather(out, mine, group=group)
                times[name].append(time.perf_counter() - start)
            if not (bool((out[:size] == 1).all()) and bool((out[size:] == 2).all())):
                raise SystemExit(f"probe rank {rank}: the {name} all-gather returned wrong bytes")
        dist.barrier()  # one pair at a time: nothing else on the wire while a pair is timed
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "times_s": times}), flush=True)


def _start_python(cluster: EmulatedCluster, ranks: list[int], code: str, env: dict, **kwargs) -> list:
    """``python -c code`` on each of ``ranks`` (cluster ranks) through ``popen``, as one world: RANK is the
    index in ``ranks``, WORLD_SIZE their number (the first must be on node 0, where MASTER_ADDR is)."""
    world = {"WORLD_SIZE": str(len(ranks))}
    return [
        cluster.popen(rank, [sys.executable, "-c", code], env=env | world | {"RANK": str(index)}, **kwargs)
        for index, rank in enumerate(ranks)
    ]


def _probe(
    cluster: EmulatedCluster, size_bytes: int, repeats: int, timeout_s: float
) -> dict[str, list[float]]:
    """Run the probe workers on rank 0, the first rank of node 1 and (with 2+ ranks per node) rank 1; per
    pair, per repeat, the slower rank's time."""
    ranks = [0, cluster.ranks_per_node] + ([1] if cluster.ranks_per_node >= 2 else [])
    env = os.environ | {
        "MASTER_PORT": str(next(_PROBE_PORTS)),
        "OMP_NUM_THREADS": "1",
        "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10d warns that it cannot resolve the namespace's addresses
        "CIERA_PROBE_SIZE_BYTES": str(size_bytes),
        "CIERA_PROBE_REPEATS": str(repeats),
        "CIERA_PROBE_TIMEOUT_S": str(timeout_s),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])),
    }
    code = "from measure.emulated import _probe_worker; from measure.rank import leave_rank; _probe_worker(); leave_rank(0)"
    with tempfile.TemporaryDirectory(prefix="ciera-probe-") as scratch:
        log = Path(scratch) / "workers.err"
        processes = []
        try:
            with log.open("w") as err:
                processes = _start_python(
                    cluster,
                    ranks,
                    code,
                    env,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    cwd=_PACKAGE_ROOT,
                )
            failed = wait_for_ranks(processes, timeout_s)
            if failed:
                detail = _last_line(log)
                raise ProbeError(
                    f"link probe (ranks {ranks} of the cluster): {'; '.join(failed)}"
                    + (f" ({detail})" if detail else "")
                )
            results = [json.loads(p.stdout.read().strip().splitlines()[-1]) for p in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait()
                if process.stdout:
                    process.stdout.close()
                with contextlib.suppress(ValueError):
                    cluster.processes.remove(process)
    per_pair: dict[str, list[float]] = {}
    for name in results[0]["times_s"]:
        members = [r["times_s"][name] for r in results if name in r["times_s"]]
        per_pair[name] = [max(repeat) for repeat in zip(*members, strict=True)]
    return per_pair


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def probe_link(
    cluster: EmulatedCluster, size_bytes: int = 8 << 20, repeats: int = 5, timeout_s: float = 120
) -> dict:
    """Measure the rate gloo gets across the shaped link and, with 2+ ranks per node, inside a node.

    Rank 0 (node 0) and rank G (node 1) form a gloo group of 2 over the veth; after one warm-up they time
    ``repeats`` ``all_gather_into_tensor`` calls of ``size_bytes`` per rank (each rank sends its
    ``size_bytes`` to the other and receives the other's). Per repeat the slower rank's time counts;
    ``measured_link_Bps = size_bytes / median_s``: the bytes one rank sends across the link per second
    (each direction carries that much at once). The bucket of tbf refills between repeats, so the figure
    includes one burst (``describe()["link_burst_bytes"]``) per repeat.

    gloo's repeats are bimodal: when both ranks post their send before either sees the other's "ready to
    receive" message, the two directions overlap (about 0.9 of the nominal rate at 100mbit); otherwise
    that message is queued behind the rank's own data (gloo's tcp pair writes its messages in order) and
    the directions partly serialize (about 0.6). ``best_link_Bps`` (size_bytes / the fastest repeat) is the overlapped figure.

    With ``ranks_per_node >= 2`` ranks 0 and 1 of node 0 do the same over the namespace's loopback, after
    the link pair and in the same job (one world of 3 processes, a gloo group per pair):
    ``measured_intra_node_Bps`` (and ``intra_node_median_s``, ``intra_node_times_s``).

    A worker that dies, or a probe not done within ``timeout_s``, raises ProbeError (one line)."""
    if cluster.nodes < 2:
        raise TopologyError(
            f"probe_link needs 2 or more nodes (the shaped link joins nodes), got {cluster.nodes}"
        )
    if size_bytes < 1 or repeats < 1:
        raise TopologyError(f"probe_link needs size_bytes >= 1 and repeats >= 1, got {size_bytes}, {repeats}")
    per_pair = _probe(cluster, size_bytes, repeats, timeout_s)
    times = per_pair["link"]
    result = {
        "measured_link_Bps": size_bytes / statistics.median(times),
        "best_link_Bps": size_bytes / min(times),
        "median_s": statistics.median(times),
        "times_s": times,
        "size_bytes": size_bytes,
        "link_rate_Bps": cluster.link_rate_Bps,
    }
    if "intra_node" in per_pair:
        intra = per_pair["intra_node"]
        result |= {
            "measured_intra_node_Bps": size_bytes / statistics.median(intra),
            "intra_node_median_s": statistics.median(intra),
            "intra_node_times_s": intra,
        }
    return result
