"""step()'s per-param checks in C++ (csrc/bindings/step_checks.cpp): what
they tell must be what the Python they replace told, change for change."""

import pytest
import torch

from swap_optimizer import _C


def _params():
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((3, 4), (5,), (2, 1, 2))]


def test_tensor_signature_shows_any_dtype_or_shape_change():
    params = _params()
    before = _C.tensor_signature(params)
    assert _C.tensor_signature(_params()) == before  # other tensors, same dtypes and shapes
    changes = [lambda ps: ps.__setitem__(0, ps[0].double()),
               lambda ps: ps.__setitem__(1, ps[1].view(5, 1)),
               lambda ps: ps.__setitem__(2, ps[2].view(2, 2)),  # same numel, another dim count
               lambda ps: ps.__setitem__(0, ps[0].t()),         # same dims, swapped
               lambda ps: ps.pop()]
    for change in changes:
        changed = _params()
        change(changed)
        assert _C.tensor_signature(changed) != before
    assert _C.tensor_signature([params[0], "not a tensor"]) is None


def test_data_pointers_show_replaced_data():
    params = _params()
    before = _C.data_pointers(params)
    assert before == _C.data_pointers(params)
    params[1].data = params[1].data.clone()
    assert _C.data_pointers(params) != before
    with pytest.raises(TypeError, match="expected tensors"):
        _C.data_pointers([1.0])


def test_grads_of_reads_each_grad_and_finds_the_first_sparse_one():
    params = _params()
    params[0].grad = torch.randn(3, 4)
    params[2].grad = torch.randn(2, 1, 2).to_sparse()
    grads, sparse = _C.grads_of(params)
    assert grads[0] is params[0].grad and grads[1] is None and grads[2] is params[2].grad
    assert sparse == 2
    params[2].grad = None
    assert _C.grads_of(params)[1] == -1
