"""DiLoCo, Streaming DiLoCo and DDP on a character-level GPT of the standard library's source.

    python examples/diloco_gpt/train.py                      # tiny preset, 300 steps, 2 gloo workers
    python examples/diloco_gpt/train.py --preset 10m --steps 20 --methods ddp diloco-50

The model, corpus and runs live in fedopt_kernels.benchmarks.char_gpt / .diloco (so that
``fedopt bench --only diloco`` runs the same thing); docs/diloco.md has the numbers.
"""

from fedopt_kernels.benchmarks.diloco import main

if __name__ == "__main__":
    raise SystemExit(main())
