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


def test_fingerprint_shows_each_in_place_change_and_nothing_else():
    """What a vouched-for step's strict check compares around each call: a
    tensor written in place, a member replaced, added or removed, shows;
    equal values rebuilt around the same members do not."""
    tensor, number = torch.randn(3), object()

    def value():
        return {"lr": tensor, "betas": [tensor, number], "names": {number, tensor}, "other": number}

    held = value()
    before = {key: _C.fingerprint(v) for key, v in held.items()}
    assert {key: _C.fingerprint(v) for key, v in value().items()} == before  # rebuilt, the same members
    assert _C.fingerprint({number, tensor}) == _C.fingerprint({tensor, number})
    assert _C.fingerprint(held) == _C.fingerprint(dict(held))
    assert _C.fingerprints(held, ("lr", "names")) == {"betas": before["betas"], "other": before["other"]}
    changes = [lambda v: v["lr"].add_(1),            # a tensor written in place (its version)
               lambda v: v["betas"].append(1),
               lambda v: v["betas"].__setitem__(1, object()),
               lambda v: v["names"].add(2),
               lambda v: v.__setitem__("other", object())]
    for change in changes:  # (a dict's values are shown by identity: its attributes' are taken one by one)
        held = value()
        snapshot = _C.fingerprints(held, ())
        change(held)
        assert _C.fingerprints(held, ()) != snapshot
    renamed = value()
    renamed["extra"] = renamed.pop("other")
    assert _C.fingerprint(renamed) != _C.fingerprint(value())


def test_fingerprint_holds_what_it_names():
    """`held` gets every object a fingerprint names by identity, so that while
    it is kept no other object takes one's address: a member replaced by a
    new tensor (same version) made after the old one went shows."""
    member, key, other = torch.zeros(()), (1, 2), object()
    value = {"list": [member], key: other}
    held = []
    before = _C.fingerprint(value["list"], held) + _C.fingerprint(value, held)
    assert {id(x) for x in held} == {id(member), id(key), id(value["list"])} | {id(other)}
    del member
    value["list"].pop()
    value["list"].append(torch.zeros(()))
    assert _C.fingerprint(value["list"]) + _C.fingerprint(value) != before
    assert _C.fingerprints(value, (), held) == {"list": _C.fingerprint(value["list"]), key: _C.fingerprint(other)}
    with pytest.raises(TypeError, match="held must be a list or None"):
        _C.fingerprint(value, ())


def test_staged_rows_hand_the_step_detached_rows_and_fall_back_on_subclasses():
    params, generator = _params(), torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    views = [{"exp_avg": torch.zeros(p.shape)} for p in params]
    targets, state = _C.staged_rows(params, grads, views, [None, {"step": 3}, None], [None, (1, 3), None])
    assert all(p.grad is None for p in params)  # the caller's params keep theirs
    assert targets[0].grad is grads[0] and not isinstance(targets[0], torch.nn.Parameter)
    assert targets[0].data_ptr() == params[0].data_ptr()
    assert torch.equal(targets[1], params[1].view(-1)[1:4]) and torch.equal(targets[1].grad, grads[1].view(-1)[1:4])
    assert state[targets[1]] == {"exp_avg": views[1]["exp_avg"], "step": 3} and state[targets[0]] is not views[0]
    state[targets[2]]["exp_avg"] = torch.ones(2, 1, 2)
    kept = [frozenset({"exp_avg"}), frozenset({"exp_avg", "step"}), frozenset({"exp_avg"})]
    assert _C.replaced_states(targets, state, views, kept, [("exp_avg",)] * 3) == (-1, [(2, "exp_avg")])
    assert _C.replaced_states(targets, state, views, [frozenset({"exp_avg", "step"})] * 3, [("exp_avg",)] * 3)[0] == 0

    class Subclass(torch.Tensor):
        pass

    assert _C.staged_rows([params[0].detach().as_subclass(Subclass)], grads[:1], views[:1], [None], [None]) is None
    assert _C.staged_rows(params[:1], [None], views[:1], [None], [None]) is None
