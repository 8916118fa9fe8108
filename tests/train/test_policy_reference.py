"""The frozen reference of --objective policy --kl-beta on a LoRA model (`twophase.train.klreference`): adapters
that add nothing yet make the base the reference (adapters disabled, nothing copied), equal to a separately built
model without adapters by its own forwards, in float64, however the adapters train after; trained adapters
(MLE, --init-from) or --ref-checkpoint's are swapped in for the reference's scoring and the model's put back
bit for bit; the checkpoint records which reference; and a LoRA + --kl-beta run trains end to end and resumes
bit-identically between two updates of a generation."""
import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None:
    pytest.skip("transformers and peft are not installed (pip install twophase[hf])", allow_module_level=True)

from twophase import protocol, sample  # noqa: E402
from twophase.models.hf import HFCausalLM, HFSeq2Seq  # noqa: E402
from twophase.train import cli  # noqa: E402
from twophase.system.fsdp import saved_state  # noqa: E402
from twophase.train.klreference import Reference  # noqa: E402
from twophase.errors import UsageError  # noqa: E402

import hf_tiny  # noqa: E402
from test_hf import PROMPTS, TOLERANCE, EXACT, _batch  # noqa: E402
from test_lora import _peft  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CHUNK = 2  # rows per chunk of the reference's scoring: several chunks


def _base(kind):
    """The model `_peft` adapted, built again without adapters (same seed, same weights)."""
    return hf_tiny.seq2seq(kind, seed=1) if kind in hf_tiny.SEQ2SEQ else hf_tiny.causal(kind)


def _oracle(model, bos_id, samples):
    """(N, T) per-token log-probs of the candidates by the transformers model's own forward, one unpadded row at a
    time (0 past a row's end)."""
    out = torch.zeros(samples.tokens.shape, dtype=torch.float64)
    for i, (tokens, n, o) in enumerate(zip(samples.tokens, samples.lengths.tolist(), samples.owner.tolist())):
        src, row = torch.tensor(PROMPTS[o])[None], tokens[:n][None]
        with torch.no_grad():
            if model.config.is_encoder_decoder:
                start = torch.full((1, 1), bos_id)
                logits = model(input_ids=src, decoder_input_ids=torch.cat([start, row[:, :-1]], 1)).logits[0]
            else:
                logits = model(input_ids=torch.cat([src, row[:, :-1]], 1)).logits[0, src.shape[1] - 1:]
        out[i, :n] = torch.log_softmax(logits.double(), -1).gather(1, row.T).squeeze(1)
    return out


def _setup(kind, trained: bool):
    """A LoRA wrapper (adapters as peft makes them, or trained: lora_B nonzero), a batch and its samples."""
    adapted, wrapper = _peft(kind)
    if not trained:
        with torch.no_grad():
            for name, p in wrapper.named_parameters():
                if "lora_B" in name:
                    p.zero_()  # peft's initialisation: the adapters add nothing
    source = _batch(PROMPTS, wrapper.pad_id)
    s = sample(wrapper, source, 3, 5, generator=torch.Generator().manual_seed(0))
    return wrapper, source, s


def _train_adapters(wrapper, seed):
    """What RL updates do to the adapters after the reference was made."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapper.named_parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _scores(wrapper, source, s):
    with torch.no_grad(), protocol.scoring_mode(wrapper):
        return protocol.token_scores(wrapper, wrapper.encode(source), s.tokens, s.owner)


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_untrained_adapters_make_the_base_the_reference(kind):
    wrapper, source, s = _setup(kind, trained=False)
    ref = Reference.of(wrapper, None, torch.device("cpu"))
    assert ref.kind == "base" and ref.copy is None and ref.state_dict() == {"kind": "base", "state": None}
    _train_adapters(wrapper, seed=5)  # RL moves the adapters; the reference stays the base
    params = {n: p.detach().clone() for n, p in wrapper.named_parameters()}
    own = _scores(wrapper, source, s)
    got = ref.log_probs(wrapper, source, s, CHUNK, _nullcontext)
    want = _oracle(_base(kind), wrapper.bos_id, s)
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE.get(kind, EXACT))
    assert float((own - want).abs().max()) > 1e-3  # the adapters do change the model: the test can fail
    # adapters enabled and trainable again, the model unchanged
    assert all(p.requires_grad == ("lora_" in n) for n, p in wrapper.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in wrapper.named_parameters())
    assert torch.equal(_scores(wrapper, source, s), own)


def test_trained_adapters_are_swapped_in_and_the_models_put_back():
    wrapper, source, s = _setup("gpt2", trained=True)  # adapters trained by MLE (or loaded by --init-from)
    ref = Reference.of(wrapper, None, torch.device("cpu"))
    assert ref.kind == "adapters" and set(ref.values) == {n for n, p in wrapper.named_parameters() if p.requires_grad}
    want = _scores(wrapper, source, s)  # the model at the first RL step
    _train_adapters(wrapper, seed=6)
    params = {n: p.detach().clone() for n, p in wrapper.named_parameters()}
    got = ref.log_probs(wrapper, source, s, CHUNK, _nullcontext)
    torch.testing.assert_close(got, want, rtol=0, atol=EXACT)
    assert all(torch.equal(p, params[n]) for n, p in wrapper.named_parameters())  # bit for bit
    assert float((_scores(wrapper, source, s) - want).abs().max()) > 1e-3
    again = Reference.from_state(ref.state_dict(), wrapper)  # what a checkpoint records
    assert again.kind == "adapters" and torch.equal(again.log_probs(wrapper, source, s, CHUNK, _nullcontext), got)


def test_ref_checkpoint_of_adapters_is_the_base_with_them(tmp_path):
    donor, source, s = _setup("gpt2", trained=True)
    path = tmp_path / "ref.pt"
    torch.save({"model": saved_state(donor)}, path)  # a --lora-r run's checkpoint: the adapters alone
    want = _scores(donor, source, s)
    wrapper, _, _ = _setup("gpt2", trained=False)
    _train_adapters(wrapper, seed=7)
    ref = Reference.of(wrapper, str(path), torch.device("cpu"))
    assert ref.kind == "adapters"
    torch.testing.assert_close(ref.log_probs(wrapper, source, s, CHUNK, _nullcontext), want, rtol=0, atol=EXACT)

    plain = tmp_path / "plain.pt"  # a checkpoint of a full model: no adapters to take
    torch.save(HFCausalLM(hf_tiny.causal("gpt2")).state_dict(), plain)
    with pytest.raises(UsageError, match=r"--ref-checkpoint .*plain.pt: no model\..*lora_A"):
        Reference.of(wrapper, str(plain), torch.device("cpu"))
    other = tmp_path / "other.pt"  # adapters over another base
    state = donor.state_dict()
    name = next(k for k in state if "base_layer" in k)
    state[name] = state[name] + 1
    torch.save(state, other)
    with pytest.raises(UsageError, match="differs from this model's frozen one"):
        Reference.of(wrapper, str(other), torch.device("cpu"))


def test_a_checkpoint_of_the_copy_kind_and_the_older_format_load():
    wrapper = HFSeq2Seq(hf_tiny.seq2seq("t5", seed=1))  # every parameter trains: a copy
    ref = Reference.of(wrapper, None, torch.device("cpu"))
    assert ref.kind == "copy" and ref.copy is not wrapper and not any(p.requires_grad for p in ref.copy.parameters())
    for state in (ref.state_dict(), ref.state_dict()["state"]):  # with its kind, or a bare state dict (before)
        again = Reference.from_state(state, wrapper)
        assert again.kind == "copy" and all(torch.equal(a, b) for a, b in zip(again.copy.state_dict().values(),
                                                                               ref.copy.state_dict().values()))


# ---- end to end: --lora-r with --kl-beta through train.py
FLAGS = ["--batch-size", "3", "--beam-size", "3", "--max-len", "5", "--max-src-len", "8", "--eval-every", "100",
         "--save-every", "100", "--no-compare-mle", "--objective", "policy", "--sampler", "sample", "--kl-beta", "0.5",
         "--updates-per-generation", "2", "--lora-r", "4", "--rl-lr", "0.05", "--rescore-chunk", "4"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_ref")
    hf_tiny.save(d / "gpt2", "gpt2")
    lines = [(s, " ".join(reversed(s.split()))) for s in ["a b c", "d e", "f", "g h a", "b d", "c e g"]]
    (d / "train.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in lines))
    (d / "valid.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in lines[:2]))
    return d


def _run(folder, save, *extra):
    return cli.main(["--train", str(folder / "train.tsv"), "--valid", str(folder / "valid.tsv"), "--hf-model",
                     str(folder / "gpt2"), "--save-dir", str(folder / save), *FLAGS, *extra])


def test_lora_with_kl_trains_against_the_base_and_resumes_bit_exactly(folder):
    assert _run(folder, "full", "--mle-steps", "0", "--rl-steps", "3") == 0
    state = torch.load(folder / "full" / "checkpoint_last.pt", weights_only=True)
    assert state["policy"]["reference"] == {"kind": "base", "state": None}  # nothing copied, nothing saved
    rl = [json.loads(x) for x in (folder / "full" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r["phase"] == "rl"]
    assert [r["update_in_generation"] for r in rl] == [1, 2, 1]
    assert rl[0]["kl"] < 1e-12 < rl[1]["kl"]  # at the base first, then moved away from it
    assert _run(folder, "part", "--mle-steps", "0", "--rl-steps", "1") == 0  # between two updates of generation 1
    assert _run(folder, "part", "--mle-steps", "0", "--rl-steps", "3", "--resume") == 0
    resumed = torch.load(folder / "part" / "checkpoint_last.pt", weights_only=True)
    assert all(torch.equal(state["model"][k], resumed["model"][k]) for k in state["model"])


def test_lora_after_mle_keeps_the_end_of_mle_adapters_as_the_reference(folder):
    assert _run(folder, "mle", "--mle-steps", "2", "--mle-batch-size", "4", "--rl-steps", "1") == 0
    state = torch.load(folder / "mle" / "checkpoint_last.pt", weights_only=True)
    ref = state["policy"]["reference"]
    assert ref["kind"] == "adapters" and ref["state"].keys() == state["model"].keys()  # the adapters alone
    assert all("lora_" in k for k in ref["state"])
