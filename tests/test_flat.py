"""Model <-> flat vector helpers (fedopt_kernels.utils.flat)."""

import pytest
import torch
from torch import nn

from fedopt_kernels.utils import (FlatLayout, buffers_layout, buffers_to_vector, flatten_parameters_,
                                  parameters_layout, module_to_vector, vector_to_buffers,
                                  vector_to_module)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(12, 4)
        self.head = nn.Linear(4, 2, bias=False)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))
        self.register_buffer("counter", torch.tensor(7, dtype=torch.int32))


def test_parameter_order_and_round_trip():
    torch.manual_seed(0)
    m = Net()
    vec = module_to_vector(m)
    expected = torch.cat([p.detach().reshape(-1) for _, p in m.named_parameters()])
    assert torch.equal(vec, expected)
    layout = parameters_layout(m)
    assert layout.names == [n for n, _ in m.named_parameters()]
    assert layout.numel == vec.numel() == sum(p.numel() for p in m.parameters())
    assert [s.offset for s in layout.slots] == [0, 54, 57, 60, 63, 111, 115]
    assert layout.numel == 123

    other = Net()
    vector_to_module(vec, other)
    for (n1, p1), (n2, p2) in zip(m.named_parameters(), other.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    # The vector is a copy, not a view of the parameters.
    vec.zero_()
    assert not torch.equal(module_to_vector(m), vec)


def test_unflatten_gives_views_that_keep_autograd():
    m = Net()
    layout = parameters_layout(m)
    vec = module_to_vector(m).requires_grad_(True)
    views = layout.unflatten(vec * 2)
    assert list(views) == layout.names
    for (name, p) in m.named_parameters():
        assert views[name].shape == p.shape
    sum(v.sum() for v in views.values()).backward()
    assert torch.equal(vec.grad, torch.full_like(vec, 2.0))
    # Views share the vector's storage.
    base = torch.arange(layout.numel, dtype=torch.float32)
    v = layout.unflatten(base)
    v["fc.bias"].fill_(-1)
    s = layout.slots[layout.names.index("fc.bias")]
    assert torch.all(base[s.offset:s.offset + s.numel] == -1)


def test_tied_parameters_appear_once():
    m = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    m[1].weight = m[0].weight
    vec = module_to_vector(m)
    assert vec.numel() == 9
    vector_to_module(torch.arange(9.0), m)
    assert torch.equal(m[1].weight, torch.arange(9.0).view(3, 3))


def test_buffers_floating_by_default_integer_separately():
    m = Net()
    m.bn.running_mean.copy_(torch.tensor([1.0, 2.0, 3.0]))
    m.bn.num_batches_tracked.fill_(5)
    fl = buffers_layout(m)
    # named_buffers() order: the module's own buffers, then its children's.
    assert fl.names == ["scale", "bn.running_mean", "bn.running_var"]
    assert fl.dtype == torch.float32
    vec = buffers_to_vector(m)
    assert torch.equal(vec, torch.tensor([2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 1.0, 1.0]))

    il = buffers_layout(m, kind="integer")
    assert il.names == ["counter", "bn.num_batches_tracked"]
    assert il.dtype == torch.int64
    ivec = buffers_to_vector(m, kind="integer")
    assert ivec.dtype == torch.int64 and ivec.tolist() == [7, 5]

    other = Net()
    vector_to_buffers(vec, other)
    vector_to_buffers(ivec, other, kind="integer")
    assert torch.equal(other.bn.running_mean, m.bn.running_mean)
    assert other.bn.num_batches_tracked.dtype == torch.int64 and other.bn.num_batches_tracked.item() == 5
    assert other.counter.dtype == torch.int32 and other.counter.item() == 7


def test_integer_buffers_are_never_cast_silently():
    m = Net()
    named = list(m.named_buffers())
    with pytest.raises(TypeError, match="integer"):
        FlatLayout.from_named_tensors(named)  # floating and integer together
    with pytest.raises(TypeError, match="integer tensors"):
        buffers_layout(m, kind="integer", dtype=torch.float32)
    before = m.bn.num_batches_tracked.clone()
    with pytest.raises(TypeError, match="dtype"):
        vector_to_buffers(torch.zeros(2), m, kind="integer")  # a float vector into int buffers
    assert torch.equal(m.bn.num_batches_tracked, before)
    with pytest.raises(ValueError, match="kind"):
        buffers_layout(m, kind="both")


def test_length_mismatch_is_an_error_and_writes_nothing():
    m = Net()
    before = module_to_vector(m)
    with pytest.raises(ValueError, match=r"has 10 elements but the model has 123"):
        vector_to_module(torch.zeros(10), m)
    with pytest.raises(ValueError, match="1-D"):
        vector_to_module(torch.zeros(3, 41), m)
    assert torch.equal(module_to_vector(m), before)
    layout = parameters_layout(m)
    with pytest.raises(ValueError, match="dtype"):
        layout.check_vector(torch.zeros(123, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layout.check_vector([0.0] * 123)


def test_mixed_precision_round_trip_is_exact():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m[0].half()
    layout = parameters_layout(m)
    assert layout.dtype == torch.float32  # promotion: nothing lost
    vec = module_to_vector(m)
    other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    other[0].half()
    vector_to_module(vec, other)
    for p, q in zip(m.parameters(), other.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)
    views = layout.unflatten(vec, cast=True)
    assert views["0.weight"].dtype == torch.float16 and views["1.weight"].dtype == torch.float32


def test_flatten_parameters_makes_views_of_one_storage():
    torch.manual_seed(0)
    m = Net()
    before = module_to_vector(m)
    params = list(m.parameters())
    vec = flatten_parameters_(m)
    assert torch.equal(vec, before)
    assert all(p is q for p, q in zip(params, m.parameters()))  # same Parameter objects
    vec.mul_(0.5)
    assert torch.equal(module_to_vector(m), before * 0.5)
    # Training through the views still works and updates the flat vector.
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.head(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert torch.equal(module_to_vector(m), vec)
    with pytest.raises(TypeError, match="one parameter dtype"):
        mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        mixed[0].double()
        flatten_parameters_(mixed)
