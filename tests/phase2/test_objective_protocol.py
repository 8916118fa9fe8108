"""What `rescore_backward` takes in place of coefficients is named (`tokenweights.TokenObjective`,
`DecodesChunks`, `UnboundObjective`): the shipped objectives satisfy it; an objective written from the protocol
alone gets plain autograd's gradient (float64); one with a method missing is refused with a one-line TypeError
naming it."""
import pytest
import torch

from conftest import take_grads, tiny_model, toy_batch
from twophase import protocol, rescore_backward, sample
from twophase.objectives import distillation
from twophase.objectives.policy import advantages, policy_loss
from twophase.phase2.tokenweights import DecodesChunks, TokenObjective, UnboundObjective

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ["__len__", "__getitem__", "live", "needs_row_statistics", "derivative"]


class RowWeighted:
    """A TokenObjective from the protocol alone: every scored position of row r weighs w[r], so the loss is
    sum_r w_r log p(y_r)."""

    def __init__(self, w):
        self.w = w

    def __len__(self):
        return len(self.w)

    def __getitem__(self, rows):
        return RowWeighted(self.w[rows])

    def live(self):
        return self.w != 0

    def needs_row_statistics(self):
        return False

    def derivative(self, logp, row, col):
        d = self.w[row].to(logp.dtype)
        return d * logp, d, {}


def _lacking(name):
    """RowWeighted without one of its methods."""
    return type(f"No_{name.strip('_')}", (), {k: v for k, v in vars(RowWeighted).items()
                                              if k in METHODS and k != name} | {"__init__": RowWeighted.__init__})


@pytest.fixture(scope="module")
def batch():
    model = tiny_model()
    source = toy_batch()
    s = sample(model, source, 3, 5, generator=torch.Generator().manual_seed(2))
    return model, source, s


def test_the_shipped_objectives_satisfy_it(batch):
    model, source, s = batch
    B = len(source[0])
    adv = advantages(torch.rand(len(s), dtype=torch.float64), s.owner, B)
    policy = policy_loss(adv, s.token_scores, lengths=s.lengths, num_sources=B, owner=s.owner)
    assert isinstance(policy, TokenObjective) and not isinstance(policy, (DecodesChunks, UnboundObjective))
    unbound = distillation(tiny_model(seed=5))
    assert isinstance(unbound, UnboundObjective) and not isinstance(unbound, TokenObjective)
    bound = unbound.bind(model, source, s)
    assert isinstance(bound, TokenObjective) and isinstance(bound, DecodesChunks)
    assert not isinstance(torch.ones(len(s)), (TokenObjective, UnboundObjective))


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_an_objective_from_the_protocol_alone_equals_autograd(batch, prefix_sharing):
    model, source, s = batch
    w = torch.linspace(-1.0, 2.0, len(s), dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    with protocol.scoring_mode(model):
        tok = protocol.token_scores(model, model.encode(source), s.tokens, s.owner)  # (N, T), 0 past each end
        want_loss = (w * tok.sum(1)).sum()
    want_loss.backward()
    want = take_grads(model)
    got_loss = rescore_backward(model, source, s, RowWeighted(w), chunk_size=2, prefix_sharing=prefix_sharing)
    got = take_grads(model)
    assert got_loss == pytest.approx(want_loss.item(), abs=1e-12)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["live", "needs_row_statistics", "derivative", "__getitem__"])
def test_a_method_missing_is_a_one_line_type_error(batch, name):
    model, source, s = batch
    objective = _lacking(name)(torch.ones(len(s), dtype=torch.float64))
    with pytest.raises(TypeError) as err:
        rescore_backward(model, source, s, objective, chunk_size=2)
    message = str(err.value)
    assert "\n" not in message and "TokenObjective" in message and name in message
    assert [m for m in METHODS if m in message] == [name]


def test_what_is_neither_numbers_nor_an_objective_is_a_type_error(batch):
    model, source, s = batch
    with pytest.raises(TypeError, match="numbers or a TokenObjective"):
        rescore_backward(model, source, s, object(), chunk_size=2)
