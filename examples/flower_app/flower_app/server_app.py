"""ServerApp: a fused fedopt_kernels strategy (FedAdam by default) with central evaluation."""

from __future__ import annotations

import json
import os
import time

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedopt_kernels.server import algorithm
from fedopt_kernels.integrations.flower import load_arrayrecord_, make_strategy, model_to_arrayrecord

from .task import make_model, proxy_loader, test_data

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    seed, algo = int(rc["seed"]), str(rc["algo"])
    model = make_model(seed, int(rc["hidden"]))
    backend = str(rc.get("backend", "")) or None

    hyper = {}  # what the run config sets; the rest: the class's defaults (fedopt_kernels.server.ALGORITHMS)
    if float(rc["server-lr"]) >= 0 and algo != "fedlaw":
        hyper["lr"] = float(rc["server-lr"])
    # fedavgm, asnes; fedadagrad's beta1
    if "momentum" in algorithm(algo).defaults and float(rc["server-momentum"]) >= 0:
        hyper["momentum"] = float(rc["server-momentum"])
    if algo == "fedlaw":
        hyper.update(proxy_loader=proxy_loader(seed, int(rc["proxy-size"])), loss_fn=torch.nn.CrossEntropyLoss(),
                     server_epochs=int(rc["fedlaw-epochs"]))
    strategy = make_strategy(algo, model, backend=backend, fraction_train=float(rc["fraction-train"]),
                             fraction_evaluate=0.0, weighting=str(rc.get("weighting", "auto")), **hyper)

    # fedlaw: its proxy set comes from the test set, the accuracy from the rest ([FedLAW] D.2)
    x_test, y_test = test_data(seed, int(rc["proxy-size"]) if algo == "fedlaw" else 0)
    eval_model = make_model(seed, int(rc["hidden"]))

    stamps = {}  # round -> time.time() once that round (its training and evaluation) is done

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_arrayrecord_(eval_model, arrays)
        eval_model.eval()
        with torch.no_grad():
            out = eval_model(x_test)
            loss = torch.nn.functional.cross_entropy(out, y_test).item()
            acc = (out.argmax(1) == y_test).double().mean().item()
        stamps[server_round] = time.time()
        return MetricRecord({"test_accuracy": acc, "test_loss": loss})

    result = strategy.start(grid=grid, initial_arrays=model_to_arrayrecord(model),
                            num_rounds=int(rc["num-server-rounds"]), evaluate_fn=evaluate)

    save = str(rc.get("save-path", ""))
    if save:
        os.makedirs(save, exist_ok=True)
        torch.save(strategy.model.state_dict(), os.path.join(save, "final_model.pt"))
        rounds = sorted(set(result.train_metrics_clientapp) | set(result.evaluate_metrics_serverapp))
        # timestamp: wall clock at the end of the round; wall_time: seconds since the end of
        # round 0 (the initial evaluation), as fedopt simulate's records
        history = [{"round": r, **dict(result.train_metrics_clientapp.get(r, {})),
                    **dict(result.evaluate_metrics_serverapp.get(r, {})),
                    "timestamp": stamps.get(r), "wall_time": stamps[r] - stamps[0] if r in stamps else None}
                   for r in rounds]
        with open(os.path.join(save, "history.json"), "w") as f:
            json.dump(history, f, indent=1)
