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


def test_a_saved_view_counts_its_whole_storage():
    """A view saved for backward holds its whole storage alive: a slice of one row of a [4, 48] hidden state counts
    4 * 48 floats, not 48 (beside the linear's input, 4 * 32, saved for its weight gradient). Mutation seen
    failing: the view's own ``numel() * element_size()`` for the storage's ``nbytes()``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 48)
    x = torch.randn(4, 32)

    def step():
        row = model(x)[:1]
        (row * row).sum().backward()  # saves the slice (twice): one storage, the hidden state's

    assert saved_for_backward_bytes(step, model) == (4 * 32 + 4 * 48) * 4
