"""Issue 43, item 5: the pieces of the DiLoCo benchmark (the runs themselves take minutes
of 2 gloo processes and are run by hand: docs/diloco.md has their numbers).

The model's size against its formula, the corpus against the files it reads, the
batches against the windows they cut, and the suite wiring (``--only diloco`` only when
named, its table)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from fedopt_kernels.benchmarks import char_gpt, diloco, suite


def test_presets_have_the_sizes_of_their_formula():
    # per block: 2 LayerNorms (2C each), qkv (3C^2 + 3C), proj (C^2 + C), fc (4C^2 + 4C),
    # out (4C^2 + C) = 12C^2 + 13C; embeddings 256 C + T C (head tied); final LayerNorm 2C
    for name, c in char_gpt.PRESETS.items():
        C = c.n_embd
        expected = c.n_layer * (12 * C * C + 13 * C) + 256 * C + c.block_size * C + 2 * C
        got = sum(p.numel() for p in char_gpt.CharGPT(c).parameters())
        assert got == expected, name
    assert 9.5e6 < sum(p.numel() for p in char_gpt.CharGPT(char_gpt.PRESETS["10m"]).parameters()) < 11e6


def test_corpus_is_the_standard_library_source():
    train, val = char_gpt.stdlib_corpus(max_bytes=200_000)
    assert train.dtype == torch.uint8 and len(train) + len(val) == 200_000 and len(val) == 20_000
    root = Path(sysconfig.get_paths()["stdlib"])
    first = next(p for p in sorted(root.rglob("*.py"))
                 if not any(x in ("test", "tests", "idlelib", "site-packages") for x in p.relative_to(root).parts))
    head = first.read_bytes()[:1000]
    assert bytes(train[:len(head)].tolist()) == head


def test_batches_are_windows_and_their_next_bytes():
    data = torch.arange(250, dtype=torch.uint8)
    x, y = char_gpt.sample_batch(data, 5, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 16) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # data[i] = i: the next byte is one more
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_causal_model_does_not_see_the_future():
    torch.manual_seed(0)
    m = char_gpt.CharGPT(char_gpt.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)).eval()
    idx = torch.randint(0, 256, (1, 8))
    other = idx.clone()
    other[0, 5:] = (other[0, 5:] + 7) % 256
    torch.testing.assert_close(m(idx)[0, :5], m(other)[0, :5])
    assert not torch.allclose(m(idx)[0, 5:], m(other)[0, 5:])


def test_suite_runs_diloco_only_when_named(capsys):
    assert "diloco" not in suite.SUITES and "diloco" in suite.EXTRA_SUITES
    row = {"benchmark": "diloco", "case": "diloco-50", "params": 437760, "tokens_per_worker": 307200,
           "final_val_loss": 2.5, "val_curve": [(0, 5.4), (300, 2.5)], "MB_sent_per_worker": 10.5,
           "inner_step_ms": 300.0, "sync_s": 0.5, "wall_s": 120.0}
    suite.print_table([row])
    out = capsys.readouterr().out
    assert "DiLoCo vs DDP" in out and "diloco-50" in out
    assert "| diloco-50 | 5.400 2.500 | 2.500 | 10.5 | 300 | 0.50 | 120 |" in diloco.format_table([row])
