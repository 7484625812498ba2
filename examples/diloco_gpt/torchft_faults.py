"""fedopt_kernels' DiLoCo under torchft's Manager: a worker leaves, another joins late.

torchft (0.2.0) is not a dependency of fedopt_kernels.  Install it aside and run::

    pip install --no-deps --target /work/torchft-extra torchft==0.2.0
    pip install --target /work/torchft-deps opentelemetry-sdk opentelemetry-api \\
        opentelemetry-exporter-otlp-proto-http
    PYTHONPATH=/work/torchft-extra:/work/torchft-deps python examples/diloco_gpt/torchft_faults.py

A lighthouse on 127.0.0.1 and three replica groups of one gloo rank each (processes):
replica 0 trains 12 inner steps, replica 1 leaves after 4 steps (mid outer round), and
replica 2 joins 3 s late (torchft heals it: it loads a peer's DiLoCo.state_dict()).
Each prints its (step, seconds, participants, committed) per outer step; the survivors
must finish.
"""

import datetime
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn

H, STEPS = 3, 12


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def replica(rid, lighthouse, leave_at, delay, barrier):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    from fedopt_kernels.distributed import DiLoCo

    port = _free_port()
    store = TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)  # noqa: F841 - the replica group's store
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    box = {}
    seconds = datetime.timedelta(seconds=10)
    mgr = Manager(pg=ProcessGroupGloo(timeout=seconds), min_replica_size=1,
                  load_state_dict=lambda sd: box["diloco"].load_state_dict(sd),
                  state_dict=lambda: box["diloco"].state_dict(), replica_id=f"r{rid}", store_addr="127.0.0.1",
                  store_port=port, rank=0, world_size=1, lighthouse_addr=lighthouse, hostname="127.0.0.1",
                  use_async_quorum=False, timeout=seconds, quorum_timeout=seconds, connect_timeout=seconds)
    box["diloco"] = diloco = DiLoCo(model, inner, sync_every=H, manager=mgr)
    if barrier is not None:
        barrier.wait()
        time.sleep(0.5)  # every starting manager heartbeating before the first quorum
    time.sleep(delay)
    t0, log = time.time(), []
    while diloco.local_step < STEPS:
        t = diloco.local_step + 1
        if t == leave_at:
            print(f"replica {rid} leaves before step {t}", flush=True)
            os._exit(0)
        g = torch.Generator().manual_seed(1000 * rid + t)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        rec = diloco.step(tokens=4)
        if rec is not None:
            log.append((rec.step, round(time.time() - t0, 2), rec.participants, rec.committed))
    print(f"replica {rid} finished: (step, s, participants, committed) {log}", flush=True)
    mgr.shutdown()


def main():
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=20000)
    addr = "http://127.0.0.1:" + lh.address().rsplit(":", 1)[1]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=replica, args=(0, addr, 0, 0.0, barrier)),
             ctx.Process(target=replica, args=(1, addr, 5, 0.0, barrier)),
             ctx.Process(target=replica, args=(2, addr, 0, 3.0, None))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    print("exit codes", [p.exitcode for p in procs], flush=True)
    lh.shutdown()
    sys.exit(0 if all(p.exitcode == 0 for p in procs) else 1)


if __name__ == "__main__":
    main()
