"""Library calls place what they make on the device of the tensors they work for, whatever device the other
arguments come from (rewards built on the CPU, a CPU `torch.Generator()` beside a model on a GPU). On a
machine without a GPU the `meta` device stands for the accelerator: a meta tensor meeting a CPU one fails the
way a CUDA one does."""
import torch

from twophase import objectives
from twophase.phase1.sbs import Gumbels

META = torch.device("meta")


def test_objectives_move_owners_to_the_scores_device():
    x, owner = torch.ones(3, dtype=torch.float64, device=META), torch.tensor([0, 0, 1])
    assert objectives.group_sum(x, owner, 2).device == META
    assert objectives.group_softmax(x, owner, 2).device == META
    assert objectives.mix(x, torch.ones(2, dtype=torch.float64), 0.5).device == META


def test_sbs_and_the_sampler_take_a_generator_on_another_device():
    from twophase.phase1.truncation import draw_unchecked
    cpu = torch.Generator().manual_seed(0)
    g = Gumbels(2, 3, META, cpu)  # the root's Gumbels drawn on the CPU generator, moved to the search's device
    assert g.perturbed.device == META and g.gumbel((2, 3, 4), META).device == META
    tokens, has_mass = draw_unchecked(torch.ones(2, 5, device=META), cpu)
    assert tokens.device == META and has_mass.device == META


def test_a_generator_on_the_same_device_draws_what_it_drew():
    """Drawing on the generator's device and moving is the plain draw where both are the same device."""
    from twophase.phase1.truncation import draw_unchecked
    probs = torch.rand(4, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    a = draw_unchecked(probs, torch.Generator().manual_seed(1))[0]
    u = torch.rand((4, 1), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = torch.searchsorted(probs.cumsum(1), u * probs.sum(1, keepdim=True), right=True).squeeze(1)
    assert torch.equal(a, want)


def test_search_sizes_its_blocks_for_its_device(monkeypatch):
    """The candidate blocks come from `blocks.block_bytes(device, search.BLOCK_BYTES)` (an accelerator's are
    larger), asked with the search's own device and the module's setting, which tests shrink."""
    from conftest import tiny_model, toy_batch
    from twophase import beam_search, blocks
    from twophase.phase1 import search
    asked = []

    def spy(device, cpu_bytes):
        asked.append((torch.device(device), cpu_bytes))
        return blocks.block_bytes(device, cpu_bytes)

    monkeypatch.setattr(search, "block_bytes", spy)
    monkeypatch.setattr(search, "BLOCK_BYTES", 64)
    beam_search(tiny_model(), toy_batch(), 3, 4)
    assert asked == [(torch.device("cpu"), 64)]
    assert blocks.block_bytes(META, 64) == blocks.ACCELERATOR_BLOCK_BYTES  # what a GPU search would be given
