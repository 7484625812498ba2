"""Issue 46 item 4: the simulator's settings as nested parts, one set of names, the CLI
generated from them.

The oracle of the names is today's flat form, frozen here as a checkpoint of the previous
main stored it (``Simulation.state_dict()["config"]``, also results.json's ``config``):
every key of it must still be accepted, land in one field of one part, and come back out
of ``to_dict`` unchanged."""

import argparse
import ast
import dataclasses
import io
import re
from pathlib import Path

import pytest
import torch

from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.engine.client import LocalConfig
from fedopt_kernels.fl.run.config import (FLAG_OF, FLAT_NAMES, PARTS, ConfigError, DataConfig, RobustnessConfig,
                                          check_across_parts)

ROOT = Path(__file__).resolve().parents[1]

# SimulationConfig(dataset="digits", clients=6, per_round=3, rounds=2, local_steps=2, hidden=(8,), seed=5,
# algo="scaffold", server_betas=(0.8, 0.95), lr=0.07).to_dict() as the previous main (1315f9e) wrote it
OLD_FLAT = {'algo': 'scaffold',
 'nar': 'co',
 'dataset': 'digits',
 'model': 'mlp',
 'hidden': [8],
 'clients': 6,
 'per_round': 3,
 'rounds': 2,
 'partition': 'auto',
 'alpha': 0.3,
 'min_client_size': None,
 'weighting': 'auto',
 'local_steps': 2,
 'batch_size': 32,
 'lr': 0.07,
 'lr_decay': 0.998,
 'weight_decay': 0.001,
 'wd_decay': 1.0,
 'max_norm': 10.0,
 'momentum': 0.0,
 'decay_beta': 1.0,
 'decay_kind': 'exponential',
 'decay_per': 'step',
 'prox_mu': 0.01,
 'server_lr': None,
 'server_momentum': None,
 'server_betas': [0.8, 0.95],
 'server_tau': 0.001,
 'fedexp_eps': 0.001,
 'fedlaw_learn': 'both',
 'fedlaw_epochs': 20,
 'fedlaw_lr': 0.01,
 'proxy_size': 100,
 'proxy_source': 'test',
 'max_weight_share': None,
 'on_bad_client': 'exclude',
 'synthetic_alpha': 1.0,
 'synthetic_beta': 1.0,
 'synthetic_iid': False,
 'max_samples_per_client': None,
 'test_fraction': 0.2,
 'data_root': None,
 'seed': 5,
 'eval_every': 1,
 'device': 'cpu',
 'backend': None,
 'engine': 'auto',
 'client_batch': 0,
 'corrupt_fraction': 0.0,
 'corrupt_kind': 'labels',
 'corrupt_noise_std': 1.0,
 'dp_clip': None,
 'dp_noise_multiplier': 0.0,
 'dp_target_quantile': None,
 'dp_delta': None,
 'dp_mode': 'server',
 'attack': 'none',
 'attack_fraction': 0.0,
 'aggregator': 'mean',
 'trim_beta': None,
 'byzantine_f': None,
 'krum_m': None,
 'geomed_iters': None,
 'geomed_tol': None,
 'cclip_tau': None,
 'cclip_iters': None,
 'norm_bound_radius': None,
 'fedexp_scale_eps': False,
 'fedexp_eps_decay': 1.0,
 'eval_avg_last_two': False,
 'carry_momentum': False,
 'decay_scales_change': False,
 'recipe': None,
 'holdout_clients': 0,
 'client_state_dtype': None,
 'client_state_dir': None,
 'memory_budget': None,
 'compress': 'none',
 'compress_block': 256,
 'compress_stochastic': False,
 'compress_rotate': False,
 'error_feedback': False}


def test_the_old_flat_form_loads_and_comes_back_unchanged():
    cfg = SimulationConfig.from_dict(OLD_FLAT)
    assert cfg.to_dict() == OLD_FLAT and list(cfg.to_dict()) == list(OLD_FLAT)  # same keys, same order
    assert (cfg.local.steps, cfg.local.lr, cfg.server.algo, cfg.server.betas, cfg.run.hidden, cfg.data.clients) == \
        (2, 0.07, "scaffold", (0.8, 0.95), (8,), 6)
    assert cfg == SimulationConfig(**OLD_FLAT).validate()


def test_nested_parts_round_trip():
    cfg = SimulationConfig.from_dict(OLD_FLAT)
    nested = {name: dataclasses.asdict(getattr(cfg, name)) for name in PARTS}
    nested["local"].pop("scaffold")  # follows from algo: not a setting
    again = SimulationConfig.from_dict(nested)
    assert again == cfg and again.to_dict() == OLD_FLAT
    built = SimulationConfig(data=cfg.data, local=cfg.local, server=cfg.server, run=cfg.run).validate()
    assert built == cfg
    with pytest.raises(ConfigError, match=r"unknown setting local.local_steps"):
        SimulationConfig.from_dict({"local": {"local_steps": 3}})


def test_every_old_flat_name_is_accepted_read_and_written_through_its_part():
    assert set(FLAT_NAMES) == set(OLD_FLAT) and SimulationConfig.field_names() == list(OLD_FLAT)
    assert len(set(FLAT_NAMES.values())) == len(FLAT_NAMES)  # one field per name, none shared
    default = SimulationConfig().to_dict()
    for i, (name, (part, field)) in enumerate(FLAT_NAMES.items()):
        assert field in {f.name for f in dataclasses.fields(PARTS[part][0])}, name
        value = 1000 + i  # a value no setting has by default: storage only, not validated
        cfg = SimulationConfig(**{name: value})
        assert getattr(cfg, name) == value and getattr(getattr(cfg, part), field) == value, name
        assert cfg.to_dict() == {**default, name: value}, name
        cfg2 = SimulationConfig()
        setattr(cfg2, name, value)
        assert cfg2 == cfg, name
    with pytest.raises(TypeError, match="unexpected keyword argument 'steps'"):
        SimulationConfig(steps=3)


def test_replace_copies_the_parts():
    a = SimulationConfig(local_steps=3)
    b = dataclasses.replace(a, algo="scaffold", local_steps=4)
    c = a.replace(lr=0.2)
    assert (a.algo, a.local_steps, a.lr) == ("fedavg", 3, SimulationConfig().lr)
    assert (b.algo, b.local_steps, c.lr, c.local_steps) == ("scaffold", 4, 0.2, 3)
    assert a.local is not b.local and a.local is not c.local
    assert b.local_config() == dataclasses.replace(a.local, steps=4, prox_mu=0.0, scaffold=True)
    assert a.local_config().prox_mu == 0.0 and SimulationConfig(algo="fedprox").local_config().prox_mu == 0.01


def test_each_part_validates_its_own_fields_with_the_flat_names():
    with pytest.raises(ConfigError, match="^per-round \\(7\\) cannot exceed clients \\(6\\)$"):
        DataConfig(clients=6, per_round=7).validate()
    with pytest.raises(ConfigError, match="^aggregator krum needs byzantine-f$"):
        RobustnessConfig(aggregator="krum").validate()
    with pytest.raises(ConfigError, match="^local-steps must be >= 1, got 0$"):
        SimulationConfig(local_steps=0).validate()
    with pytest.raises(ConfigError, match="^server-lr must be >= 0, got -1$"):
        SimulationConfig(server_lr=-1).validate()
    with pytest.raises(ConfigError, match="^compress-block must be a positive multiple of 32, got 33$"):
        SimulationConfig(compress="int8", compress_block=33).validate()
    with pytest.raises(ConfigError, match="local.scaffold follows from the algorithm"):
        SimulationConfig(local=LocalConfig(scaffold=True)).validate()


def test_the_rules_across_parts_name_both_settings():
    cases = [
        (dict(aggregator="median", dp_clip=1.0, weighting="uniform"), "dp"),
        (dict(aggregator="median", algo="fedexp"), "aggregator median cannot be used with algo fedexp"),
        (dict(aggregator="krum", byzantine_f=2, per_round=5), "aggregator krum with byzantine-f 2 needs per-round"),
        (dict(compress="int8", algo="fedlaw"), "compress cannot be used with algo fedlaw"),
        (dict(compress="int8", dp_clip=1.0, dp_mode="client", weighting="uniform"), "compress with dp-mode client"),
    ]
    for settings, words in cases:
        cfg = SimulationConfig(**settings)
        for name in PARTS:  # each part alone is fine: only the combination is refused
            part = getattr(cfg, name)
            if hasattr(part, "validate"):
                part.validate()
        with pytest.raises(ConfigError, match=re.escape(words)):
            check_across_parts(cfg)
        with pytest.raises(ConfigError, match=re.escape(words)):
            cfg.validate()


def _help_groups():
    from fedopt_kernels.cli._options import GROUP_TITLES, add_simulation_options

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_simulation_options(parser)
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    return {part: groups[title] for part, title in GROUP_TITLES.items()}, parser


def test_help_groups_list_every_field_of_their_part():
    groups, parser = _help_groups()
    for part, (cls, _) in PARTS.items():  # every setting of the part, in the part's own order
        assert groups[part] == [FLAG_OF[(part, f.name)] for f in dataclasses.fields(cls) if (part, f.name) in FLAG_OF]
    assert sorted(d for dests in groups.values() for d in dests) == sorted(FLAT_NAMES)
    assert [f.name for f in dataclasses.fields(LocalConfig) if f.name != "scaffold"] == \
        [FLAT_NAMES[d][1] for d in groups["local"]]
    # types and defaults come from the config: the parsed flags build the same config as the Python call
    args = parser.parse_args(["--local-steps", "4", "--server-betas", "0.5,0.6", "--hidden", "8,4", "--dp-clip",
                              "none", "--byzantine-f", "1", "--synthetic-iid", "true", "--memory-budget", "4G"])
    assert vars(args) == dict(local_steps=4, server_betas=(0.5, 0.6), hidden=(8, 4), dp_clip=None, byzantine_f=1,
                              synthetic_iid=True, memory_budget="4G", config=None, quiet=False)
    help_text = parser.format_help()
    assert "FedProx's mu (default 0.01)" in help_text  # the simulator's default, not LocalConfig's 0


def test_the_config_page_is_the_generated_tables():
    from fedopt_kernels.cli._options import settings_tables

    text = (ROOT / "docs" / "config.md").read_text()
    assert settings_tables() in text
    assert settings_tables().count("\n| `") == len(FLAT_NAMES)


def test_recipes_import_nothing_of_the_config():
    """The config reads the recipes (one direction): recipes.py imports no module of the simulator."""
    tree = ast.parse((ROOT / "fedopt_kernels" / "fl" / "run" / "recipes.py").read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module in ("__future__", "dataclasses", "typing")
               for n in imports), [ast.dump(n) for n in imports]
    cfg = SimulationConfig.from_recipe("fedlaw", rounds=3)
    assert (cfg.recipe, cfg.rounds, cfg.momentum) == ("fedlaw", 3, 0.9)


def test_a_checkpoint_with_the_old_flat_settings_resumes_bit_for_bit():
    """A state dict whose settings are today's flat form (as the previous main saved it)
    resumes, and the run equals the uninterrupted one bit for bit."""
    full = Simulation(SimulationConfig.from_dict(OLD_FLAT))
    full.run()
    part = Simulation(SimulationConfig.from_dict(OLD_FLAT))
    part.run(1)
    state = part.state_dict()
    assert state["config"] == OLD_FLAT  # the saved form is still flat
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    resumed = Simulation(SimulationConfig.from_dict(OLD_FLAT))
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    resumed.run()
    assert torch.equal(resumed.x_global, full.x_global)
