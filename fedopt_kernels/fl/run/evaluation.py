"""Scoring a simulated run's global model: the simulator's evaluation part.

:class:`Evaluation` holds no state of its own beyond what it is handed: the global model
(its parameters are views of the flat vector ``x_global``), the loss and the
:class:`~fedopt_kernels.fl.run.population.Population` whose test set (less FedLAW's
held-out proxy set) and held-out clients it scores.  Every score is one host read:
the sums accumulate on the device in float64 and are read once.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .population import Population

__all__ = ["Evaluation"]


class Evaluation:
    """``(accuracy, mean loss)`` of the global ``model`` on the test set
    (:meth:`evaluate`), the held-out clients (:meth:`evaluate_holdout`) and the mean of
    the last two global iterates (:meth:`evaluate_average`)."""

    def __init__(self, model: nn.Module, x_global: torch.Tensor, loss_fn: Callable, population: Population):
        self.model, self.x_global, self.loss_fn, self.population = model, x_global, loss_fn, population

    @torch.no_grad()
    def evaluate(self, batch_size: int = 2048) -> tuple:
        """``(accuracy, mean loss)`` of the global model on the test set (on the
        population's ``eval_indices`` when FedLAW's proxy set is held out of it)."""
        ds = self.population.dataset
        x_test, y_test = ds.x_test, ds.y_test
        idx = self.population.eval_indices
        if idx is not None:
            idx = idx.to(self.population.device)
            x_test, y_test = x_test[idx], y_test[idx]
        return self.evaluate_on(x_test, y_test, batch_size)

    @torch.no_grad()
    def evaluate_holdout(self, batch_size: int = 2048) -> tuple:
        """``(accuracy, mean loss)`` of the global model on the held-out clients' pooled
        (uncorrupted) training data: the sample-weighted mean of their accuracies."""
        pop = self.population
        idx = torch.cat([pop.client_indices[c] for c in pop.holdout_clients])
        return self.evaluate_on(pop.dataset.x_train[idx], pop.dataset.y_train[idx], batch_size)

    @torch.no_grad()
    def evaluate_average(self, x_before: torch.Tensor, round_number: int, evaluate: Callable[[], tuple]) -> tuple:
        """``evaluate()`` of ``(x_before + x_global) / 2``, the mean of the last two
        global iterates, which FedExP's authors evaluate (released main.py:414-421 and
        430-431: in their first round the last iterate alone).  The global model is
        left as it was (bitwise)."""
        if round_number == 1:
            return evaluate()
        current = self.x_global.detach().clone()
        try:
            self.x_global.add_(x_before).mul_(0.5)
            return evaluate()
        finally:
            self.x_global.copy_(current)

    def evaluate_on(self, x_test: torch.Tensor, y_test: torch.Tensor, batch_size: int) -> tuple:
        model = self.model
        n = y_test.shape[0]
        was_training = model.training
        model.eval()
        device = self.population.device
        correct = torch.zeros((), dtype=torch.int64, device=device)
        loss = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, n, batch_size):
            x, y = x_test[start:start + batch_size], y_test[start:start + batch_size]
            out = model(x)
            loss += self.loss_fn(out, y).to(torch.float64) * y.numel()
            correct += (out.argmax(dim=1) == y).sum()
        model.train(was_training)
        acc, total = torch.stack([correct.to(torch.float64), loss]).tolist()
        return acc / n, total / n
