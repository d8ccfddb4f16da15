"""GradientNames (accordion_hvd/horovod/seam.py): a gradient's name by identity, from the
named_parameters the user gives. Under horovodrun: tests/test_compressor_horovod.py."""

import pytest
import torch

from accordion_hvd.horovod.seam import GradientNames


def model_with_grads():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    return model


def test_names_by_gradient_identity_in_any_order_step_after_step():
    model = model_with_grads()
    names = GradientNames(model.named_parameters())
    params = dict(model.named_parameters())
    for order in (["1.bias", "1.weight", "0.bias", "0.weight"], ["0.weight", "1.bias", "0.bias", "1.weight"]):
        for name in order:
            params[name].grad = params[name].grad.clone()  # torch makes new gradient tensors every step
        assert [names.name_of(params[n].grad) for n in order] == order
        names.end_step()


def test_a_gradient_of_no_given_parameter_or_seen_twice_is_refused():
    model = model_with_grads()
    names = GradientNames(model.named_parameters())
    with pytest.raises(RuntimeError, match="same named_parameters as hvd.DistributedOptimizer"):
        names.name_of(torch.zeros(3))
    grad = model[0].weight.grad
    assert names.name_of(grad) == "0.weight"
    with pytest.raises(RuntimeError, match="compressed already this step"):
        names.name_of(grad)


@pytest.mark.parametrize("given,error,message", [
    (3, TypeError, "iterable of \\(name, parameter\\) pairs"),
    ([("w", 1.0)], TypeError, "must be a \\(str, torch.Tensor\\) pair"),
    ([("w", torch.zeros(1)), ("w", torch.zeros(1))], ValueError, "the name 'w' twice"),
    ([], ValueError, "empty"),
])
def test_bad_named_parameters(given, error, message):
    with pytest.raises(error, match=message):
        GradientNames(given)
