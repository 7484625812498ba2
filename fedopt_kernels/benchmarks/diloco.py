"""DiLoCo against DDP at equal tokens: a character-level GPT on the standard library's source.

``fedopt bench --only diloco`` (or ``python -m fedopt_kernels.benchmarks.diloco``) trains
:class:`~.char_gpt.CharGPT` on ``world`` gloo worker processes (one thread each, this
machine's CPU), once per method, the same initial model, data and seeds:

* ``ddp``: DistributedDataParallel, gradients all-reduced every step;
* ``diloco-H``: :class:`~fedopt_kernels.distributed.DiLoCo` syncing every ``H`` steps
  (outer Nesterov 0.7 / 0.9);
* ``streaming-H``: :class:`~fedopt_kernels.distributed.StreamingDiLoCo`, 2 fragments,
  overlap 5 steps, alpha 0.5;
* ``streaming-int4-H``: the same with the quantized exchange (``codec="int4"``, blocks of
  256: the paper's 4-bit values, all-gathered);
* ``torchft-diloco-50`` (only when named, torchft installed): torchft 0.2.0's own
  ``local_sgd.DiLoCo`` under its ``Manager`` (a lighthouse on 127.0.0.1, one gloo
  replica group per worker), the outer step ``torch.optim.SGD(lr 0.7, momentum 0.9,
  nesterov)``: the same model, data and seeds.

Every worker takes the same number of inner AdamW steps on batches of its own (equal
tokens).  Reported per method: the validation loss of rank 0's model every
``eval_every`` steps (held-out 10% of the corpus, fixed batches), the bytes each worker
put on the wire (all-reduce payloads; a ring all-reduce moves about twice that), the
median time of an inner step without a sync, and the time spent in the syncs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

METHODS = ("ddp", "diloco-50", "diloco-100", "streaming-100", "streaming-int4-100")
TORCHFT_METHODS = ("torchft-diloco-50",)  # torchft's own DiLoCo (when torchft is importable)


def _torchft_loop(rank, model, inner, H, lighthouse):
    """torchft's DiLoCo (entered as a context manager) and its manager, for one replica."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    store = TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    sec = timedelta(seconds=60)
    # init_sync=False: with torchft's default (True) the first quorum -- at the first sync,
    # after H inner steps -- heals replica 1 from replica 0's state_dict, i.e. overwrites its
    # TRAINED parameters with replica 0's before the outer gradient is formed (measured:
    # 4.383 against 4.499 after 50 steps); every replica starts equal here anyway (one seed)
    mgr = Manager(pg=ProcessGroupGloo(timeout=sec), min_replica_size=1, load_state_dict=model.load_state_dict,
                  state_dict=model.state_dict, replica_id=f"r{rank}", store_addr="127.0.0.1", store_port=port,
                  rank=0, world_size=1, lighthouse_addr=lighthouse, hostname="127.0.0.1", use_async_quorum=False,
                  timeout=sec, quorum_timeout=sec, connect_timeout=sec, init_sync=False)
    loop = TorchftDiLoCo(mgr, [model], inner, outer, sync_every=H)
    loop.__enter__()
    return loop, mgr, store


def _worker(rank, world, store, out_dir, method, preset, steps, batch, lr, eval_every, seed, lighthouse=None,
            barrier=False):
    import torch.distributed as dist
    from torch import nn

    from ..distributed import DiLoCo, StreamingDiLoCo
    from .char_gpt import PRESETS, CharGPT, sample_batch, stdlib_corpus

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    cfg = PRESETS[preset]
    train, val = stdlib_corpus()
    torch.manual_seed(seed)
    model = CharGPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    net = nn.parallel.DistributedDataParallel(model) if method == "ddp" else model
    inner = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    loop = tft = None
    if method.startswith("torchft-"):
        tft = _torchft_loop(rank, model, inner, int(method.split("-")[-1]), lighthouse)
    elif method.startswith("diloco-"):
        loop = DiLoCo(model, inner, sync_every=int(method.split("-")[1]), mode="all_reduce")
    elif method.startswith("streaming-"):
        codec = "int4" if "-int4-" in method else None
        loop = StreamingDiLoCo(model, inner, fragments=2, sync_every=int(method.split("-")[-1]), overlap=5,
                               codec=codec)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    gv = torch.Generator().manual_seed(12345)
    val_batches = [sample_batch(val, batch, cfg.block_size, gv) for _ in range(8)]
    step_s, sync_s, curve, sent = [], 0.0, [], 0

    def evaluate():
        with torch.no_grad():
            return statistics.fmean(float(model(x, y)) for x, y in val_batches)

    curve.append((0, evaluate()))
    for t in range(1, steps + 1):
        x, y = sample_batch(train, batch, cfg.block_size, g)
        t0 = time.perf_counter()
        inner.zero_grad(set_to_none=True)
        net(x, y).backward()
        H = int(method.split("-")[-1]) if "diloco" in method else 0
        if barrier and H and t % H == 0:  # time the sync alone, not the wait for the slower worker
            tb = time.perf_counter()
            dist.barrier()
            t0 += time.perf_counter() - tb  # the barrier's wait counts neither in the step nor in the sync
        if tft is not None:  # torchft's outer step runs in a hook of inner.step()
            t1 = time.perf_counter()
            inner.step()
            if t % int(method.split("-")[-1]) == 0:
                sent += numel * 4
                sync_s += time.perf_counter() - t1
                step_s.append(t1 - t0)
            else:
                step_s.append(time.perf_counter() - t0)
        elif loop is None:
            inner.step()
            sent += numel * 4  # DDP's gradient all-reduce (fp32) every step
            step_s.append(time.perf_counter() - t0)
        else:
            t1 = time.perf_counter()
            rec = loop.step(tokens=batch * cfg.block_size)
            t2 = time.perf_counter()
            if method.startswith("diloco") and rec is not None:
                sent += rec.payload_bytes
                sync_s += t2 - t1
                step_s.append(t1 - t0)
            elif method.startswith("streaming") and (rec.sent or rec.applied):
                sent += sum(s.payload_bytes for s in rec.sent)
                sync_s += t2 - t1
                step_s.append(t1 - t0)
            else:
                step_s.append(t2 - t0)
        if t % eval_every == 0 and rank == 0:
            curve.append((t, evaluate()))
    if isinstance(loop, StreamingDiLoCo):
        loop.finish()
    if tft is not None:
        tft[0].__exit__(None, None, None)
        tft[1].shutdown()
    dist.barrier()
    torch.save({"curve": curve, "bytes": sent, "step_ms": 1e3 * statistics.median(step_s), "sync_s": sync_s,
                "numel": numel, "tokens": steps * batch * cfg.block_size},
               os.path.join(out_dir, f"{method}-rank{rank}.pt"))
    dist.destroy_process_group()


def run(*, methods: Sequence[str] = METHODS, preset: str = "tiny", steps: int = 300, batch: int = 16,
        lr: float = 2e-3, world: int = 2, eval_every: int = 50, seed: int = 0,
        barrier_before_sync: bool = False) -> List[dict]:
    """One row per method (module docstring); each method in fresh worker processes."""
    import torch.multiprocessing as mp

    rows = []
    for method in methods:
        if method not in METHODS + TORCHFT_METHODS:
            raise ValueError(f"method must be one of {METHODS + TORCHFT_METHODS}, got {method!r}")
        lighthouse = server = None
        if method in TORCHFT_METHODS:  # its lighthouse here, on loopback; the first quorum waits for all
            from torchft._torchft import LighthouseServer

            server = LighthouseServer(bind="127.0.0.1:0", min_replicas=world, join_timeout_ms=60000)
            lighthouse = "http://127.0.0.1:" + server.address().rsplit(":", 1)[1]
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            try:
                mp.start_processes(_worker, args=(world, str(Path(tmp) / "store"), tmp, method, preset, steps, batch,
                                                  lr, eval_every, seed, lighthouse, barrier_before_sync), nprocs=world,
                                   join=True,
                                   start_method="spawn")
            finally:
                if server is not None:
                    server.shutdown()
            wall = time.perf_counter() - t0
            res = [torch.load(Path(tmp) / f"{method}-rank{r}.pt") for r in range(world)]
        r0 = res[0]
        rows.append({"benchmark": "diloco", "case": method, "preset": preset, "params": r0["numel"],
                     "workers": world, "tokens_per_worker": r0["tokens"], "final_val_loss": r0["curve"][-1][1],
                     "val_curve": r0["curve"], "MB_sent_per_worker": r0["bytes"] / 1e6,
                     "inner_step_ms": statistics.fmean(r["step_ms"] for r in res),
                     "sync_s": statistics.fmean(r["sync_s"] for r in res), "wall_s": wall})
    return rows


def format_table(rows: List[dict]) -> str:
    head = ["method", "val loss @ steps", "final val loss", "MB sent / worker", "inner step ms", "sync s", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        curve = " ".join(f"{loss:.3f}" for _, loss in r["val_curve"])
        lines.append(f"| {r['case']} | {curve} | {r['final_val_loss']:.3f} | {r['MB_sent_per_worker']:.1f} | "
                     f"{r['inner_step_ms']:.0f} | {r['sync_s']:.2f} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + TORCHFT_METHODS)
    p.add_argument("--preset", default="tiny", choices=("tiny", "10m"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--barrier-before-sync", action="store_true",
                   help="DiLoCo methods: a barrier before each sync, so that 'sync s' excludes waiting for the slower worker")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = run(methods=args.methods, preset=args.preset, steps=args.steps, batch=args.batch,
               eval_every=args.eval_every, barrier_before_sync=args.barrier_before_sync)
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
