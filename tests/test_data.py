import json
import re

import grain
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.config import DataConfig
from jaxtrain.data import GlobalBatches, Windows, eval_batches, is_validation_file, load_corpus, stdlib_files, train_tokenizer
from jaxtrain.data.pipeline import PLAIN_SEEDS, SEED_SCHEME, SPREAD_SEEDS, grain_seed
from jaxtrain.errors import UserError


def _sharding(n=8):
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))
    return NamedSharding(mesh, PartitionSpec("data", None))


def test_default_corpus_is_the_stdlib_split_by_file():
    root, files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    corpus = load_corpus(DataConfig())
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    val_files = [f for f in files if is_validation_file(f.relative_to(root).as_posix(), 0.02)]
    assert 0 < len(val_files) < len(files) * 0.05
    # the split is by file: the validation stream is exactly the validation files, in order
    assert len(corpus.validation) == sum(f.stat().st_size + 1 for f in val_files)
    assert len(corpus.train) + len(corpus.validation) == sum(f.stat().st_size + 1 for f in files)
    assert load_corpus(DataConfig()).train.tobytes() == corpus.train.tobytes()  # deterministic


def test_windows_shift_targets_by_one():
    tokens = np.arange(100)
    w = Windows(tokens, 10)
    assert len(w) == 9
    np.testing.assert_array_equal(w[2], np.arange(20, 31))


def test_batches_are_deterministic_by_seed_and_global_across_shardings():
    tokens = np.arange(10_000) % 251
    def first(seed, sharding):
        return [np.asarray(b["inputs"]) for _, b in zip(range(3), GlobalBatches(tokens, 16, 8, sharding, shuffle_seed=seed, repeat=True))]
    a, b, c = first(0, _sharding()), first(0, _sharding(1)), first(1, _sharding())
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)  # the global batch does not depend on how it is sharded
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    batch = next(GlobalBatches(tokens, 16, 8, _sharding(), shuffle_seed=0, repeat=True))
    np.testing.assert_array_equal(np.asarray(batch["inputs"])[:, 1:], np.asarray(batch["targets"])[:, :-1])
    assert batch["inputs"].sharding.spec == PartitionSpec("data", None)


def test_eval_batches_are_the_validation_split_in_file_order_and_bounded():
    from jaxtrain.data import Corpus

    validation = np.arange(16 * 8 * 3 + 1) % 200
    corpus = Corpus(validation + 50, validation, 256, "t")  # the train split is other tokens: evaluation must not read it
    batches = eval_batches(corpus, DataConfig(seq_len=16, seed=7), 8, _sharding(), count=10)
    assert len(batches) == 3  # only as many full batches as the split holds
    # the same every evaluation: the split's windows in file order, whatever data.seed shuffles training with
    windows = np.stack([validation[i * 16:i * 16 + 17] for i in range(24)])
    np.testing.assert_array_equal(np.concatenate([np.asarray(b["inputs"]) for b in batches]), windows[:, :-1])
    np.testing.assert_array_equal(np.concatenate([np.asarray(b["targets"]) for b in batches]), windows[:, 1:])


class _ProcessView:
    """A sharding as one process of a multi-process run sees it: only ``devices`` addressable."""

    def __init__(self, sharding, devices):
        self.sharding, self.devices = sharding, set(devices)

    def addressable_devices_indices_map(self, shape):
        return {d: i for d, i in self.sharding.devices_indices_map(shape).items() if d in self.devices}


def test_each_process_reads_its_own_rows_and_together_the_global_batch():
    """4 processes of 2 devices: each reads the block of rows its devices hold, none overlapping, and the blocks
    stacked are the batch one process holding every device reads."""
    tokens = np.arange(16 * 100 + 1) % 251
    sharding = _sharding(8)
    whole = GlobalBatches(tokens, 16, 8, sharding, shuffle_seed=3, repeat=True)
    expected = [next(whole.iterator)["inputs"] for _ in range(3)]
    devices = list(sharding.mesh.devices.flat)
    per_process = [GlobalBatches(tokens, 16, 8, _ProcessView(sharding, devices[2 * p:2 * p + 2]), shuffle_seed=3, repeat=True)
                   for p in range(4)]
    for batch in expected:
        np.testing.assert_array_equal(np.concatenate([next(b.iterator)["inputs"] for b in per_process]), batch)


def test_user_text_directory_and_token_files(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(200):
        (docs / f"{i}.txt").write_text(f"document {i}\n" * 5)
    (docs / ".hidden").write_text("skip me")
    corpus = load_corpus(DataConfig(path=str(docs), val_fraction=0.1))
    assert b"skip me" not in corpus.train.tobytes() + corpus.validation.tobytes()
    assert corpus.train.tobytes().count(b"\0") + corpus.validation.tobytes().count(b"\0") == 200

    tokens = np.arange(5000, dtype=np.uint16) % 1000
    np.save(tmp_path / "t.npy", tokens)
    tokens.astype("<u2").tofile(tmp_path / "t.bin")
    for name in ("t.npy", "t.bin"):
        corpus = load_corpus(DataConfig(path=str(tmp_path / name), val_fraction=0.1))
        assert corpus.vocab_size == 1000 and len(corpus.train) == 4500
        np.testing.assert_array_equal(corpus.validation, tokens[4500:])
    (tmp_path / "t.txt").write_text("one document")  # which a split by document cannot divide: the way on is named
    # with the --tokenizer that tokenize requires (the hint had none: copied, it was argparse's error)
    with pytest.raises(UserError, match=f"unknown file type; .*for one text file, jaxtrain tokenize {tmp_path / 't.txt'} "
                                        r"--tokenizer TOKENIZER \(a tokenizer.json: jaxtrain train-tokenizer makes one\) --out DATA.bin"):
        load_corpus(DataConfig(path=str(tmp_path / "t.txt")))
    tokenizer = train_tokenizer([str(tmp_path / "t.txt")], 300, tmp_path / "tok")  # the run's own, where it has one
    with pytest.raises(UserError, match=f"jaxtrain tokenize {tmp_path / 't.txt'} --tokenizer {tokenizer.path} --out DATA.bin"):
        load_corpus(DataConfig(path=str(tmp_path / "t.txt"), tokenizer=str(tmp_path / "tok")))


def _bad_token_files(tmp_path):
    """(file, the end of its one-line error) for token files that are not what their suffix says."""
    good = tmp_path / "good.npy"
    np.save(good, np.arange(100, dtype=np.int32))
    cases = {
        "random.npy": (np.random.default_rng(0).bytes(1000), "is not a .npy file of a 1-D integer array (numpy.save): no .npy header"),
        "truncated.npy": (good.read_bytes()[:-40], "(numpy.save): mmap length is greater than file size"),
        "header_only.npy": (good.read_bytes()[:20], "(numpy.save): EOF: reading array header, expected"),
        "odd.bin": (b"abc", "is not raw little-endian uint16 tokens: Size of available data is not a multiple of the data-type size"),
        "empty.bin": (b"", ": the token file holds 0 tokens; give data.path a token file made from text that holds documents"),
    }
    for name, (body, _) in cases.items():
        (tmp_path / name).write_bytes(body)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    cases["objects.npy"] = (None, "(numpy.save): Array can't be memory-mapped: Python objects in dtype")
    np.save(tmp_path / "floats.npy", np.ones(10, np.float32))
    cases["floats.npy"] = (None, "expected a 1-D integer token array, got shape (10,) dtype float32")
    np.save(tmp_path / "empty.npy", np.zeros(0, np.int32))
    cases["empty.npy"] = (None, ": the token file holds 0 tokens")
    np.save(tmp_path / "negative.npy", np.arange(-5, 95, dtype=np.int32))  # the embedding lookup would wrap them silently
    cases["negative.npy"] = (None, "holds negative token ids (the least is -5)")
    return {tmp_path / name: message for name, (_, message) in cases.items()}


def test_malformed_token_files_are_one_line_errors(tmp_path):
    for path, message in _bad_token_files(tmp_path).items():
        with pytest.raises(UserError) as error:
            load_corpus(DataConfig(path=str(path)))
        assert str(error.value).startswith(f"data.path={path}") and message in str(error.value) and "\n" not in str(error.value)


def test_a_split_leaving_one_side_empty_names_the_fraction_that_splits(tmp_path):
    from jaxtrain.data.documents import check_split

    keys = [f"{i}.txt" for i in range(3)]
    for val_fraction in (0.0, 1.0):  # none, then all of them in validation
        with pytest.raises(UserError) as refused:
            check_split(keys, val_fraction, "data.path=docs", "documents")
        message = str(refused.value)
        assert message.startswith(f"data: data.path=docs: 3 documents, and data.val_fraction={val_fraction} puts ")
        fraction = float(re.search(r"; data.val_fraction=([0-9.e-]+) splits them", message).group(1))
        validation = [is_validation_file(k, fraction) for k in keys]
        assert any(validation) and not all(validation)
        check_split(keys, fraction, "data.path=docs", "documents")  # the named fraction passes
    with pytest.raises(UserError, match=r"few.jsonl: 1 example, .* a train/validation split needs at least 2, so add examples$"):
        check_split(["few.jsonl#1"], 0.5, "few.jsonl", "examples")
    with pytest.raises(UserError, match=r"^data: none.jsonl: no examples; a train/validation split needs at least 2, so add examples or give "
                                        r"another data.path$"):
        check_split([], 0.5, "none.jsonl", "examples")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "only.txt").write_text("one document")
    with pytest.raises(UserError, match=r"^data: text files under .*docs: 1 document, and data.val_fraction=0.1 puts none of them in validation"):
        load_corpus(DataConfig(path=str(tmp_path / "docs"), val_fraction=0.1))
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.jsonl").write_text("\n \n")
    for empty in ("empty", "blank.jsonl"):  # a directory without files, a JSONL file of blank lines: no documents
        with pytest.raises(UserError, match=rf"^data: .*{empty}: no documents; a train/validation split needs at least 2"):
            load_corpus(DataConfig(path=str(tmp_path / empty)))


def test_a_validation_split_short_of_one_batch_names_data_val_fraction(tmp_path):
    from jaxtrain.data import check_sizes

    np.save(tmp_path / "t.npy", np.arange(5000, dtype=np.int32) % 100)
    cfg = DataConfig(path=str(tmp_path / "t.npy"), seq_len=32, val_fraction=0.01)  # 50 tokens: one sequence
    with pytest.raises(UserError, match=r"^the validation split has 1 sequences of data.seq_len=32, fewer than one batch "
                                        r"\(train.global_batch=8\); .*, or a larger data.val_fraction \(now 0.01\)$"):
        check_sizes(load_corpus(cfg), cfg, 8, 100)


def _rows(batches, count):
    """The input rows of the next ``count`` global batches, stacked."""
    return np.concatenate([np.asarray(next(batches)["inputs"]) for _ in range(count)])


def _plain_seeds(batches):
    """``batches`` from their beginning shuffled as before data.seed was spread: a run begun before then."""
    batches.iterator.set_state({"sequences": 0, SEED_SCHEME: PLAIN_SEEDS})
    return batches


@pytest.mark.parametrize("before, after", [(8, 16), (16, 8), (8, 12)])
def test_a_resume_with_another_global_batch_reads_on_from_the_next_sequence(before, after):
    """The data position counts sequences read: resumed under another global batch (here after 40 sequences too, which
    16 and 12 do not divide), the run reads the sequences the uninterrupted run reads next, none skipped or read twice
    (a QA report: it counted global batches, so 4 batches of 8 resumed at 16 began at sequence 64, and 2 of 16 resumed
    at 8 read 16-31 again)."""
    tokens = np.arange(16 * 200 + 1) % 251
    uninterrupted = _rows(GlobalBatches(tokens, 16, 4, _sharding(4), shuffle_seed=3, repeat=True), (5 * before + 4 * after) // 4)
    first = GlobalBatches(tokens, 16, before, _sharding(4), shuffle_seed=3, repeat=True)
    read = _rows(first, 5)
    resumed = GlobalBatches(tokens, 16, after, _sharding(4), shuffle_seed=3, repeat=True)
    resumed.iterator.set_state(first.iterator.get_state())
    assert resumed.position() == 5 * before
    np.testing.assert_array_equal(np.concatenate([read, _rows(resumed, 4)]), uninterrupted)


def test_a_checkpoint_counting_global_batches_resumes_at_its_sequence_under_another_batch(tmp_path):
    """Checkpoints written until 2026-12-05 hold grain's position, a count of global batches of the size in their meta
    item: 4 batches of 8, resumed at 16, go on at sequence 32 of the stream they counted, shuffled with data.seed as it
    was then (no seed scheme recorded)."""
    from jaxtrain.checkpoint import DataPositionHandler

    step = tmp_path / "4"
    (step / "data").mkdir(parents=True)
    (step / "meta").mkdir()
    (step / "data" / "process_0-of-1.json").write_text(json.dumps({"next_index": 4}))
    (step / "meta" / "metadata").write_text(json.dumps({"step": 4, "config": {"train": {"global_batch": 8}}}))
    tokens = np.arange(16 * 200 + 1) % 251
    resumed = GlobalBatches(tokens, 16, 16, _sharding(4), shuffle_seed=3, repeat=True)
    DataPositionHandler().restore(step / "data", resumed.iterator)
    assert resumed.position() == 32
    uninterrupted = _rows(_plain_seeds(GlobalBatches(tokens, 16, 8, _sharding(4), shuffle_seed=3, repeat=True)), 6)
    np.testing.assert_array_equal(_rows(resumed, 1), uninterrupted[32:])


@pytest.mark.parametrize("read, after", [(2, 8), (3, 8), (3, 12)])
def test_each_epoch_has_its_own_order_and_a_resume_in_the_second_reads_on_exactly(read, after, tmp_path):
    """20 sequences in batches of 8: each epoch reads every sequence once, in an order of its own (grain reseeds its
    shuffle per epoch), the same again for the same data.seed; a run resumed from the position saved after the batch
    that crosses into the second epoch (or before it) reads what the uninterrupted run reads, under another global
    batch too."""
    from jaxtrain.checkpoint import DataPositionHandler

    seq_len = 4
    tokens = np.arange(seq_len * 20 + 1) % 251

    def stream(global_batch):
        return GlobalBatches(tokens, seq_len, global_batch, _sharding(4), shuffle_seed=3, repeat=True)

    uninterrupted = _rows(stream(8), 8)  # 64 sequences: three epochs and the start of a fourth
    windows = uninterrupted[:, 0] // seq_len  # which window each row is: a window starts at token index * seq_len
    epochs = [tuple(windows[e * 20:(e + 1) * 20]) for e in range(3)]
    assert all(sorted(epoch) == list(range(20)) for epoch in epochs) and len(set(epochs)) == 3
    np.testing.assert_array_equal(_rows(stream(8), 8), uninterrupted)
    first = stream(8)
    _rows(first, read)
    DataPositionHandler().save(tmp_path, first.iterator)  # what a checkpoint keeps, read back by a new process
    resumed = DataPositionHandler().restore(tmp_path, stream(after).iterator)
    assert resumed.get_state() == {"sequences": 8 * read, SEED_SCHEME: SPREAD_SEEDS}
    np.testing.assert_array_equal(np.concatenate([np.asarray(next(resumed)["inputs"]) for _ in range(3)]),
                                  uninterrupted[8 * read:8 * read + 3 * after])


def test_nearby_seeds_share_no_epoch_order():
    """grain shuffles epoch e with its seed + e: with data.seed as grain's seed, seed 4's first epoch was seed 3's
    second, and a sweep over nearby seeds trained on the same orders. Spread, no two of seeds 0..1000 give any of their
    first 51 epochs the same grain seed, and the epochs of seeds 0..7 (20 sequences) are all different orders."""
    seq_len, count = 4, 20
    tokens = np.arange(seq_len * count + 1) % 251

    def epochs(seed, number=4):
        """The window order of each of the first ``number`` epochs."""
        rows = _rows(GlobalBatches(tokens, seq_len, 4, _sharding(4), shuffle_seed=seed, repeat=True), number * count // 4)
        return [tuple((rows[e * count:(e + 1) * count, 0] // seq_len).tolist()) for e in range(number)]

    by_seed = {seed: epochs(seed) for seed in range(8)}
    assert by_seed[3][1] != by_seed[4][0]
    assert len({order for orders in by_seed.values() for order in orders}) == 8 * 4
    assert len({(grain_seed(seed, SPREAD_SEEDS) + epoch) % 2**32 for seed in range(1001) for epoch in range(51)}) == 1001 * 51


@pytest.mark.parametrize("recorded", [False, True])
def test_a_position_resumes_the_order_of_its_seed_scheme(recorded, tmp_path):
    """A checkpoint written before data.seed was spread records no seed scheme: the run resumed from it, in its second
    epoch, reads on in the order it read before (grain's shuffle with data.seed itself), and records that scheme in its
    own checkpoints; a position written since resumes the spread order."""
    from jaxtrain.checkpoint import DataPositionHandler

    seq_len, count = 4, 20
    tokens = np.arange(seq_len * count + 1) % 251

    def stream():
        return GlobalBatches(tokens, seq_len, 8, _sharding(4), shuffle_seed=3, repeat=True)

    scheme = SPREAD_SEEDS if recorded else PLAIN_SEEDS
    uninterrupted = _rows(stream() if recorded else _plain_seeds(stream()), 6)
    order = np.asarray(grain.MapDataset.source(list(range(count))).shuffle(seed=grain_seed(3, scheme)).repeat()[:48])
    np.testing.assert_array_equal(uninterrupted[:, 0] // seq_len, order)  # grain's own order: the plain one is data.seed's
    first = stream() if recorded else _plain_seeds(stream())
    _rows(first, 3)
    DataPositionHandler().save(tmp_path, first.iterator)
    (written,) = tmp_path.glob("process_*.json")
    position = json.loads(written.read_text())
    assert position == {"sequences": 24, SEED_SCHEME: scheme}
    if not recorded:  # as a checkpoint of jaxtrain before the spread wrote it
        written.write_text(json.dumps({"sequences": 24}))
    resumed = stream()
    DataPositionHandler().restore(tmp_path, resumed.iterator)
    assert resumed.iterator.seed_scheme == scheme and resumed.iterator.get_state() == position
    np.testing.assert_array_equal(_rows(resumed, 3), uninterrupted[24:])


def test_a_position_under_an_unknown_seed_scheme_is_one_line(tmp_path):
    """A checkpoint written by a later jaxtrain, with a seed scheme this one lacks, resumed here: one line naming the
    scheme (it read as the other data.format's position: a KeyError)."""
    from jaxtrain.checkpoint import DataPositionHandler

    data_dir = tmp_path / "checkpoints" / "6" / "data"
    data_dir.mkdir(parents=True)
    (data_dir / "process_0-of-1.json").write_text(json.dumps({"sequences": 24, SEED_SCHEME: 7}))
    batches = GlobalBatches(np.arange(81) % 251, 4, 8, _sharding(4), shuffle_seed=3, repeat=True)
    with pytest.raises(UserError) as error:
        DataPositionHandler().restore(data_dir, batches.iterator)
    assert str(error.value) == (f"checkpoint {data_dir.parent} holds a data position under seed scheme 7, which this jaxtrain does "
                                f"not know (it knows 1, 2): resume it with the jaxtrain that wrote it, or start a new run from it "
                                f"with --init-from {data_dir.parent} (its data from the beginning)")


def test_every_process_saves_the_position_of_the_whole_batch():
    """4 processes of 2 devices each read a quarter of every batch, yet each saves the count of the sequences of the
    global batches read: a checkpoint's position is any process's file (DataPositionHandler), and a run resumed on
    another process count reads on from the next batch of the uninterrupted run."""
    tokens = np.arange(16 * 100 + 1) % 251
    sharding = _sharding(8)
    devices = list(sharding.mesh.devices.flat)
    per_process = [GlobalBatches(tokens, 16, 8, _ProcessView(sharding, devices[2 * p:2 * p + 2]), shuffle_seed=3, repeat=True)
                   for p in range(4)]
    for batches in per_process:
        for _ in range(3):
            next(batches.iterator)
    assert [b.position() for b in per_process] == [24] * 4
    resumed = GlobalBatches(tokens, 16, 8, sharding, shuffle_seed=3, repeat=True)
    resumed.iterator.set_state(per_process[1].iterator.get_state())
    uninterrupted = _rows(GlobalBatches(tokens, 16, 8, sharding, shuffle_seed=3, repeat=True), 4)
    np.testing.assert_array_equal(_rows(resumed, 1), uninterrupted[24:])


def test_a_split_of_exactly_one_batch_is_enough():
    from jaxtrain.data import Corpus, check_sizes

    exactly = np.zeros(16 * 8 + 1, np.uint8)  # 8 sequences of 16, and the token the last one's targets end with
    check_sizes(Corpus(exactly, exactly, 256, "t"), DataConfig(seq_len=16), 8, 256)
    with pytest.raises(UserError, match=r"^the train split has 7 sequences of data.seq_len=16, fewer than one batch"):
        check_sizes(Corpus(exactly[:-1], exactly, 256, "t"), DataConfig(seq_len=16), 8, 256)


def test_hidden_directories_are_skipped_like_hidden_files(tmp_path):
    """A text directory's hidden directories (.git, Jupyter's .ipynb_checkpoints copies of the files beside them)
    hold no training text."""
    from jaxtrain.data import text_files

    docs = tmp_path / "docs"
    (docs / ".ipynb_checkpoints").mkdir(parents=True)
    (docs / "sub").mkdir()
    for name in ("a.txt", "sub/b.txt", ".ipynb_checkpoints/a-checkpoint.txt", ".hidden.txt"):
        (docs / name).write_text(name)
    assert text_files(docs) == [docs / "a.txt", docs / "sub" / "b.txt"]


def test_linked_directories_are_followed_once(tmp_path):
    """A linked directory's files are data, as a linked file's are (a QA report: a dataset linked into the corpus was
    left out without a word); a directory reached again (a link beside it, a loop back up the tree) is read once, under
    its own path."""
    from jaxtrain.data import text_files

    docs, elsewhere = tmp_path / "docs", tmp_path / "elsewhere"
    (docs / "real").mkdir(parents=True)
    elsewhere.mkdir()
    for name in ("real/a.txt", "../elsewhere/e.txt"):
        (docs / name).write_text(name)
    (docs / "linked").symlink_to(elsewhere)
    (docs / "again").symlink_to("real")  # sorts before it
    (docs / "real" / "up").symlink_to("..")  # a loop
    assert text_files(docs) == [docs / "linked" / "e.txt", docs / "real" / "a.txt"]


def test_every_process_reads_the_same_evaluation_batches():
    """26 validation sequences in batches of 8, 4 processes of 2 rows each: each process reads its rows of the 3 whole
    batches and stops (the first process read a fourth batch, of sequences 24 and 25, and a multi-process evaluation
    waited for the processes that had stopped)."""
    tokens = np.arange(16 * 26 + 1) % 251
    sharding = _sharding(8)
    devices = list(sharding.mesh.devices.flat)
    per_process = [list(GlobalBatches(tokens, 16, 8, _ProcessView(sharding, devices[2 * p:2 * p + 2]), shuffle_seed=None,
                                      repeat=False).iterator.batches) for p in range(4)]
    assert [len(batches) for batches in per_process] == [3] * 4
    rows = np.concatenate([np.concatenate([per_process[p][b]["inputs"] for p in range(4)]) for b in range(3)])
    np.testing.assert_array_equal(rows, np.stack([tokens[i * 16:i * 16 + 16] for i in range(24)]))


def test_an_epoch_is_the_training_splits_sequences_each_read_once_and_its_last_tokens_short_of_one_are_counted():
    """The epoch figure (start-up summary, each record's ``epoch``) is the training split's whole sequences: 20
    sequences of 16 tokens, the target after the last one and 5 tokens more are an epoch of 20 sequences = 2.5 steps
    of 8, 5 tokens never read; 20 sequences of the run's stream read each once, and a run resumed at 12 read with 2
    steps of 8 to go trains from epoch 0.6 to 1.4 (a QA report: no figure said how many steps an epoch is, nor which
    epoch a step is in)."""
    from jaxtrain.data import Corpus, epoch

    tokens = np.arange(16 * 20 + 1 + 5)
    cfg = DataConfig(seq_len=16)
    split = epoch(Corpus(tokens, tokens[:40], 512, "t"), cfg)
    assert (split.size, split.unit, split.left_out_tokens) == (20, "sequences", 5)
    rows = _rows(GlobalBatches(tokens, 16, 4, _sharding(4), shuffle_seed=3, repeat=True), split.size // 4)
    assert sorted(rows[:, 0].tolist()) == list(range(0, 16 * 20, 16))  # every window once: window i starts at token 16 i
    assert split.of(30) == 1.5
    assert split.summary(12, 3, 5, 8) == {"size": 20, "unit": "sequences", "left_out_tokens": 5, "steps": 2.5,
                                          "at_start": 0.6, "at_end": 1.4, "train_epochs": None, "train_steps": None}


@pytest.mark.parametrize("epochs, steps", [(1, 7), (2, 13), (0.45, 3), (1.12, 7), (1e-9, 1), (0.16, 1)])
def test_train_epochs_come_to_the_first_step_whose_batch_has_read_them(epochs, steps):
    """An epoch of 50 sequences, 8 a step: the run's own batches reach the epochs at the step counted and not before.
    1.12 epochs are 56 sequences exactly, the seventh step's end (in binary floating point 1.12 * 50 is
    56.00000000000001, a step more)."""
    from jaxtrain.data import Corpus, epoch, steps_for_epochs

    tokens = np.arange(16 * 50 + 1 + 5)
    cfg = DataConfig(seq_len=16)
    corpus = Corpus(tokens, tokens[:40], 1024, "t")
    assert steps_for_epochs(corpus, cfg, 8, _sharding(4), epochs) == steps
    batches, size = GlobalBatches(tokens, 16, 8, _sharding(4), shuffle_seed=0, repeat=True), epoch(corpus, cfg).size
    read = []
    for _ in range(steps):
        next(batches)
        read.append(batches.position() / size)
    assert read[-1] >= epochs and (steps == 1 or read[-2] < epochs)
