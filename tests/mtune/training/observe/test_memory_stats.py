"""What autograd saves for backward during a step (`saved_for_backward_bytes`): counted once per storage, the
module's own tensors left out."""

import torch
from torch.utils.checkpoint import checkpoint

from mtune.training.observe.memory_stats import saved_for_backward_bytes


def test_saved_for_backward_counts_activations_once_and_leaves_parameters_out():
    """A linear layer saves its input and its weight (a parameter: left out); a tensor saved three times counts
    once; a checkpointed region saves only its input under these hooks. Counting the parameters, or every save
    instead of every storage, fails this (both tried); so does counting the module's buffers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    x = torch.randn(4, 32, requires_grad=True)

    def step():
        hidden = model[0](x)
        (model[1](hidden).sum() + (hidden * hidden).sum()).backward()

    # x (saved by the first linear) and the hidden state (saved three times: by the second linear and as both
    # factors of the product, one storage)
    groups: dict = {}
    assert saved_for_backward_bytes(step, model, groups) == (4 * 32 + 4 * 48) * 4
    assert groups == {"[4, 32] float32": [1, 4 * 32 * 4], "[4, 48] float32": [1, 4 * 48 * 4]}

    def checkpointed():
        checkpoint(lambda t: model[1](model[0](t)), x, use_reentrant=False).sum().backward()

    assert saved_for_backward_bytes(checkpointed, model) == 4 * 32 * 4  # the region's input only

    model.register_buffer("scale", torch.full((48,), 2.0))  # saved by the product (for the hidden state's gradient)
    assert saved_for_backward_bytes(lambda: (model[0](x) * model.scale).sum().backward(), model) == 4 * 32 * 4
