"""Each paper's training recipe, one name away: ``fedopt simulate --recipe fedlaw``.

A :class:`Recipe` is the procedure a paper's authors train with -- the local optimizer
(momentum, weight decay, lr and its per-round decay, clipping), the local steps, the
server's settings and weighting, and the evaluation rule -- as values of
:class:`~fedopt_kernels.fl.SimulationConfig`, each with its source: a section of the
paper (``[FedLAW] D.6``) or a line of the authors' released code (``args.py:73`` of
github.com/ZexiLee/ICML-2023-FedLAW; the commits read are :data:`RELEASED_CODE`).

What a recipe leaves alone: the data and the scale (dataset, model, clients, clients
per round, rounds, partition), which the shipped data decide, not the paper.  Where
the simulator cannot do what the authors do, the recipe says so in
:attr:`Recipe.departures` instead of pretending.

Python::

    from fedopt_kernels.fl import SimulationConfig
    cfg = SimulationConfig.from_recipe("fedlaw", rounds=30, lr=0.05)   # explicit values override the recipe

The recipes are data: this module imports nothing of the simulator, whose config
reads them (``SimulationConfig.from_recipe``, the ``recipe`` setting's check).

Command line: ``fedopt simulate --recipe fedexp --rounds 40`` (flags given on the
command line override the recipe; a TOML file's settings too).  ``results.json``
records the resolved recipe under ``meta.recipe``: every value, its source, and which
ones were overridden (:meth:`Recipe.resolved`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

__all__ = ["Setting", "Recipe", "RECIPES", "RELEASED_CODE", "get", "names"]

# The authors' released code, at the commits whose lines the sources below cite.
RELEASED_CODE = {
    "fednar": "github.com/ljb121002/fednar @ f44da15a4550cd473eefe0aa491a81a6fd81e99a",
    "fedlaw": "github.com/ZexiLee/ICML-2023-FedLAW @ 47f7a7226baeb4d684e5d555f793caba874adea3",
    "fedexp": "github.com/Divyansh03/FedExP @ 34b05a269e2cff24c54c0b159bde80fa915bbeff",
    "feddecay": "github.com/JoeLavond/FedDecay @ a7ccb3af112bdf60ae2947d2bac670294d13f0f9",
    "asnes": "no released code",
}


@dataclass(frozen=True)
class Setting:
    """One value of a recipe: the :class:`SimulationConfig` field it sets, the value,
    and where the value comes from."""

    field: str
    value: Any
    source: str


@dataclass(frozen=True)
class Recipe:
    """A paper's training procedure (see the module docstring)."""

    name: str
    paper: str
    settings: Tuple[Setting, ...]
    evaluation: str  # the paper's evaluation rule, in words (what the simulator records for it)
    departures: Tuple[str, ...] = ()  # where this simulator cannot follow the authors, and what it does instead

    def values(self) -> Dict[str, Any]:
        """``{field: value}`` of the recipe."""
        return {s.field: s.value for s in self.settings}

    def resolved(self, config) -> dict:
        """What ``results.json`` records: the recipe's name, paper, evaluation rule and
        departures, and per setting the value the run used, the recipe's value, its
        source and whether it was overridden."""
        settings = {}
        for s in self.settings:
            used = getattr(config, s.field)
            recipe_value = list(s.value) if isinstance(s.value, tuple) else s.value
            used = list(used) if isinstance(used, tuple) else used
            settings[s.field] = {"value": used, "recipe_value": recipe_value, "source": s.source,
                                 "overridden": used != recipe_value}
        return {"name": self.name, "paper": self.paper, "code": RELEASED_CODE.get(self.name),
                "evaluation": self.evaluation, "departures": list(self.departures), "settings": settings}


def _r(name, paper, evaluation, settings, departures=()):
    return Recipe(name=name, paper=paper, settings=tuple(Setting(*s) for s in settings), evaluation=evaluation,
                  departures=tuple(departures))


# [FedNAR] Li et al., NeurIPS 2023 (papers/fednar-with-appendix.txt); code: RELEASED_CODE["fednar"].
FEDNAR = _r("fednar", "FedNAR (Li et al., NeurIPS 2023)",
            "the last iterate's test accuracy every round (main.py:249: the two-iterate average only for the "
            "FedExP-style algorithms)", [
                ("algo", "fedavg", "[FedNAR] section 5: FedNAR plugged into FedAvg (Table 1's first row); "
                                   "scripts/fedavg.sh:3"),
                ("nar", "co", "[FedNAR] Algorithm 2 (co-clipping); main.py:52-54 (--use_nar: the weight decay "
                              "becomes an l2 term inside the clipped gradient)"),
                ("local_steps", 20, "[FedNAR] section 5: '20 steps of local training per round'; scripts/fedavg.sh:9"),
                ("batch_size", 50, "main.py:40 (--batch_size default 50)"),
                ("lr", 0.01, "[FedNAR] section 5: 'local learning rate to 0.01'; scripts/fedavg.sh:12"),
                ("lr_decay", 0.998, "[FedNAR] section 5: 'with a decay of 0.998'; configs.py:2"),
                ("weight_decay", 0.05, "scripts/fedavg.sh:11 (--weight_decay 0.05)"),
                ("max_norm", 10.0, "[FedNAR] section 5: 'cap the maximum norm at 10'; main.py:38"),
                ("momentum", 0.0, "util_general.py:42 (torch.optim.SGD without momentum)"),
                ("weighting", "size", "main.py:134-135 (p[i] = client data size, normalised)"),
                ("server_lr", 1.0, "[FedNAR] Figure 2 caption: 'a global learning rate of 1.0'; scripts/fedavg.sh:13"),
            ])

# [FedLAW] Li et al., ICML 2023 (papers/fedlaw.txt); code: RELEASED_CODE["fedlaw"].
FEDLAW = _r("fedlaw", "FedLAW (Li et al., ICML 2023)",
            "test accuracy of the global model every round on the test set less the proxy set ([FedLAW] D.2); "
            "the reported number is the mean over the last 10 rounds (main_fedlaw.py:75-76) -- 'last 10' in "
            "fedopt compare's table", [
                ("algo", "fedlaw", "main_fedlaw.py:15"),
                ("nar", "none", "utils.py:121 (plain torch.optim.SGD, no clipping)"),
                ("lr", 0.08, "args.py:69 (--lr default 0.08)"),
                ("lr_decay", 0.99, "utils.py:147 (args.lr *= 0.99 every round after the first)"),
                ("momentum", 0.9, "args.py:73 (--momentum default 0.9)"),
                ("weight_decay", 5e-4, "args.py:71 (--local_wd_rate default 5e-4)"),
                ("batch_size", 128, "args.py:12 (--batchsize default 128)"),
                ("carry_momentum", True, "client_funct.py:16 + models_dict/reparam_function.py:163 (a client "
                                         "receives the global model by replacing .data; its SGD optimizer, "
                                         "built once per client in nodes.py:32, keeps its momentum buffers "
                                         "across rounds)"),
                ("weighting", "size", "main_fedlaw.py:30-33 (lambda starts from data-size weights); [FedLAW] "
                                      "Algorithm 1 line 10"),
                ("fedlaw_learn", "both", "server_funct.py:65 (fedlaw_optimization learns gamma and lambda)"),
                ("fedlaw_epochs", 20, "args.py:49 (--server_epochs default 20; [FedLAW] D.6 says 100)"),
                ("fedlaw_lr", 0.005, "server_funct.py:69-72 (Adam lr 0.01 for cifar10, 0.005 for every other "
                                     "dataset)"),
                ("proxy_source", "test", "[FedLAW] D.2 (proxy set drawn from the test set)"),
            ], departures=(
                "local work: the authors run E = 1 epoch (args.py:32) over each client's data in batches of 128; "
                "the simulator runs local_steps steps (default 20) of batch_size samples",
                "participation: the authors' clients all train every round (client_funct.py:32) and the server "
                "aggregates the selected ones; here only the round's clients train, so a client's momentum is "
                "carried from the last round it took part in",
            ))

# [FedExP] Jhunjhunwala, Wang and Joshi, ICLR 2023; code: RELEASED_CODE["fedexp"] (CIFAR-10 branch).
FEDEXP = _r("fedexp", "FedExP (Jhunjhunwala, Wang and Joshi, ICLR 2023)",
            "test accuracy of the average of the last two iterates (main.py:414-421, 430-431; "
            "'test_accuracy_avg2' in the round record) beside the last iterate's ('test_accuracy')", [
                ("algo", "fedexp", "main.py:18 (--algorithm fedexp)"),
                ("nar", "grad", "util_general.py:58-59 (clip_grad_norm_ on the gradient, then SGD's weight decay)"),
                ("local_steps", 20, "main.py:77 ('cp': 20 local steps)"),
                ("batch_size", 50, "main.py:76 ('bs': 50)"),
                ("lr", 0.01, "main.py:102 (eta_l_fedexp = 0.01, CIFAR-10)"),
                ("lr_decay", 0.998, "main.py:95 and 307 (local_lr = decay * local_lr every round)"),
                ("weight_decay", 1e-4, "main.py:98"),
                ("max_norm", 10.0, "main.py:96-97"),
                ("momentum", 0.0, "util_general.py:40 (SGD momentum = 0)"),
                ("weighting", "size", "main.py:247-252 (p[i] = data size) and main.py:342-362 (grad_avg = sum p[i] grad / p_sum)"),
                ("server_lr", 1.0, "main.py:236 (eta_g 'adaptive': eta_g alone, no extra multiplier)"),
                ("fedexp_eps", 1e-3, "main.py:121 (epsilon_fedexp = 0.001, CIFAR-10)"),
                ("fedexp_scale_eps", True, "main.py:404 (eta_g = 0.5 * mean ||D_i||^2 / (||D||^2 + S * epsilon))"),
                ("fedexp_eps_decay", 0.998 ** 2, "main.py:308 (epsilon = decay * decay * epsilon every round)"),
                ("eval_avg_last_two", True, "main.py:414-421 and 430-431 (w_vec_avg evaluated for fedexp)"),
            ], departures=(
                "the authors decay the local lr and eps once before the first round too (main.py:307-308: round t "
                "uses decay^(t+1)); the simulator's round t uses decay^t for both, a factor 0.998 apart",
            ))

# [FedDecay] "Balancing Model Performance and Rapid Personalization in Federated Learning with Learning Rate
# Scheduling" (anonymous TMLR submission, papers/feddecay.txt); code: RELEASED_CODE["feddecay"] (FederatedScope).
FEDDECAY = _r("feddecay", "FedDecay (anonymous submission; code by J. Lavond, github.com/JoeLavond/FedDecay)",
              "accuracy on clients held out of training (20% of the users, [FedDecay] section 4 'Data') and on "
              "the training clients' data, after local fine-tuning; the simulator records the global model's "
              "test accuracy, and with --holdout-clients (20% of --clients, as the paper) its accuracy on the "
              "held-out clients' data (holdout_accuracy)", [
                  ("algo", "fedavg", "[FedDecay] section 3: FedDecay is FedAvg with within-round decay"),
                  ("nar", "grad", "feddecay/femnist--s02/base_finetune.yaml (optimizer.grad_clip: 5, gradient "
                                  "clipping)"),
                  ("max_norm", 5.0, "feddecay/femnist--s02/base_finetune.yaml (optimizer.grad_clip: 5)"),
                  ("momentum", 0.0, "feddecay/femnist--s02/base_finetune.yaml (optimizer.momentum: 0)"),
                  ("weight_decay", 0.0, "feddecay/femnist--s02/base_finetune.yaml (optimizer.weight_decay: 0)"),
                  ("batch_size", 32, "feddecay/femnist--s02/base_finetune.yaml (data.batch_size: 32)"),
                  ("lr", 0.05, "feddecay/femnist--s02/decay/sweep_decay_finetune.yaml (lr grid 0.005-0.5; 0.05 "
                               "is its first value and the simulator's default)"),
                  ("lr_decay", 1.0, "base_finetune.yaml (no scheduler: the lr is constant across rounds)"),
                  ("decay_beta", 0.8, "feddecay/femnist--s02/decay/sweep_decay_finetune.yaml (beta grid 0.2, "
                                      "0.4, 0.6, 0.8; the mildest)"),
                  ("decay_kind", "exponential", "[FedDecay] eq. 7; federatedscope/core/trainers/"
                                                "trainer_decay.py:129-130"),
                  ("decay_per", "epoch", "federatedscope/core/configs/cfg_training.py:15 "
                                         "(model_on_batch_or_epoch = 'epoch')"),
                  ("decay_scales_change", True, "federatedscope/core/trainers/trainer_decay.py:42-54 and 117-145 "
                                                "(the epoch runs at the full lr; its parameter change is then "
                                                "scaled by beta^j)"),
                  ("weighting", "uniform", "[FedDecay] section 2: 'we exclusively consider aggregation with "
                                           "equally weighted users'; base_finetune.yaml data_weighted_aggr: false"),
              ], departures=(
                  "local work: the authors run 3 local epochs (sweep_decay_finetune.yaml local_update_steps: 3); "
                  "the simulator runs local_steps steps, the epoch index k = step // (client size // batch)",
                  "evaluation: the paper measures accuracy after 5 local fine-tuning steps (base_finetune.yaml "
                  "trainer.finetune.steps: 5); the simulator measures the global model",
              ))

# [ASNES] papers/asnes.txt (no released code).
ASNES = _r("asnes", "ASNES (papers/asnes.txt)",
           "test accuracy of the global model every round ([ASNES] section 5, Figures 1-2)", [
               ("algo", "asnes", "[ASNES] Algorithm 1"),
               ("nar", "none", "[ASNES] section 1: clients 'perform multiple local updates using stochastic gradient "
                               "descent' (no clipping stated)"),
               ("momentum", 0.0, "[ASNES] Algorithm 1 line 9: plain local SGD (the momentum is the server's)"),
               ("weight_decay", 0.0, "[ASNES] Algorithm 1 line 9: w_{n,k+1} = w_{n,k} - eta g_{n,k}, no decay term (the "
                                     "simulator's default 1e-3 is FedNAR's, defaults.LOCAL)"),
               ("weighting", "uniform", "[ASNES] eq. (2), Algorithm 1 line 13: the mean over the round's clients"),
               ("server_lr", 1.0, "[ASNES] eq. (3)-(4c): the server step is eta_t = r"),
               ("server_momentum", 0.9, "[ASNES] section 5.1: 'beta = 0.9 in the Fashion-MNIST experiment'"),
           ], departures=(
               "the paper states no local lr, batch size or local steps usable here (its '0.00001' "
               "for Fashion-MNIST is the benchmarks' lr); the simulator's defaults are kept",
               "the paper samples 10-90 of 100 clients per round; here per_round is fixed",
           ))

RECIPES: Dict[str, Recipe] = {r.name: r for r in (FEDNAR, FEDLAW, FEDEXP, FEDDECAY, ASNES)}


def names() -> Tuple[str, ...]:
    return tuple(RECIPES)


def get(name: str) -> Recipe:
    """The recipe called ``name`` (one of :func:`names`); a clear error otherwise."""
    try:
        return RECIPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}") from None
