import gc
import json
import threading
import time

import numpy as np
import pytest
import torch

from ppt import data
from ppt.common import PPTError
from ppt.data import DataLoader
from ppt.shards import HEADER_BYTES, dataset_fingerprint, read_shard, write_shard

FP = "ab" * 32


def stream_with_docs(length: int, doc_every: int, vocab: int, seed: int = 0) -> np.ndarray:
    """EOT (0) first and every `doc_every` tokens; other tokens random in [1, vocab)."""
    tokens = np.random.default_rng(seed).integers(1, vocab, size=length)
    tokens[::doc_every] = 0
    return tokens


def unique_stream(length: int, start: int, doc_every: int) -> np.ndarray:
    """Every non-EOT token distinct (so a row's first token names it); EOT (0) at 0 and every doc_every."""
    tokens = np.arange(start, start + length)
    tokens[::doc_every] = 0
    return tokens


def row_ids(batch: tuple[torch.Tensor, ...]) -> list[int]:
    """With unique_stream, the first target (stream position i*T+1, never an EOT below) identifies row i."""
    return batch[1][:, 0].tolist()


# ---- shards --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab, itemsize", [(4096, 2), (65536, 2), (100_000, 4)])
def test_shard_round_trip(tmp_path, vocab, itemsize):
    tokens = stream_with_docs(1000, 37, vocab)
    tokens[5] = vocab - 1
    path = tmp_path / "train_00000.bin"
    write_shard(path, tokens, vocab_size=vocab, eot_id=0, fingerprint=FP, demo=True, tokenizer_name="demo-bpe")
    info, read = read_shard(path, expected_fingerprint=FP)
    np.testing.assert_array_equal(read, tokens)
    assert path.stat().st_size == HEADER_BYTES + itemsize * tokens.size
    assert (info.num_tokens, info.vocab_size, info.eot_id, info.dtype.itemsize) == (1000, vocab, 0, itemsize)
    assert (info.tokenizer_fingerprint, info.tokenizer_name, info.is_demo) == (FP, "demo-bpe", True)


def test_bad_magic_and_truncation_are_named(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 4096)
    with pytest.raises(PPTError, match="not a ppt shard.*prepare"):
        read_shard(junk)
    path = tmp_path / "train_00000.bin"
    write_shard(path, stream_with_docs(100, 10, 500), vocab_size=500, eot_id=0, fingerprint=FP, demo=False)
    with open(path, "r+b") as f:
        f.truncate(HEADER_BYTES + 150)
    with pytest.raises(PPTError, match="truncated shard.*re-run the prepare command that made it"):
        read_shard(path)


def test_fingerprint_mismatch_names_both_tokenizers(tmp_path):
    path = tmp_path / "train_00000.bin"
    tokens = stream_with_docs(100, 10, 500)
    write_shard(path, tokens, vocab_size=500, eot_id=0, fingerprint=FP, demo=True, tokenizer_name="demo-bpe-500")
    other = "cd" * 32
    with pytest.raises(PPTError) as err:
        read_shard(path, expected_fingerprint=other, expected_name="HuggingFaceTB/cosmo2-tokenizer")
    message = str(err.value)
    assert "demo-bpe-500" in message and "demo" in message and FP[:16] in message
    assert "cosmo2" in message and other[:16] in message


def test_write_rejects_tokens_outside_vocab_and_leaves_no_file(tmp_path):
    tokens = stream_with_docs(100, 10, 500)
    tokens[[7, 9]] = [500, 900]
    path = tmp_path / "train_00000.bin"
    with pytest.raises(PPTError, match="token id 500 at position 7"):
        write_shard(path, tokens, vocab_size=500, eot_id=0, fingerprint=FP, demo=False)
    with pytest.raises(PPTError, match="must start with EOT"):
        write_shard(path, np.arange(1, 10), vocab_size=500, eot_id=0, fingerprint=FP, demo=False)
    assert list(tmp_path.iterdir()) == []


def test_the_header_records_the_largest_token_id_and_the_loader_refuses_ids_beyond_the_models_vocab(make_token_dir):
    """Shards whose ids fit their header's vocab (65536) but not the model's (1000): refused when opened, before a
    single batch, instead of an IndexError in the embedding (on CUDA a device-side assert) mid-run."""
    tokens = stream_with_docs(400, 10, 1000)
    tokens[123] = 4321
    data_dir = make_token_dir({"train": [tokens]}, vocab_size=65536)
    info, _ = read_shard(data_dir / "train_00000.bin")
    assert info.max_token_id == 4321
    with pytest.raises(
        PPTError, match=r"train_00000\.bin holds token id 4321, but the model's vocabulary has 1000 ids"
    ):
        DataLoader(data_dir, "train", 2, 16, vocab_size=1000)
    assert DataLoader(data_dir, "train", 2, 16, vocab_size=4322).vocab_size == 4322


def test_shards_and_loader_states_of_an_older_format_are_refused_in_one_line(make_token_dir):
    """A header without the largest token id (flag bit 1 unset), a loader state without batch_size: refused."""
    path = make_token_dir({"train": [stream_with_docs(400, 10, 1000)]}, vocab_size=1000) / "train_00000.bin"
    raw = bytearray(path.read_bytes())
    raw[32:36] = (0).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(PPTError, match=r"train_00000\.bin was written by an older ppt.*prepare the data again"):
        DataLoader(path.parent, "train", 2, 16)
    write_shard(path, stream_with_docs(400, 10, 1000), vocab_size=1000, eot_id=0, fingerprint=FP, demo=False)
    loader = DataLoader(path.parent, "train", 2, 16)
    state = loader.state_dict()
    del state["batch_size"]
    with pytest.raises(PPTError, match="state lacks batch_size .*start the run again without --resume"):
        loader.load_state_dict(state)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_id_beyond_the_vocab_is_refused_before_its_shard_trains_even_if_the_header_says_otherwise(
    make_token_dir, prefetch
):
    """Damage after writing (a header that lies about the largest id) shows at the shard's first batch, whatever
    row holds the id, not when that row comes up mid-run; opening a split does not read every token of it."""
    tokens = stream_with_docs(400, 10, 1000)
    tokens[-5] = 3000  # in the last row
    path = make_token_dir({"train": [tokens]}, vocab_size=65536) / "train_00000.bin"
    raw = bytearray(path.read_bytes())
    raw[164:168] = (999).to_bytes(4, "little")  # the header's largest token id
    path.write_bytes(bytes(raw))
    loader = DataLoader(path.parent, "train", 4, 16, vocab_size=1000, prefetch=prefetch)
    with pytest.raises(PPTError, match=r"train_00000\.bin holds token id 3000, but the model's vocabulary has 1000"):
        next(loader)


def test_missing_data_dir_names_the_prepare_command(tmp_path):
    with pytest.raises(PPTError, match="does not exist.*scripts.prepare_fineweb"):
        DataLoader(tmp_path / "nowhere", "train", 2, 8)
    with pytest.raises(PPTError, match="no val shards.*scripts.prepare_fineweb"):
        DataLoader(tmp_path, "val", 2, 8)


# ---- loader --------------------------------------------------------------------------------------------------------


def test_packing_targets_shift_and_doc_pos_resets_at_eot(make_token_dir):
    vocab, T = 1000, 16
    streams = [stream_with_docs(500, 13, vocab, seed=1), stream_with_docs(301, 7, vocab, seed=2)]
    data_dir = make_token_dir({"train": streams}, vocab)
    loader = DataLoader(data_dir, "train", batch_size=4, seq_len=T)
    all_rows = {tuple(s[i * T : i * T + T + 1]) for s in streams for i in range((s.size - 1) // T)}
    for _ in range(10):
        inputs, targets, doc_pos = next(loader)
        assert inputs.dtype == targets.dtype == torch.int64 and doc_pos.dtype == torch.int32
        assert inputs.shape == targets.shape == doc_pos.shape == (4, T)
        for x, y, pos in zip(inputs.tolist(), targets.tolist(), doc_pos.tolist()):
            assert tuple([*x, y[-1]]) in all_rows  # row = T+1 consecutive stream tokens, targets = inputs shifted
            assert x[1:] == y[:-1]
            expected, current = [], 0
            for t, token in enumerate(x):
                current = 0 if (t == 0 or token == 0) else current + 1
                expected.append(current)
            assert pos == expected


def epoch_rows(data_dir, world_size, rank, seed=0, epoch=0, B=3, T=10):
    loader = DataLoader(data_dir, "train", B, T, rank=rank, world_size=world_size, seed=seed)
    rows = []
    while len(rows) < loader.rows_per_rank * (epoch + 1):
        rows += row_ids(next(loader))
    return rows[loader.rows_per_rank * epoch : loader.rows_per_rank * (epoch + 1)]


def test_ranks_are_disjoint_and_cover_the_same_rows(make_token_dir):
    T = 10
    streams = [unique_stream(401, 1, 1_000_000), unique_stream(241, 5000, 1_000_000), unique_stream(161, 9000, 10**6)]
    data_dir = make_token_dir({"train": streams}, 20_000)
    everything = {int(s[i * T + 1]) for s in streams for i in range((s.size - 1) // T)}
    assert len(everything) == 40 + 24 + 16
    one = epoch_rows(data_dir, 1, 0)
    assert sorted(one) == sorted(everything)  # an epoch visits every row once
    rank0, rank1 = epoch_rows(data_dir, 2, 0), epoch_rows(data_dir, 2, 1)
    assert not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1) == sorted(everything)
    # blocks of a batch (B=3) in turn over the same global order as world size 1: rank r's k-th batch is the
    # (2k + r)-th batch of one process; the 80 // 2 = 40 rows per rank hold 13 whole blocks, then one row each
    batches = lambda rows: [rows[i : i + 3] for i in range(0, len(rows), 3)]
    assert batches(rank0)[:13] == batches(one)[0:26:2] and batches(rank1)[:13] == batches(one)[1:26:2]
    assert (rank0[39], rank1[39]) == (one[78], one[79])
    # each epoch reshuffles from (seed, epoch); the seed changes the order, not the set
    assert sorted(epoch_rows(data_dir, 1, 0, epoch=1)) == sorted(everything)
    assert epoch_rows(data_dir, 1, 0, epoch=1) != one
    assert epoch_rows(data_dir, 1, 0, seed=1) != one and epoch_rows(data_dir, 1, 0) == one


def test_state_dict_resumes_the_same_batches_across_an_epoch_boundary(make_token_dir, capsys):
    streams = [unique_stream(201, 1, 50), unique_stream(151, 3000, 50)]
    data_dir = make_token_dir({"train": streams}, 10_000)
    make = lambda: DataLoader(data_dir, "train", batch_size=3, seq_len=10, rank=1, world_size=2, seed=7)
    loader = make()
    assert loader.rows_per_rank == 17
    for _ in range(4):
        next(loader)
    saved_epochs = []
    for _ in range(2):  # save mid epoch 0, then mid epoch 1; each round's batches cross an epoch boundary
        state = json.loads(json.dumps(loader.state_dict()))
        saved_epochs.append(state["epoch"])
        expected = [next(loader) for _ in range(6)]
        resumed = make()
        resumed.load_state_dict(state)
        for want, got in zip(expected, (next(resumed) for _ in range(6))):
            for a, b in zip(want, got):
                assert torch.equal(a, b)
    assert saved_epochs == [0, 1] and loader.epoch == 2
    other_world = DataLoader(data_dir, "train", batch_size=3, seq_len=10, world_size=1, seed=7)
    with pytest.raises(PPTError, match="world_size=2"):
        other_world.load_state_dict(state)
    other_batch = DataLoader(data_dir, "train", batch_size=2, seq_len=10, rank=1, world_size=2, seed=7)
    other_batch.load_state_dict(state)
    assert "saved with batch_size=3, this run has 2" in capsys.readouterr().err


def assert_same_batches(got, want):
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_resume_is_exact_while_the_prefetcher_runs_ahead(make_token_dir):
    data_dir = make_token_dir({"train": [unique_stream(201, 1, 50), unique_stream(151, 3000, 50)]}, 10_000)
    make = lambda prefetch: DataLoader(data_dir, "train", batch_size=3, seq_len=10, seed=7, prefetch=prefetch)
    reference = make(0)  # built in next(), no thread: the order everything must match
    expected, states = [], [reference.state_dict()]
    for _ in range(30):  # 90 rows: past two epoch boundaries (35 rows each)
        expected.append(next(reference))
        states.append(reference.state_dict())

    loader = make(4)
    assert_same_batches([next(loader) for _ in range(5)], expected[:5])
    wait_for(lambda: loader._batches._queue.full())  # 4 batches built beyond the 5 returned
    assert loader.state_dict() == states[5]  # the state counts what was returned, not what was prefetched
    resumed = make(4)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert_same_batches([next(resumed) for _ in range(25)], expected[5:])
    assert_same_batches([next(loader) for _ in range(10)], expected[5:15])
    # loading a state into a running loader drops what it prefetched and rewinds
    wait_for(lambda: loader._batches._queue.full())
    loader.load_state_dict(states[2])
    assert_same_batches([next(loader) for _ in range(4)], expected[2:6])
    assert loader.state_dict() == states[6]


def prefetch_thread_of(loader):
    before = set(threading.enumerate())
    batch = next(loader)
    (thread,) = set(threading.enumerate()) - before
    return thread, batch


def test_prefetch_thread_is_a_daemon_that_stops_on_close_collection_and_error(make_token_dir, monkeypatch):
    data_dir = make_token_dir({"train": [unique_stream(201, 1, 50)]}, 10_000)
    loader = DataLoader(data_dir, "train", batch_size=2, seq_len=10, prefetch=2)
    thread, _ = prefetch_thread_of(loader)
    assert thread.daemon and thread.is_alive()
    loader.close()
    assert not thread.is_alive()
    thread, _ = prefetch_thread_of(loader)  # next() after close starts a new one where the last batch ended
    assert loader.state_dict()["position"] == 4
    del loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()  # a dropped loader does not leave its thread blocked on a full queue

    build = data._RowSource.build
    calls = []

    def failing_build(self, locations):
        calls.append(locations)
        if len(calls) == 4:  # with 2 batches queued, the thread is still blocked when the first is returned
            raise OSError("disk went away")
        return build(self, locations)

    monkeypatch.setattr(data._RowSource, "build", failing_build)
    loader = DataLoader(data_dir, "train", batch_size=2, seq_len=10, prefetch=2)
    thread, _ = prefetch_thread_of(loader)
    next(loader), next(loader)
    with pytest.raises(OSError, match="disk went away"):
        next(loader)
    thread.join(timeout=5)
    assert not thread.is_alive() and loader.state_dict()["position"] == 6
    with pytest.raises(PPTError, match="prefetch"):
        DataLoader(data_dir, "train", batch_size=2, seq_len=10, prefetch=-1)


def test_val_batches_fixed_order_and_budget(make_token_dir):
    T = 10
    val = [unique_stream(101, 1, 10**6), unique_stream(51, 500, 10**6)]  # 10 + 5 rows
    data_dir = make_token_dir({"train": [unique_stream(101, 2000, 10**6)], "val": val}, 10_000)
    file_order = [int(s[i * T + 1]) for s in val for i in range((s.size - 1) // T)]
    loader = DataLoader(data_dir, "val", batch_size=4, seq_len=T)
    rows = [r for batch in loader.val_batches(12 * T + 5) for r in row_ids(batch)]
    assert rows == file_order[:12]
    assert [r for batch in loader.val_batches(10**9) for r in row_ids(batch)] == file_order
    # two ranks split the same budget round robin, with equal batch counts
    shares = [
        [row_ids(b) for b in DataLoader(data_dir, "val", 4, T, rank=r, world_size=2).val_batches(12 * T)]
        for r in (0, 1)
    ]
    assert len(shares[0]) == len(shares[1]) == 2
    assert sum(shares[0], []) == file_order[0:12:2] and sum(shares[1], []) == file_order[1:12:2]
    with pytest.raises(PPTError, match="less than one row"):
        next(loader.val_batches(T - 1))


def test_loader_checks_tokenizer_fingerprint_and_dataset_fingerprint_tracks_content(make_token_dir):
    data_dir = make_token_dir({"train": [stream_with_docs(200, 9, 300)], "val": [stream_with_docs(50, 9, 300)]}, 300)
    with pytest.raises(PPTError, match="test-tokenizer.*expects"):
        DataLoader(data_dir, "train", 2, 8, expected_fingerprint="cd" * 32)
    loader = DataLoader(data_dir, "train", 2, 8, expected_fingerprint=FP)
    before = loader.fingerprint()
    assert before == dataset_fingerprint(data_dir)
    changed = stream_with_docs(200, 9, 300, seed=5)
    write_shard(data_dir / "train_00000.bin", changed, vocab_size=300, eot_id=0, fingerprint=FP, demo=False)
    assert dataset_fingerprint(data_dir) != before


def test_too_little_data_for_one_row_per_rank(make_token_dir):
    data_dir = make_token_dir({"train": [stream_with_docs(30, 9, 300)]}, 300)
    with pytest.raises(PPTError, match="too few for one row"):
        DataLoader(data_dir, "train", 2, 16, rank=1, world_size=2)
