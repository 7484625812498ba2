"""The round's reply arena (compression/reply_arena.py): replies encoded into it aggregate
to the bits of plain replies; its memory is recycled at the next round unless a tensor of
the previous round is still held (which is then never overwritten); it grows past its
reservation; its mappings start on 2 MiB boundaries and carry the huge-page advice
(``hg`` in /proc/self/smaps); a simulated run writes its replies there and recycles one
slab round after round.  The encode into given buffers itself: tests/test_encode_out.py."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from fedopt_kernels.compression import Codec
from fedopt_kernels.compression.reply_arena import HUGE_PAGE, ReplyArena, host_buffer
from fedopt_kernels.ops import compressed as C
from _asserts import bits

def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _outputs(arena, codec, n, block):
    return tuple(arena.take(count, dtype) for dtype, count in C.block_reply_layout(codec, n, block))


def _inside(t, arena):
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(s.data_ptr() <= lo and hi <= s.data_ptr() + s.numel() for s in arena._slabs)


def test_arena_replies_aggregate_to_the_same_bits():
    codec, n = Codec("int8", block=64), 5001
    arena = ReplyArena()
    arena.start_round()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=g) for _ in range(3)]
    plain = [codec.encode(x, 7, i) for i, x in enumerate(xs)]
    held = [codec.encode(x, 7, i, out=_outputs(arena, "int8", n, 64)) for i, x in enumerate(xs)]
    assert all(_inside(r.codes, arena) and _inside(r.scales, arena) for r in held)
    assert all(r.codes.data_ptr() % 64 == 0 and r.scales.data_ptr() % 64 == 0 for r in held)
    w = torch.tensor([0.5, 0.3, 0.2])
    out_a, stats_a = C.decode_aggregate(plain, w)
    out_b, stats_b = C.decode_aggregate(held, w)
    assert same(out_b, out_a) and same(stats_b.client_sq_norms, stats_a.client_sq_norms)


def test_the_next_round_reuses_the_memory_no_one_holds():
    arena = ReplyArena()
    arena.start_round(reserve=5000)
    slab = arena._slabs[0]  # the same tensor object, not only the same address (munmap + mmap may give it back)
    first = [arena.take(1000, torch.int8) for _ in range(3)]
    del first
    arena.start_round()
    again = arena.take(10, torch.float32)
    assert arena._slabs[0] is slab and again.data_ptr() == slab.data_ptr()


def test_a_held_tensor_of_the_previous_round_is_never_overwritten():
    arena = ReplyArena()
    arena.start_round()
    held = arena.take(1000, torch.int8).fill_(7)
    arena.start_round()
    for _ in range(4):
        arena.take(1000, torch.int8).fill_(-1)
    assert torch.equal(held, torch.full((1000,), 7, dtype=torch.int8))
    assert not _inside(held, arena)


def test_the_arena_grows_past_its_reservation_and_then_takes_one_slab():
    arena = ReplyArena()
    arena.start_round(reserve=100)  # one 2 MiB slab
    parts = [arena.take(700_000, torch.int8).fill_(i) for i in range(4)]  # 2.8 MB: a second slab
    assert len(arena._slabs) == 2
    assert all(torch.equal(p, torch.full_like(p, i)) for i, p in enumerate(parts))  # none moved or overwritten
    del parts
    arena.start_round()
    assert len(arena._slabs) == 1 and arena.nbytes >= 4 * 700_032


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_bad_sizes_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="nbytes must be an int >= 0"):
        host_buffer(bad)
    with pytest.raises(ValueError, match="reserve must be an int >= 0"):
        ReplyArena().start_round(reserve=bad)
    with pytest.raises(ValueError, match="numel must be an int >= 0"):
        ReplyArena().take(bad, torch.int8)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        ReplyArena().take(4, "int8")


def _vmflags(address):
    """The VmFlags of the mapping holding ``address`` in /proc/self/smaps."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
            elif found and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="needs Linux's /proc/self/smaps and madvise(MADV_HUGEPAGE)")
@pytest.mark.parametrize("huge", [True, False])
def test_host_buffers_start_on_2mib_and_carry_the_huge_page_advice(huge):
    buf = host_buffer(3 * HUGE_PAGE + 5, huge_pages=huge)
    assert buf.numel() == 3 * HUGE_PAGE + 5 and buf.dtype == torch.uint8 and buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(3)
    assert int(buf[-1]) == 3
    assert ("hg" in _vmflags(buf.data_ptr())) == huge


def test_a_simulated_run_writes_its_replies_into_one_recycled_slab():
    """The simulator's compressed rounds encode into the arena and do not hold their
    replies past the round: every round's replies lie in the same slab (mapped once)."""
    from fedopt_kernels.fl import Simulation, SimulationConfig

    sim = Simulation(SimulationConfig(dataset="synthetic", clients=8, per_round=4, rounds=4, local_steps=1,
                                      hidden=(16,), seed=1, compress="int8", error_feedback=True, eval_every=4))
    comp = sim.compression
    arena, slabs, encode = comp.arena, [], comp.encode

    def spy(rows, clients, round_number):
        replies, left_out = encode(rows, clients, round_number)
        assert len(arena._slabs) == 1 and all(_inside(r.codes, arena) and _inside(r.scales, arena)
                                              for _, r in replies)
        slabs.append(arena._slabs[0])
        return replies, left_out
    comp.encode = spy
    sim.run()
    assert len(slabs) == 4 and all(s is slabs[0] for s in slabs)
