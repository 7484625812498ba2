"""Server-side aggregation time in Flower: the fused strategies vs Flower's own.

One round's ``aggregate_train`` on the SAME ``C`` client replies (Flower
``Message``s holding one ``ArrayRecord`` and ``num-examples`` each), timed interleaved
(medians, same run):

* ``flwr FedAvg`` / ``flwr FedAdam``: ``flwr.serverapp.strategy.FedAvg`` / ``FedAdam``
  (per array and client: ``Array.numpy()``, ``value * weight``, ``+=``; FedAdam then
  its NumPy Adam step per array);
* ``fused FedAvg`` / ``fused FedAdam``: :mod:`fedopt_kernels.integrations.flower`'s
  default: the replies' arrays read in place (one fused aggregation over a clients x
  arrays pointer table, ``x_global - x_i`` computed as it reads), the server
  optimizer, the new ``ArrayRecord``;
* ``fused ..., copying``: the same strategies with ``read_in_place=False``: first one
  copy per array into a ``[C, N]`` tensor (the path before in-place reading, and
  still an accelerator's).

Both sides decode the replies and encode the new global ``ArrayRecord``; message
transport is not included.  Run ``python -m fedopt_kernels.benchmarks.flower``.
"""

from __future__ import annotations

import argparse
import math
from typing import List, Sequence, Tuple

import torch
from torch import nn

from .shapes import resnet18_shapes, small_cnn_shapes
from .timing import interleaved

MODELS = {"resnet18": resnet18_shapes, "small_cnn": small_cnn_shapes}


class ShapesModel(nn.Module):
    """A module whose parameters have the given shapes (``p0``, ``p1``, ...)."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]]):
        super().__init__()
        for i, s in enumerate(shapes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.zeros(s)))


def _ensure_task_identity() -> None:
    """Flower ``Message``s need a run id; a benchmark process has none."""
    from flwr.supercore.task_identity import TaskIdentity

    try:
        TaskIdentity.run_id
    except RuntimeError:
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def flat_arrays(arrays) -> torch.Tensor:
    """An ``ArrayRecord``'s arrays as one flat CPU tensor, in the record's order (the
    comparisons' view of a global model or a reply)."""
    return torch.cat([torch.from_numpy(a.numpy()).flatten() for a in arrays.values()])


ROW_KEYS = ("benchmark", "case", "flwr ms", "fused ms", "speed-up", "threads")


def speedup_row(benchmark: str, case: str, flwr_s: float, fused_s: float, **extra) -> dict:
    """One row of a comparison with Flower: both sides' times (seconds in, ms out), the
    same-run ratio, the threads, then ``extra`` columns."""
    return {"benchmark": benchmark, "case": case, "flwr ms": flwr_s * 1e3, "fused ms": fused_s * 1e3,
            "speed-up": flwr_s / fused_s, "threads": torch.get_num_threads(), **extra}


def format_row(r: dict, detail: str = "", skip=()) -> str:
    """One printed line of a :func:`speedup_row`: ``detail`` after the fused time, the
    extra columns but those in ``skip`` at the end."""
    extra = "".join(f", {k} {v:.4g}" for k, v in r.items() if k not in ROW_KEYS and k not in skip)
    return (f"{r['benchmark']} | {r['case']}: flwr {r['flwr ms']:.1f} ms, fused {r['fused ms']:.1f} ms{detail}, "
            f"speed-up {r['speed-up']:.2f}x ({r['threads']} threads){extra}")


def make_replies(shapes, C: int, *, seed: int = 0, scale: float = 1e-2):
    """``(global ArrayRecord, [C reply Messages])``: clients = global + small noise,
    ``num-examples`` random in [50, 500)."""
    from flwr.app import Message, MessageType, MetricRecord, RecordDict

    from ..integrations.flower.records import tensors_to_arrayrecord

    _ensure_task_identity()
    g = torch.Generator().manual_seed(seed)
    global_tensors = [torch.randn(s, generator=g) for s in shapes]
    global_arrays = tensors_to_arrayrecord((f"p{i}", t) for i, t in enumerate(global_tensors))
    replies = []
    for c in range(C):
        rec = tensors_to_arrayrecord((f"p{i}", t + scale * torch.randn(t.shape, generator=g))
                                     for i, t in enumerate(global_tensors))
        n = int(torch.randint(50, 500, (1,), generator=g))
        content = RecordDict({"arrays": rec, "metrics": MetricRecord({"num-examples": n, "train_loss": 1.0})})
        ins = Message(content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=100 + c)
        replies.append(Message(content=content, reply_to=ins))
    return global_arrays, replies


def bench_flower(C: int = 20, model: str = "resnet18", *, repeats: int = 5, warmup: int = 1) -> List[dict]:
    """Median ms of one ``aggregate_train`` of each strategy (see the module docstring)."""
    import logging

    from flwr.serverapp import strategy as flwr_strategy

    from ..integrations import flower as fk

    logging.getLogger("flwr").setLevel(logging.WARNING)
    shapes = MODELS[model]()
    N = sum(math.prod(s) for s in shapes)
    global_arrays, replies = make_replies(shapes, C)
    kw = dict(fraction_evaluate=0.0)

    flwr_avg = flwr_strategy.FedAvg(**kw)
    flwr_adam = flwr_strategy.FedAdam(eta=1e-2, beta_1=0.9, beta_2=0.99, tau=1e-3, **kw)
    flwr_adam.current_arrays = {k: a.numpy() for k, a in global_arrays.items()}  # what configure_train sets
    ours = {}
    for in_place, suffix in ((True, ""), (False, ", copying")):
        ours["FedAvg" + suffix] = fk.FedAvg(ShapesModel(shapes), read_in_place=in_place, **kw)
        ours["FedAdam" + suffix] = fk.FedAdam(ShapesModel(shapes), lr=1e-2, read_in_place=in_place, **kw)
    for s in ours.values():
        s.load_global_arrays(global_arrays)
    rnd = iter(range(1, 10 ** 9))
    candidates = {"flwr FedAvg": lambda: flwr_avg.aggregate_train(next(rnd), replies),
                  "flwr FedAdam": lambda: flwr_adam.aggregate_train(next(rnd), replies)}
    for name, s in ours.items():
        candidates[f"fused {name}"] = lambda s=s: s.aggregate_train(next(rnd), replies)
    times = interleaved(candidates, repeats=repeats, warmup=warmup)
    label = f"{C} x {model} ({N / 1e6:.3g}M params, {len(shapes)} arrays)"
    rows = []
    for algo in ("FedAvg", "FedAdam"):
        flwr_t, ours_t, copy_t = times[f"flwr {algo}"], times[f"fused {algo}"], times[f"fused {algo}, copying"]
        rows.append(speedup_row(f"flower aggregate_train {label}", algo, flwr_t, ours_t, **{
            "copying ms": copy_t * 1e3, "in place vs copying": copy_t / ours_t}))
    return rows


def comparison_parser(doc: str, *, repeats: int) -> argparse.ArgumentParser:
    """The command line of every Flower comparison (this one, flower_dp, flower_robust):
    ``--clients``, ``--model`` and ``--repeats``; each adds its own arguments."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


def main(argv=None) -> int:
    args = comparison_parser(__doc__, repeats=5).parse_args(argv)
    rows = bench_flower(args.clients, args.model, repeats=args.repeats)
    for r in rows:
        print(format_row(r, f" (copying {r['copying ms']:.1f} ms, {r['in place vs copying']:.2f}x)",
                         skip=("copying ms", "in place vs copying")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
