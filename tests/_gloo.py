"""Running a test's body on several gloo processes on this machine.

``launch(tmp, world, body, *args)`` spawns ``world`` processes; rank ``r`` joins a gloo
group (file store under ``tmp``), runs ``body(r, world, *args) -> dict``, saves the dict
to ``tmp/rank<r>.pt`` (with the traceback under ``"error"`` if it raised) and leaves the
group after a barrier.  ``launch`` returns the dicts in rank order, and fails the test
naming the rank and its traceback, or after ``timeout_s``.  ``body`` must be a
module-level function (spawned processes import it by name).
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


def _worker(rank, world, init_file, out_dir, body, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        results = body(rank, world, *args)
        # every rank done with its sends and receives before any closes its connections
        # (the barrier this module's docstring promised was missing; a rank tearing gloo
        # down while its peer still reads is the likely cause of the one abort seen,
        # "terminate called without an active exception", in a parallel suite run)
        dist.barrier()
    except BaseException:
        results = {"error": traceback.format_exc()}
        raise
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def launch(tmp: Path, world: int, body, *args, timeout_s: float = 300) -> list:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(world, str(tmp / "store"), str(tmp), body, args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=5):  # raises, with the rank's traceback, if a rank failed
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} gloo processes did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    out = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return out


def run_on_one_rank(tmp: Path, config):
    """``DistributedSimulation(config).run()`` in this process as the only rank of a gloo
    group (file store under ``tmp``); returns ``(simulation, results)``."""
    from fedopt_kernels.fl.run.distributed_simulation import DistributedSimulation

    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    try:
        sim = DistributedSimulation(config)
        return sim, sim.run()
    finally:
        dist.destroy_process_group()
