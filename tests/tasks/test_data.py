import itertools
import re

import pytest
import torch

from twophase.tasks.data import (BatchSampler, DataError, Dataset, load_cmudict, load_tsv, pad_batch, pad_targets,
                           tokenize_source)
from twophase.vocab import EOS, PAD


def write(tmp_path, content, name="data.tsv"):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


# --- load_tsv -------------------------------------------------------------------------------------------------

def test_load_tsv_groups_references_by_source(tmp_path):
    path = write(tmp_path, "r e a d\tR IY1 D\nc a t\tK AE1 T\n\n  \nr e a d\tR EH1 D\nr e a d\tR IY1 D\n")
    data = load_tsv(path)
    assert data.sources == [("r", "e", "a", "d"), ("c", "a", "t")]
    assert data.references == [[("R", "IY1", "D"), ("R", "EH1", "D")], [("K", "AE1", "T")]]
    assert len(data) == 2
    assert data.pairs() == [(0, 0), (0, 1), (1, 0)]


def test_load_tsv_multiple_spaces_and_crlf(tmp_path):
    data = load_tsv(write(tmp_path, "a   b \t  X  Y\r\n"))
    assert data.sources == [("a", "b")]
    assert data.references == [[("X", "Y")]]


def test_load_tsv_char_options(tmp_path):
    path = write(tmp_path, "new york\tN UW1 Y\nab\tx y\n")
    data = load_tsv(path, char_source=True)
    assert data.sources == [tuple("newyork"), ("a", "b")]
    assert data.references == [[("N", "UW1", "Y")], [("x", "y")]]
    data = load_tsv(path, char_target=True)
    assert data.sources == [("new", "york"), ("ab",)]
    assert data.references == [[("N", "U", "W", "1", "Y")], [("x", "y")]]


def test_load_tsv_lowercase_source_merges_sources(tmp_path):
    data = load_tsv(write(tmp_path, "Ab C\tX Y\nab c\tZ\nAB C\tX Y\n"), lowercase_source=True)
    assert data.sources == [("ab", "c")] and data.references == [[("X", "Y"), ("Z",)]]  # targets keep their case


def test_load_tsv_skips_utf8_bom(tmp_path):
    data = load_tsv(write(tmp_path, b"\xef\xbb\xbfab\tc\n"))
    assert data.sources == [("ab",)]


def test_tokenize_source():
    assert tokenize_source(" ab  c ", chars=False) == ("ab", "c")
    assert tokenize_source(" ab  c ", chars=True) == ("a", "b", "c")
    assert tokenize_source("", chars=False) == ()


@pytest.mark.parametrize("content, where, message", [
    ("a\tb\n\nno tab here\n", ":3:", "expected 'source<TAB>target', found no tab"),
    ("a\tb\na\tb\tc\td\n", ":2:", "expected one tab, found 3"),
    ("a\tb\n \tb\n", ":2:", "empty source"),
    ("a\tb\nc\tb\nd\t  \n", ":3:", "empty target"),
    (b"a\tb\nc\td\n\xff\xfe\tx\n", ":3:", "not valid UTF-8"),
])
def test_load_tsv_errors_name_file_and_line(tmp_path, content, where, message):
    path = write(tmp_path, content)
    with pytest.raises(DataError) as info:
        load_tsv(path)
    assert str(info.value) == f"{path}{where} {message}"
    assert "\n" not in str(info.value)


def test_load_tsv_missing_file(tmp_path):
    path = tmp_path / "absent.tsv"
    with pytest.raises(DataError) as info:
        load_tsv(path)
    assert str(info.value) == f"{path}: no such file"


# A line of only whitespace, even a lone tab, is blank rather than a pair with two empty sides.
@pytest.mark.parametrize("content", ["", "\n  \n\t\n"])
def test_load_tsv_no_data(tmp_path, content):
    path = write(tmp_path, content)
    with pytest.raises(DataError) as info:
        load_tsv(path)
    assert str(info.value) == f"{path}: no data"


def test_data_error_is_value_error():
    assert issubclass(DataError, ValueError)


# --- BatchSampler ---------------------------------------------------------------------------------------------

def take(sampler, k):
    return [next(sampler) for _ in range(k)]


def test_sampler_is_reproducible_and_seed_dependent():
    assert take(BatchSampler(10, 3, seed=7), 8) == take(BatchSampler(10, 3, seed=7), 8)
    assert take(BatchSampler(10, 3, seed=7), 8) != take(BatchSampler(10, 3, seed=8), 8)


def test_sampler_follows_seeded_randperm_and_drops_short_batch():
    batches = take(BatchSampler(10, 3, seed=5), 6)
    for epoch in range(2):
        perm = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        assert batches[3 * epoch:3 * epoch + 3] == [perm[0:3], perm[3:6], perm[6:9]]


def test_sampler_epoch_covers_every_index_once():
    sampler = BatchSampler(12, 4, seed=0)
    for _ in range(3):
        seen = list(itertools.chain.from_iterable(take(sampler, 3)))
        assert sorted(seen) == list(range(12))


def test_sampler_small_n_gives_whole_permutation():
    sampler = BatchSampler(3, 8, seed=1)
    batches = take(sampler, 3)
    assert all(sorted(b) == [0, 1, 2] for b in batches)
    assert sampler.state_dict()["epoch"] == 2


@pytest.mark.parametrize("k", [0, 1, 3, 4, 7])
def test_sampler_resume_matches_uninterrupted_stream(k):
    uninterrupted = take(BatchSampler(10, 3, seed=11), k + 6)
    first = BatchSampler(10, 3, seed=11)
    take(first, k)
    state = first.state_dict()
    assert set(state) == {"epoch", "position"}
    resumed = BatchSampler(10, 3, seed=11)
    resumed.load_state_dict(dict(state))
    assert take(resumed, 6) == uninterrupted[k:]


def test_sampler_is_its_own_iterator():
    sampler = BatchSampler(4, 2, seed=0)
    assert iter(sampler) is sampler
    assert len(list(itertools.islice(sampler, 5))) == 5


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError):
        BatchSampler(-1, 2, seed=0)
    empty = BatchSampler(0, 2, seed=0)  # a task without references: a state to save, no MLE batch
    assert empty.state_dict() == {"epoch": 0, "position": 0}
    with pytest.raises(RuntimeError, match="no items to batch"):
        next(empty)
    with pytest.raises(ValueError):
        BatchSampler(5, 0, seed=0)
    with pytest.raises(ValueError):
        BatchSampler(5, 2, seed=0).load_state_dict({"epoch": 0, "position": 6})


# --- padding --------------------------------------------------------------------------------------------------

def test_pad_batch():
    padded, lengths = pad_batch([[5, 6, 7], [8], [9, 10]])
    assert padded.dtype == torch.long and lengths.dtype == torch.long
    assert padded.tolist() == [[5, 6, 7], [8, PAD, PAD], [9, 10, PAD]]
    assert lengths.tolist() == [3, 1, 2]


def test_pad_targets_appends_eos_then_pad():
    targets = pad_targets([[5, 6], [7, 8, 9], []])
    assert targets.dtype == torch.long
    assert targets.tolist() == [[5, 6, EOS, PAD], [7, 8, 9, EOS], [EOS, PAD, PAD, PAD]]


# --- cmudict --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cmu() -> tuple[Dataset, Dataset, Dataset]:
    return load_cmudict()


def test_cmudict_split_is_disjoint_and_sized(cmu):
    train, valid, test = cmu
    words = [set(d.sources) for d in cmu]
    assert not words[0] & words[1] and not words[0] & words[2] and not words[1] & words[2]
    assert 2000 <= len(valid) <= 5000 and 2000 <= len(test) <= 5000
    assert len(train) > 10 * len(valid)
    assert all(len(refs) >= 1 for refs in train.references)
    assert any(len(refs) > 1 for refs in train.references)


def test_cmudict_entries(cmu):
    everything = {s: r for d in cmu for s, r in zip(d.sources, d.references)}
    assert everything[tuple("cat")] == [("K", "AE1", "T")]
    assert len(everything[tuple("read")]) >= 2
    assert all(len(set(refs)) == len(refs) for refs in everything.values())


def test_cmudict_split_is_deterministic(cmu):
    again = load_cmudict()
    for a, b in zip(cmu, again):
        assert a.sources == b.sources and a.references == b.references


def test_cmudict_rejects_impossible_split():
    with pytest.raises(ValueError):
        load_cmudict(valid_per_mille=600, test_per_mille=500)


def test_too_long_lines_are_refused_or_skipped(tmp_path):
    path = tmp_path / "long.tsv"
    path.write_text("a b\tx\na b c d\tx\na\tx y z\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: source has 4 tokens, more than the limit of 3$"):
        load_tsv(path, max_source_len=3)
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: target has 3 tokens"):
        load_tsv(path, max_target_len=2)
    data = load_tsv(path, max_source_len=3, max_target_len=2, too_long="skip")
    assert data.sources == [("a", "b")] and data.skipped == 2
