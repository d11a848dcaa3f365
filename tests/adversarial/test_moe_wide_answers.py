"""An expert answering one row with a wide output must not make a client allocate the batch at
that width.

A mixture's outputs take batch x k x the answers' width, and the width was the first answer's:
one expert answering its one row with 65,536 floats (256 KiB) made a client with a batch of 1,024
and k = 4 allocate 1 GiB. The width is now that of the most rows answered, and one wider than
the inputs needs answers for at least 1 / MAX_OUTPUT_SPREAD of the slots."""

from __future__ import annotations

import pytest
import torch

from potluck.moe.layers import MAX_OUTPUT_SPREAD, _Dispatch, _MixtureCall
from potluck.moe.messages import ForwardReply

BATCH, K, FEATURES = 1024, 4, 16


class _Location:
    uid = "ffn.0"


class _Ctx:
    needs_input_grad = (False, True)

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass


def forward(answers: list):
    class Layer:
        def call_forward(self, x, dispatches):
            return answers + [TimeoutError()] * (len(dispatches) - len(answers))
    dispatches = [_Dispatch(_Location(), [i], [0]) for i in range(BATCH)]
    return _MixtureCall.forward(_Ctx(), torch.empty(0), torch.randn(BATCH, FEATURES), Layer(), dispatches, K)


@pytest.mark.timeout(30)
def test_one_wide_answer_does_not_size_the_batch():
    wide = ForwardReply((torch.zeros(1, 2**16),), kept=False)
    outputs, mask = forward([wide])
    assert outputs.numel() <= BATCH * K * FEATURES and not mask.any()


@pytest.mark.timeout(30)
def test_wide_answers_for_enough_of_the_batch_are_kept():
    answered = BATCH * K // MAX_OUTPUT_SPREAD
    replies = [ForwardReply((torch.ones(1, 4 * FEATURES),), kept=False) for _ in range(answered)]
    outputs, mask = forward(replies)
    assert outputs.shape == (BATCH, K, 4 * FEATURES) and int(mask.sum()) == answered
