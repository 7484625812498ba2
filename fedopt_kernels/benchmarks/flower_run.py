"""Whole runs side by side: a Flower 1.41 simulation (Ray backend) vs ``fedopt simulate``.

The same workload twice, in the same session, one after the other:

* ``flower``: ``flwr run examples/flower_app`` on a local ``flower-superlink
  --simulation`` (:func:`start_superlink`: Flower's simulation runtime, whose default
  backend is Ray; one SuperNode per client, ``--federation-config
  "num-supernodes=C"``), the app's fused ``FedAvg`` server and FedNAR (``nar = co``)
  clients, Flower's own node sampling (``fraction-train = P / C``: ``P`` nodes a round),
  Flower's default client resources (2 CPUs per client: as many Ray actors training
  clients at once as the machine has CPUs / 2; ``--client-cpus`` changes it);
* ``fedopt``: ``python -m fedopt_kernels simulate`` as a subprocess with the same
  settings (default engine: batched).

Same data (scikit-learn digits, the simulator's 80/20 split), same label-Dirichlet
partition (``alpha``, ``seed``), same MLP (two hidden layers of ``hidden``) and initial
values, ``P`` of ``C`` clients a round, the same local steps, batch size, lr, lr decay,
weight decay and max norm (every one passed explicitly to both), evaluation of the
whole test set after every round.  The two sample *different* clients each round
(Flower draws the nodes with Python's unseeded ``random.sample``), so their accuracies
agree only roughly unless ``P = C``; with ``P = C`` and ``--engine sequential`` they
are bit for bit equal (``tests/test_flower_run_bench.py``).  The sampling is checked:
Flower's log must say ``Sampled P nodes (out of C)`` every round, and every simulator
record must list ``P`` clients.

Reported per side: the whole run (``flwr run`` / ``fedopt simulate`` process start to
exit: start-up, data, every round, shutdown; the SuperLink, a long-lived service, is
started before and timed on its own), the first, median and mean round (from the per-round
``wall_time`` both write: the end of a round's evaluation minus the end of the
previous one's; Flower's from the app's ``history.json``), and the final test
accuracy.  Run ``python -m fedopt_kernels.benchmarks.flower_run [--json FILE]``.

The SuperLink helpers here (:func:`start_superlink`, :class:`SuperLink`) are also what
``tests/test_flower.py`` runs its real Flower simulation on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "examples" / "flower_app"

# The workload (FedNAR's digits recipe, as fedopt simulate's defaults).
WORKLOAD = dict(clients=100, per_round=20, rounds=30, local_steps=20, hidden=200, batch_size=32, lr=0.05,
                lr_decay=0.998, weight_decay=1e-3, max_norm=10.0, alpha=0.3, seed=0)

# --------------------------------------------------------------------------- a local SuperLink
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class SuperLinkError(RuntimeError):
    """The local SuperLink could not be started (the message holds its log's tail)."""


def free_port() -> int:
    """A port the OS had free a moment ago.  Another process may take it before the
    SuperLink binds it: :func:`start_superlink` retries with a fresh port when that happens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(env: dict) -> dict:
    """``env`` with loopback exempt from any proxy: gRPC and urllib honour
    ``http_proxy``/``https_proxy``/``all_proxy``, and a developer's proxy cannot reach
    this machine's 127.0.0.1."""
    env = dict(env)
    for key in ("no_proxy", "NO_PROXY"):
        have = [h for h in env.get(key, "").split(",") if h]
        env[key] = ",".join(have + [h for h in LOOPBACK if h not in have])
    return env


# urllib without proxies, whatever the environment says (the health check is loopback only).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# A TLS SuperLink answers /health over HTTPS.  The check asks only whether our own
# loopback process is up, not whether to trust it (the SuperNodes and ``flwr`` verify
# its certificate with the CA they are given): no verification here, so a SuperLink
# with a certificate the tests made expired still reports that it is up.
_UNVERIFIED = ssl.create_default_context()
_UNVERIFIED.check_hostname = False
_UNVERIFIED.verify_mode = ssl.CERT_NONE
_DIRECT_TLS = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                          urllib.request.HTTPSHandler(context=_UNVERIFIED))


def healthy(port: int, tls: bool = False) -> bool:
    """True if a server on 127.0.0.1:``port`` answers ``/health`` with 200 (over HTTPS
    when ``tls``)."""
    opener, scheme = (_DIRECT_TLS, "https") if tls else (_DIRECT, "http")
    try:
        with opener.open(f"{scheme}://127.0.0.1:{port}/health", timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60.0, tls: bool = False) -> bool:
    """True once the SuperLink answers on ``port``; False if it exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if healthy(port, tls):
            return True
        time.sleep(0.3)
    raise TimeoutError(f"flower-superlink did not become healthy in {timeout:.0f} s")


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` (SIGTERM, then SIGKILL after 20 s) and reap it."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@dataclass(frozen=True)
class Security:
    """How a deployment is secured (``None`` for a deployment: ``--insecure``, for a local
    try only).

    * TLS: the SuperLink serves its certificate ``cert`` (key ``key``); SuperNodes and
      ``flwr`` verify it against ``ca_cert``, the root certificate they are given, and
      refuse a SuperLink they cannot verify (another CA, an expired certificate);
    * ``node_auth``: the SuperLink runs with ``--enable-supernode-auth`` and admits only
      SuperNodes whose public key was registered (``flwr supernode register``,
      :func:`register_supernode`); each SuperNode signs in with its private key.

    Flower's own flags, as its "Enable TLS connections" and "Authenticate SuperNodes"
    guides use them; :mod:`.pki` makes throwaway certificates and keys for loopback."""

    ca_cert: Path
    cert: Path
    key: Path
    node_auth: bool = True

    def superlink_args(self) -> List[str]:
        args = ["--ssl-ca-certfile", str(self.ca_cert), "--ssl-certfile", str(self.cert),
                "--ssl-keyfile", str(self.key)]
        return args + (["--enable-supernode-auth"] if self.node_auth else [])


@dataclass
class SuperLink:
    """A running local SuperLink: ``flwr run <app> <connection>`` with :attr:`env` runs on it."""

    proc: subprocess.Popen
    port: int
    env: Dict[str, str]  # the environment to run ``flwr`` in (FLWR_HOME, offline, no proxy on loopback)
    flwr: str  # the ``flwr`` executable
    home: Path  # FLWR_HOME
    log: Path  # the SuperLink's stdout and stderr
    connection: str = "test"  # the connection name in FLWR_HOME/config.toml
    start_s: float = 0.0  # seconds from launch to healthy
    security: Optional[Security] = None  # None: --insecure

    def stop(self) -> None:
        """Stop the SuperLink (and the SuperExec it spawned)."""
        stop_process(self.proc)


def _console_script(name: str) -> Optional[str]:
    bindir = Path(sys.executable).parent
    return shutil.which(name, path=str(bindir)) or shutil.which(name)


def start_superlink(workdir, *, connection: str = "test", tries: int = 3, timeout: float = 60.0,
                    simulation: bool = True, security: Optional[Security] = None) -> SuperLink:
    """Start our own local SuperLink in simulation mode (Ray runtime; ``simulation=False``:
    deployment mode, for SuperNodes started apart, :func:`start_supernodes`), offline, in
    ``workdir``: a fresh FLWR_HOME there with one connection, ``connection``, no
    telemetry, no runtime dependency installation, no update check, loopback exempt from
    proxies, this checkout on ``PYTHONPATH`` (the app's processes import
    fedopt_kernels from it).  If its port was taken between choosing and binding it, it
    starts again on another (``tries`` times).  ``security``: TLS and SuperNode
    authentication (:class:`Security`; ``flwr`` then verifies the SuperLink with its CA);
    None runs it ``--insecure``.  Raises :class:`SuperLinkError`."""
    if simulation and importlib.util.find_spec("ray") is None:
        raise SuperLinkError("Flower's simulation runtime needs Ray: pip install 'flwr[simulation]'")
    flwr_exe, superlink_exe = _console_script("flwr"), _console_script("flower-superlink")
    if not (flwr_exe and superlink_exe):
        raise SuperLinkError("flwr's console scripts (flwr, flower-superlink) are not on PATH")
    workdir = Path(workdir)
    home = workdir / "flwr_home"
    home.mkdir(parents=True, exist_ok=True)
    env = loopback_env(os.environ)
    env.update(FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
               FLWR_DISABLE_UPDATE_CHECK="1", PYTHONPATH=os.pathsep.join(
                   p for p in [str(REPO), env.get("PYTHONPATH", "")] if p),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    log = workdir / "superlink.log"
    for attempt in range(tries):
        port = free_port()
        trust = (f'root-certificates = "{security.ca_cert}"' if security else "insecure = true")
        (home / "config.toml").write_text(f'[superlink]\ndefault = "{connection}"\n\n[superlink.{connection}]\n'
                                          f'address = "127.0.0.1:{port}"\n{trust}\n')
        t0 = time.perf_counter()
        with open(log, "w") as fh:
            cmd = [superlink_exe, *(security.superlink_args() if security else ["--insecure"]),
                   *(["--simulation"] if simulation else []),
                   "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port)]
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                    start_new_session=True)
        try:
            up = wait_healthy(port, proc, timeout, tls=security is not None)
        except TimeoutError as e:
            stop_process(proc)
            raise SuperLinkError(f"{e}:\n{log.read_text()[-3000:]}") from None
        if up:
            return SuperLink(proc, port, env, flwr_exe, home, log, connection, time.perf_counter() - t0, security)
        text = log.read_text()
        if "in use" not in text.lower() or attempt == tries - 1:
            raise SuperLinkError(f"flower-superlink exited with {proc.returncode}:\n{text[-3000:]}")
    raise AssertionError("unreachable")


def register_supernode(link: SuperLink, public_key) -> int:
    """``flwr supernode register PUBLIC_KEY`` on ``link`` (a SuperLink with SuperNode
    authentication): the federation admits the SuperNode that holds the private key.
    Returns the node id the SuperLink assigned."""
    proc = subprocess.run([link.flwr, "supernode", "register", str(public_key), link.connection, "--format", "json"],
                          capture_output=True, text=True, env=link.env, timeout=120)
    found = re.search(r'"node-id":\s*"?(\d+)', proc.stdout)
    if proc.returncode != 0 or found is None:
        raise SuperLinkError(f"flwr supernode register {public_key} failed (rc={proc.returncode}): "
                             f"{(proc.stdout + proc.stderr)[-2000:]}")
    return int(found.group(1))


def supernode_command(link: SuperLink, node_config: str, *, root_certificates="link", private_key=None) -> List[str]:
    """The ``flower-supernode`` command line of one SuperNode on ``link``: ``--insecure``
    on an insecure SuperLink; on a TLS one ``--root-certificates`` (``"link"``: the CA of
    the link's :class:`Security`; None: no CA, so the system's, which cannot verify a
    private CA) and, with ``private_key``, ``--auth-supernode-private-key``."""
    exe = _console_script("flower-supernode")
    if exe is None:
        raise SuperLinkError("flwr's console script flower-supernode is not on PATH")
    if link.security is None:
        trust = ["--insecure"]
    else:
        ca = link.security.ca_cert if root_certificates == "link" else root_certificates
        trust = ["--root-certificates", str(ca)] if ca else []
    auth = ["--auth-supernode-private-key", str(private_key)] if private_key else []
    return [exe, *trust, *auth, "--superlink", f"127.0.0.1:{link.port}", "--host", "127.0.0.1",
            "--port", str(free_port()), "--node-config", node_config]


def start_supernodes(link: SuperLink, count: int, workdir, node_config: Optional[Dict[int, str]] = None,
                     private_keys: Optional[List[Path]] = None) -> List[subprocess.Popen]:
    """Start ``count`` SuperNodes (Flower's deployment mode: one process each, on
    loopback) connected to ``link``, node ``i`` with ``partition-id=i
    num-partitions=count`` (and ``node_config[i]``, more ``key=value`` entries, e.g. the
    example app's ``fault="die@2"``); each logs to ``workdir/supernode<i>.log``.  On a
    secure link each verifies it with the link's CA and, with ``private_keys``, signs
    in with ``private_keys[i]`` (registered with :func:`register_supernode`).  Stop
    them with :func:`stop_process`."""
    workdir = Path(workdir)
    nodes = []
    try:
        for i in range(count):
            config = " ".join([f"partition-id={i} num-partitions={count}", (node_config or {}).get(i, "")]).strip()
            cmd = supernode_command(link, config, private_key=private_keys[i] if private_keys else None)
            with open(workdir / f"supernode{i}.log", "w") as fh:
                nodes.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=link.env, cwd=workdir,
                                              start_new_session=True))
    except BaseException:
        for proc in nodes:
            stop_process(proc)
        raise
    return nodes


# --------------------------------------------------------------------------- the two runs
@dataclass
class RunResult:
    """One side's run: whole-run seconds, per-round seconds, per-round test accuracy."""

    name: str
    wall_s: float  # process start to exit
    round_s: List[float]  # rounds 1..R
    accuracy: List[float]  # rounds 0..R
    sampled: List[int]  # clients trained in rounds 1..R
    extra: dict = field(default_factory=dict)

    @property
    def median_round_ms(self) -> float:
        return statistics.median(self.round_s) * 1e3

    @property
    def mean_round_ms(self) -> float:
        return statistics.fmean(self.round_s) * 1e3

    def row(self) -> dict:
        return {"run": self.name, "whole run s": self.wall_s, "first round ms": self.round_s[0] * 1e3,
                "median round ms": self.median_round_ms,
                "mean round ms": self.mean_round_ms, "rounds s": sum(self.round_s),
                "final accuracy": self.accuracy[-1], "rounds": len(self.round_s), **self.extra}


def _round_times(cumulative: List[float]) -> List[float]:
    """Per-round seconds from the cumulative ``wall_time`` of rounds 0..R."""
    return [b - a for a, b in zip(cumulative, cumulative[1:])]


def fraction_train(clients: int, per_round: int) -> float:
    """The ``fraction-train`` for which Flower's ``FedAvg`` samples exactly ``per_round``
    of ``clients`` nodes (it takes ``int(clients * fraction)``, and at least its
    ``min_train_nodes``, 2)."""
    if not 2 <= per_round <= clients:
        raise ValueError(f"Flower's FedAvg samples 2 to {clients} nodes (min_train_nodes = 2), not {per_round}")
    f = per_round / clients
    while int(clients * f) < per_round:
        f = math.nextafter(f, math.inf)
    return f


SAMPLED = re.compile(r"configure_train: Sampled (\d+) nodes \(out of (\d+)\)")


def run_flower(link: SuperLink, out, *, clients: int, per_round: int, rounds: int, local_steps: int, hidden: int,
               batch_size: int, lr: float, lr_decay: float, weight_decay: float, max_norm: float, alpha: float,
               seed: int, app=APP, client_cpus: Optional[int] = None, timeout: float = 3600.0,
               deployment: bool = False) -> RunResult:
    """``flwr run app <connection> --stream`` of the workload on ``link``; the app writes
    ``history.json`` and ``final_model.pt`` to ``out``.  ``deployment``: ``link`` is a
    deployment SuperLink whose SuperNodes (:func:`start_supernodes`) are the clients, so
    no simulated federation is configured."""
    out = Path(out)
    run_config = (f"algo='fedavg' nar='co' num-server-rounds={rounds} fraction-train={fraction_train(clients, per_round)!r} "
                  f"local-steps={local_steps} batch-size={batch_size} local-lr={float(lr)!r} "
                  f"lr-decay={float(lr_decay)!r} weight-decay={float(weight_decay)!r} max-norm={float(max_norm)!r} "
                  f"hidden={hidden} alpha={float(alpha)!r} seed={seed} weighting='auto' save-path='{out}'")
    federation = f"num-supernodes={clients} backend='ray'"
    if client_cpus is not None:
        federation += f" client-resources-num-cpus={int(client_cpus)}"
    cmd = [link.flwr, "run", str(app), link.connection, "--stream", "--run-config", run_config]
    if not deployment:
        cmd += ["--federation-config", federation]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=link.env, cwd=out.parent, timeout=timeout)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    (out.parent / f"{out.name}.log").write_text(log)
    history_path = out / "history.json"
    if proc.returncode != 0 or not history_path.exists() or "Strategy execution finished" not in log:
        raise RuntimeError(f"the Flower run failed (rc={proc.returncode}):\n{log[-4000:]}")
    history = json.loads(history_path.read_text())
    sampled = [int(n) for n, total in SAMPLED.findall(log) if int(total) == clients]
    name = "Flower (deployment)" if deployment else "Flower (Ray simulation)"
    security = link.security
    return RunResult(name, wall, _round_times([h["wall_time"] for h in history]),
                     [h["test_accuracy"] for h in history], sampled,
                     {"security": "insecure" if security is None else
                      "tls+node-auth" if security.node_auth else "tls"})


def run_fedopt(out, *, clients: int, per_round: int, rounds: int, local_steps: int, hidden: int, batch_size: int,
               lr: float, lr_decay: float, weight_decay: float, max_norm: float, alpha: float, seed: int,
               engine: str = "auto", timeout: float = 3600.0) -> RunResult:
    """``python -m fedopt_kernels simulate`` of the workload, writing to ``out``."""
    out = Path(out)
    cmd = [sys.executable, "-m", "fedopt_kernels", "simulate", "--algo", "fedavg", "--nar", "co",
           "--dataset", "digits", "--model", "mlp", "--hidden", f"{hidden},{hidden}", "--clients", str(clients),
           "--per-round", str(per_round), "--rounds", str(rounds), "--partition", "dirichlet", "--alpha", repr(alpha),
           "--weighting", "auto", "--local-steps", str(local_steps), "--batch-size", str(batch_size),
           "--lr", repr(lr), "--lr-decay", repr(lr_decay), "--weight-decay", repr(weight_decay),
           "--max-norm", repr(max_norm), "--seed", str(seed), "--eval-every", "1", "--engine", engine,
           "--out", str(out), "--no-plots", "--quiet"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out.parent, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not (out / "results.json").exists():
        raise RuntimeError(f"fedopt simulate failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    res = json.loads((out / "results.json").read_text())
    records = res["records"]
    return RunResult(f"fedopt simulate ({res['meta']['engine']} engine)", wall,
                     _round_times([r["wall_time"] for r in records]), [r["test_accuracy"] for r in records],
                     [len(r["clients"]) for r in records[1:]],
                     {"engine": res["meta"]["engine"], "threads": res["meta"]["threads"]})


def compare(*, workdir=None, engine: str = "auto", client_cpus: Optional[int] = None, repeats: int = 1,
            app=APP, **workload) -> dict:
    """Both runs of the workload (:data:`WORKLOAD` updated by ``workload``), ``repeats``
    times each, alternating (Flower first); returns ``{"workload", "superlink_start_s",
    "flower": [RunResult], "fedopt": [RunResult], "rows"}`` (rows: the median run of
    each side by whole-run time, then the ratio flower / fedopt).  Checks that both
    trained ``per_round`` clients in every one of ``rounds`` rounds."""
    w = {**WORKLOAD, **workload}
    unknown = set(w) - set(WORKLOAD)
    if unknown:
        raise TypeError(f"unknown workload settings: {sorted(unknown)}")
    fraction_train(w["clients"], w["per_round"])  # Flower can sample it (fails early if not)
    with tempfile.TemporaryDirectory(prefix="flower_run_") as tmp:
        workdir = Path(workdir) if workdir is not None else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        link = start_superlink(workdir)
        runs: Dict[str, List[RunResult]] = {"flower": [], "fedopt": []}
        try:
            for i in range(repeats):
                runs["flower"].append(run_flower(link, workdir / f"flower_{i}", app=app, client_cpus=client_cpus, **w))
                runs["fedopt"].append(run_fedopt(workdir / f"fedopt_{i}", engine=engine, **w))
        finally:
            link.stop()
    for side, results in runs.items():
        for r in results:
            if len(r.round_s) != w["rounds"] or r.sampled != [w["per_round"]] * w["rounds"]:
                raise RuntimeError(f"{r.name}: expected {w['rounds']} rounds of {w['per_round']} clients, got "
                                   f"{len(r.round_s)} rounds, clients per round {r.sampled}")
    median = {side: sorted(rs, key=lambda r: r.wall_s)[(len(rs) - 1) // 2] for side, rs in runs.items()}
    fl, fo = median["flower"], median["fedopt"]
    rows = [fl.row(), fo.row(), {"run": "ratio flower / fedopt", "whole run s": fl.wall_s / fo.wall_s,
                                 "first round ms": fl.round_s[0] / fo.round_s[0],
                                 "median round ms": fl.median_round_ms / fo.median_round_ms,
                                 "mean round ms": fl.mean_round_ms / fo.mean_round_ms,
                                 "rounds s": sum(fl.round_s) / sum(fo.round_s)}]
    return {"workload": w, "engine": engine, "client_cpus": client_cpus, "superlink_start_s": link.start_s,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count(), "repeats": repeats,
            "flower": runs["flower"], "fedopt": runs["fedopt"], "rows": rows}


def format_table(result: dict) -> List[str]:
    """Markdown lines of :func:`compare`'s rows."""
    lines = ["| run | whole run | first round | median round | mean round | final test accuracy |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["run"].startswith("ratio"):
            lines.append(f"| {r['run']} | {r['whole run s']:.2f}x | {r['first round ms']:.2f}x | "
                         f"{r['median round ms']:.2f}x | {r['mean round ms']:.2f}x | |")
        else:
            lines.append(f"| {r['run']} | {r['whole run s']:.1f} s | {r['first round ms']:.0f} ms | "
                         f"{r['median round ms']:.0f} ms | {r['mean round ms']:.0f} ms | "
                         f"{100 * r['final accuracy']:.2f}% |")
    return lines


def _jsonable(result: dict) -> dict:
    out = {k: v for k, v in result.items() if k not in ("flower", "fedopt")}
    for side in ("flower", "fedopt"):
        out[side] = [{"name": r.name, "wall_s": r.wall_s, "round_s": r.round_s, "accuracy": r.accuracy,
                      "sampled": r.sampled, **r.extra} for r in result[side]]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, value in WORKLOAD.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value,
                            help=f"(default {value}; hidden: the width of both MLP layers)" if key == "hidden"
                            else f"(default {value})")
    parser.add_argument("--engine", default="auto", help="fedopt simulate's --engine (default auto: batched)")
    parser.add_argument("--client-cpus", type=int, default=None,
                        help="Flower's client-resources-num-cpus (default: Flower's, 2 CPUs per client)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating (default 1)")
    parser.add_argument("--app", default=str(APP), help=f"the Flower app (default {APP})")
    parser.add_argument("--workdir", default=None, help="keep the runs' outputs and logs here (default: a temp dir)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)
    workload = {k: getattr(args, k) for k in WORKLOAD}
    result = compare(workdir=args.workdir, engine=args.engine, client_cpus=args.client_cpus, repeats=args.repeats,
                     app=args.app, **workload)
    w = result["workload"]
    print(f"{w['clients']} clients, {w['per_round']} per round, {w['rounds']} rounds, {w['local_steps']} local steps, "
          f"MLP {w['hidden']}x{w['hidden']}, digits, FedAvg + FedNAR (co); {result['cpus']} CPUs, "
          f"OMP_NUM_THREADS={result['omp_num_threads'] or 'unset'}; Flower client-resources-num-cpus "
          f"{result['client_cpus'] or 'default (2)'}; SuperLink start {result['superlink_start_s']:.1f} s "
          "(not in the whole run)")
    for line in format_table(result):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_jsonable(result), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
