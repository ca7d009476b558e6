"""A step's masks as the sampler applies them: the bitmask and the biases over a copy of the
logits (the model's stay for log-probabilities), the biases summed as ``add_logit_bias_``
sums them; the host buffers taken in turn."""

import torch

from tokenspeed.execution.step_masks import MaskBuffers, StepMasks
from tokenspeed.structured import TokenBias, add_logit_bias_
from tokenspeed.structured.bitmask import pack_allowed


def test_masks_and_biases_apply_to_a_copy_as_the_structured_helpers_do():
    logits = torch.randn(3, 70, generator=torch.Generator().manual_seed(0))
    bitmask = torch.stack([pack_allowed([1, 5, 64], 70), pack_allowed(range(70), 70), pack_allowed([2], 70)])
    biases = ((0, TokenBias({5: 3.0, 64: -1.5})), (1, TokenBias({0: 100.0})), (0, TokenBias({5: 1.0})))
    scores = StepMasks(bitmask, biases).applied(logits)
    want = add_logit_bias_(logits.clone(), biases)
    allowed = torch.zeros(3, 70, dtype=torch.bool)
    allowed[0, [1, 5, 64]], allowed[1], allowed[2, 2] = True, True, True
    assert torch.equal(scores, want.masked_fill(~allowed, float("-inf")))
    assert not torch.equal(scores, logits) and logits.isfinite().all()


def test_buffers_alternate_and_grow():
    buffers = MaskBuffers(100, pinned=False)
    first, second, third = buffers.take(2), buffers.take(3), buffers.take(2)
    assert first.shape == (2, 4) and second.shape == (3, 4) and third.data_ptr() == first.data_ptr()
    assert second.data_ptr() != first.data_ptr() and buffers.take(5).shape == (5, 4)


def test_a_masks_only_draw_writes_the_rows_seats_of_the_column():
    """The draw of a step whose rows need only their masks puts each row's token in ``out``
    and at its seat of the token column (the decode runner writes the column no more)."""
    from tokenspeed.execution.sampler import RowSampling, SamplingTensors
    from tokenspeed.execution.sampling_params import SamplingParams
    logits = torch.randn(2, 70, generator=torch.Generator().manual_seed(1))
    bitmask = torch.stack([pack_allowed([3, 9], 70), pack_allowed([40], 70)])
    settings = SamplingTensors.build([RowSampling(SamplingParams(temperature=0.0), seed=5, seat=4),
                                      RowSampling(SamplingParams(temperature=0.7), seed=6, seat=1)], "cpu")
    out, column = torch.empty(2, dtype=torch.int64), torch.full((6,), -1, dtype=torch.int64)
    StepMasks(bitmask).draw(logits, settings, torch.tensor([7, 8]), out, column)
    assert out[0].item() == (3 if logits[0, 3] > logits[0, 9] else 9) and out[1].item() == 40
    assert column.tolist() == [-1, 40, -1, -1, out[0].item(), -1]


def test_a_masked_draw_replays_only_masks_as_wide_as_its_logits():
    """A rung's captured draw stages a step's masks; masks of another width (an engine whose
    vocabulary is narrower than the logits) are left to the eager draw, which disallows the
    tokens past them."""
    from tokenspeed.execution.masked_draws import MaskedDraws
    from tokenspeed.execution.sampler import RowSampling, SamplingTensors
    from tokenspeed.execution.sampling_params import SamplingParams
    from tokenspeed.structured import new_bitmask

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    draws = MaskedDraws(4, "cpu")
    settings = SamplingTensors.build([RowSampling(SamplingParams(temperature=0.0), seed=0)] * 4, "cpu")
    out = torch.zeros(4, dtype=torch.int64)
    draws.step(torch.randn(4, 70), settings, torch.zeros(4, dtype=torch.int32), out, torch.zeros(8, dtype=torch.int64))
    draws.graphs[4] = Graph()
    staged = torch.stack([pack_allowed([3], 70), pack_allowed([9, 64], 70)])
    assert draws.replay(4, staged) and Graph.replays == 1
    assert not draws.replay(4, new_bitmask(2, 40)) and not draws.replay(2, staged) and Graph.replays == 1
    draws.step(torch.randn(4, 70), settings, torch.zeros(4, dtype=torch.int32), out, torch.zeros(8, dtype=torch.int64))
    assert out[0] == 3 and out[1] in (9, 64)
