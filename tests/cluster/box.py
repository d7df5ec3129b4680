"""The cluster in a box: pods as Linux network namespaces on a bridge in 198.18.0.0/16.

Each pod gets its own namespace (`r3c-<n>`), a veth into the test's bridge, its own address,
a hosts file (/etc/netns/NAME/hosts: its own name, every Service name -> pod IPs, as kubelet and
cluster DNS would give it), its own UTS namespace (hostname = pod name) and its own mount
namespace with the pod's volumes bind-mounted at their mountPaths. Nothing is routed off the
bridge: the host drops forwarding to and from it and any traffic from it to the host itself.
Everything created is recorded and removed by `close()` (processes by pid, then namespaces,
links, hosts files, mountpoints, nft tables), also after a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# What the pods run: this checkout and the Python environment (a venv, its base install), kept
# visible whatever volume a pod mounts over them (a clone under /tmp, an emptyDir at /tmp)
_PATHS = {Path(p).resolve() for p in (Path(__file__).parents[2], sys.prefix, sys.base_prefix)}
CODE = sorted(p for p in _PATHS if not any(q in p.parents for q in _PATHS))
PREFIX = "r3c"
BRIDGE = f"{PREFIX}-br"
SUBNET = "198.18.7"  # a /24 of the 198.18.0.0/15 benchmark range, never routed anywhere
HOST_TABLE = f"{PREFIX}_host"
# A pod's resolv.conf, as kubelet writes it for namespace r3flow, except that the cluster DNS is
# the hosts file: the nameserver is the pod's own loopback, where nothing listens, so a query
# for what the hosts file lacks is refused at once. With the host's nameserver inherited instead,
# resolvers that query DNS besides the hosts file (gRPC's c-ares: Ray's GCS clients) wait for
# answers the bridge drops and time out (Ray workers never reached the head's GCS that way).
RESOLV_CONF = ("search r3flow.svc.cluster.local svc.cluster.local cluster.local\n"
               "nameserver 127.0.0.1\noptions ndots:5 timeout:1 attempts:1\n")


def run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, text=True, capture_output=True, input=input)


def can_create_netns() -> str:
    """'' when this machine can create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "nft", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    probe = f"{PREFIX}-probe"
    r = run("ip", "netns", "add", probe, check=False)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return ""


@dataclass
class NsPod:
    name: str  # pod name (hostname)
    ns: str
    ip: str
    root: Path  # per-pod directory: volumes, logs
    procs: list[subprocess.Popen] = field(default_factory=list)


class Box:
    """Owns the bridge, the pod namespaces and every process started in them."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.pods: dict[str, NsPod] = {}
        self.mountpoints: list[Path] = []
        self._next = 2

    # ---------------------------------------------------------------- network
    def up(self) -> Box:
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")
        # Nothing leaves the bridge and the host itself is not reachable from it.
        run("nft", "-f", "-", input=f"""
table inet {HOST_TABLE} {{
  chain r3cfwd {{ type filter hook forward priority -10; policy accept;
    iifname "{BRIDGE}" oifname != "{BRIDGE}" drop
    oifname "{BRIDGE}" iifname != "{BRIDGE}" drop
  }}
  chain r3cin {{ type filter hook input priority -10; policy accept;
    iifname "{BRIDGE}" drop
  }}
}}""")
        return self

    def add_pod(self, name: str) -> NsPod:
        assert self._next < 255, "the box's /24 is used up"
        ns, ip = f"{PREFIX}-{self._next}", f"{SUBNET}.{self._next}"
        self._next += 1
        pod = self.pods[name] = NsPod(name, ns, ip, self.work / "pods" / name)
        pod.root.mkdir(parents=True, exist_ok=True)
        veth = _veth(ns)
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run("ip", "link", "set", veth, "master", BRIDGE, "up")
        run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", ns, "route", "add", "default", "via", f"{SUBNET}.1")
        return pod

    def write_hosts(self, names: dict[str, list[str]]) -> None:
        """Every pod's /etc/hosts: localhost, itself, and `names` (name -> IPs, first wins),
        and its /etc/resolv.conf (RESOLV_CONF)."""
        for pod in self.pods.values():
            lines = ["127.0.0.1 localhost", f"{pod.ip} {pod.name}"]
            lines += [f"{ips[0]} {n}" for n, ips in names.items() if ips]
            d = Path("/etc/netns") / pod.ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(lines) + "\n")
            (d / "resolv.conf").write_text(RESOLV_CONF)

    def enforce(self, pod: NsPod, rules: list[str] | None) -> None:
        """The pod's ingress NetworkPolicy as an nft input chain in its own namespace."""
        if rules is None:
            return
        body = "\n    ".join(rules)
        # replaced as a whole when pods come and go (a CNI updates its sets the same way)
        run("ip", "netns", "exec", pod.ns, "nft", "delete", "table", "inet", "r3np", check=False)
        run("ip", "netns", "exec", pod.ns, "nft", "-f", "-", input=f"""
table inet r3np {{
  chain podin {{ type filter hook input priority 0; policy accept;
    {body}
  }}
}}""")

    # ---------------------------------------------------------------- processes
    def start(self, pod: NsPod, argv: list[str], env: dict[str, str], mounts: dict[str, Path],
              log_name: str, workdir: str = "/") -> subprocess.Popen:
        """Run argv in the pod: its netns, hostname, mounts (mountPath -> host dir), env."""
        binds = []
        # A mount over an ancestor of the sources (an emptyDir at /tmp) would hide them: last.
        hides = lambda t: any(_under(src, t) for src in mounts.values())  # noqa: E731
        for target, src in sorted(mounts.items(), key=lambda kv: hides(kv[0])):
            if not Path(target).exists():  # a mountpoint the host lacks: made, removed at close
                Path(target).mkdir(parents=True)
                self.mountpoints.append(Path(target))
            # ... and over the code the pod runs (a checkout under /tmp): the code is bound into
            # the volume at its own path first, and the volume mounted with it (rbind)
            code = [c for c in CODE if _under(c, target)]
            for c in code:
                inner = sh_quote(str(Path(src) / c.relative_to(target)))
                binds += [f"mkdir -p {inner}", f"mount --bind {sh_quote(str(c))} {inner}"]
            flag = "--rbind" if code else "--bind"
            binds.append(f"mount {flag} {sh_quote(str(src))} {sh_quote(target)}")
        script = "; ".join([f"hostname {pod.name}", *binds,
                            f"cd {sh_quote(workdir)}", 'exec "$@"'])
        log = (pod.root / f"{log_name}.log").open("ab")
        p = subprocess.Popen(
            ["ip", "netns", "exec", pod.ns, "unshare", "--uts", "--mount", "--propagation",
             "private", "bash", "-c", script, "pod", *argv],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        pod.procs.append(p)
        return p

    def pids_in(self, pod: NsPod) -> list[int]:
        r = run("ip", "netns", "pids", pod.ns, check=False)
        return [int(x) for x in r.stdout.split()]

    def kill_pod(self, pod: NsPod, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every process in the pod's network namespace (by pid); returns the pids."""
        pids = self.pids_in(pod)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def exec(self, pod: NsPod, argv: list[str], timeout: float = 30,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", pod.ns, *argv], text=True,
                              capture_output=True, timeout=timeout, env=env)

    # ---------------------------------------------------------------- cleanup
    def terminate(self, pods: list[NsPod], grace_s: float) -> None:
        """SIGTERM to every process of the pods at once, then up to `grace_s` for them to exit
        (kubelet's termination grace period; the pods of a deleted RayCluster go together)."""
        for pod in pods:
            self.kill_pod(pod, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(self.pids_in(p) for p in pods) and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop_pod(self, pod: NsPod, grace_s: float = 0.0) -> None:
        """Every process of the pod gone: SIGTERM and `grace_s` to exit when given (see
        terminate), then SIGKILL by pid (process groups started here, then whatever is left in
        the namespace: Ray daemons re-parent)."""
        if grace_s:
            self.terminate([pod], grace_s)
        for p in pod.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for _ in range(3):
            if not self.kill_pod(pod):
                break
            time.sleep(0.2)
        for p in pod.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def remove_pod(self, name: str, grace_s: float = 0.0) -> NsPod:
        """The pod deleted: its processes stopped, its namespace, veth and hosts file removed
        (its address is never given to another pod)."""
        pod = self.pods.pop(name)
        self.stop_pod(pod, grace_s)
        run("ip", "netns", "del", pod.ns, check=False)
        run("ip", "link", "del", _veth(pod.ns), check=False)  # if a holder kept the ns
        shutil.rmtree(Path("/etc/netns") / pod.ns, ignore_errors=True)
        return pod

    def close(self) -> None:
        for name in list(self.pods):
            self.remove_pod(name)
        run("ip", "link", "del", BRIDGE, check=False)
        run("nft", "delete", "table", "inet", HOST_TABLE, check=False)
        for m in reversed(self.mountpoints):
            try:
                m.rmdir()
            except OSError:
                pass


def _veth(ns: str) -> str:
    return f"{PREFIX}v{ns.split('-')[1]}"


def sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def leftovers() -> list[str]:
    """Names this test creates that exist now (a crashed earlier run): removed first."""
    out = [n for n in run("ip", "netns", "list", check=False).stdout.split()
           if n.startswith(f"{PREFIX}-")]
    out += [line.split("@")[0].split()[0] for line in
            run("ip", "-br", "link", check=False).stdout.splitlines()
            if line.startswith((BRIDGE, f"{PREFIX}v"))]
    return out


def clean_leftovers() -> None:
    for name in leftovers():
        if name == BRIDGE or name.startswith(f"{PREFIX}v"):
            run("ip", "link", "del", name, check=False)
            continue
        for pid in run("ip", "netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        run("ip", "netns", "del", name, check=False)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    run("nft", "delete", "table", "inet", HOST_TABLE, check=False)


def _under(path: Path | str, target: str) -> bool:
    """`path` lies strictly below the directory `target`."""
    return str(path).startswith(target.rstrip("/") + "/")
