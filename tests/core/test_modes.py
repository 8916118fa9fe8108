"""Search and phase two score with one function: a model left in training mode (dropout) is scored in evaluation
mode by both, and handed back in the mode it had."""
import torch

from twophase import Seq2Seq, beam_search, objectives, rescore_backward, sample

from conftest import rnn_graph_mode, toy_batch


def _dropout_model():
    torch.manual_seed(0)
    return Seq2Seq(9, 7, embed_dim=8, hidden_size=16, dropout=0.3).double().train()


def test_search_scores_a_training_model_without_dropout():
    model = _dropout_model()
    src, lens = toy_batch()
    for s in (beam_search(model, (src, lens), 4, 5),
              sample(model, (src, lens), 4, 5, generator=torch.Generator().manual_seed(0))):
        assert model.training  # handed back as it came
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(s.scores, model.sequence_log_probs(src, lens, s.tokens, s.owner),
                                       rtol=1e-9, atol=1e-12)
        model.train()


def test_phase_two_differentiates_the_eval_scores_unless_told_to_keep_the_mode():
    model = _dropout_model()
    src, lens = toy_batch()
    s = beam_search(model, (src, lens), 4, 5)
    c = objectives.reinforce(torch.rand(len(s), dtype=torch.float64), s.owner, 3, "mean")
    with rnn_graph_mode(model):
        (c * model.sequence_log_probs(src, lens, s.tokens, s.owner)).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.train().zero_grad()
    rescore_backward(model, (src, lens), s, c, chunk_size=3)
    assert model.training
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-9, atol=1e-12)
    model.zero_grad()
    torch.manual_seed(1)  # keep_mode: dropout on, as the MLE steps want, so the gradient differs
    rescore_backward(model, (src, lens), s, c, chunk_size=3, keep_mode=True)
    assert any((p.grad - w).abs().max() > 1e-6 for p, w in zip(model.parameters(), want))
