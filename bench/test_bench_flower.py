"""pytest-benchmark cases for the server side of a Flower round (``pytest bench/
--benchmark-only``): one ``aggregate_train`` of the fused strategies of
``fedopt_kernels.integrations.flower`` vs Flower's own ``FedAvg`` / ``FedAdam`` on the
same client replies.  Nothing is asserted about time; ``test_interleaved`` records the
interleaved medians and speed-ups in ``extra_info``."""

import logging

import pytest

pytest.importorskip("flwr", reason="flwr is not installed: pip install fedopt_kernels[flower]")

from flwr.serverapp import strategy as flwr_strategy  # noqa: E402

from fedopt_kernels.benchmarks.flower import MODELS, ShapesModel, bench_flower, make_replies  # noqa: E402
from fedopt_kernels.integrations import flower as fk  # noqa: E402

SETTINGS = {"20xresnet18": (20, "resnet18"), "20xsmall_cnn": (20, "small_cnn")}
logging.getLogger("flwr").setLevel(logging.WARNING)


@pytest.fixture(scope="module", params=list(SETTINGS))
def setting(request):
    C, model = SETTINGS[request.param]
    shapes = MODELS[model]()
    global_arrays, replies = make_replies(shapes, C)
    return request.param, shapes, global_arrays, replies


@pytest.mark.parametrize("case", ["flwr FedAvg", "fused FedAvg", "fused FedAvg, copying", "flwr FedAdam",
                                  "fused FedAdam", "fused FedAdam, copying"])
def test_aggregate_train(benchmark, setting, case):
    name, shapes, global_arrays, replies = setting
    benchmark.group = f"flower aggregate_train {name}"
    if case == "flwr FedAvg":
        s = flwr_strategy.FedAvg(fraction_evaluate=0.0)
    elif case == "flwr FedAdam":
        s = flwr_strategy.FedAdam(eta=1e-2, beta_1=0.9, beta_2=0.99, tau=1e-3, fraction_evaluate=0.0)
        s.current_arrays = {k: a.numpy() for k, a in global_arrays.items()}
    else:
        cls = fk.FedAvg if case.startswith("fused FedAvg") else fk.FedAdam
        s = cls(ShapesModel(shapes), fraction_evaluate=0.0, read_in_place=not case.endswith("copying"))
        s.load_global_arrays(global_arrays)
    rounds = iter(range(1, 10 ** 9))
    benchmark(lambda: s.aggregate_train(next(rounds), replies))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_interleaved(benchmark, name):
    C, model = SETTINGS[name]
    rows = benchmark.pedantic(lambda: bench_flower(C, model, repeats=5), rounds=1, iterations=1)
    benchmark.extra_info.update({r["case"]: {"flwr ms": r["flwr ms"], "fused ms": r["fused ms"],
                                             "speed-up": r["speed-up"], "copying ms": r["copying ms"]}
                                 for r in rows})
    for r in rows:
        print(f"{r['benchmark']} | {r['case']}: flwr {r['flwr ms']:.1f} ms, fused {r['fused ms']:.1f} ms, "
              f"speed-up {r['speed-up']:.2f}x")
