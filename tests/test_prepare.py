import contextlib
import errno
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ppt import locks, shard_writer, shards
from ppt.common import PPTError
from ppt.data import DataLoader
from ppt.shards import load_data_tokenizer, read_meta, read_shard
from ppt.sources import demo_documents
from ppt.tokenizer import Tokenizer, train_demo_tokenizer
from scripts import prepare_fineweb
from scripts.prepare_fineweb import main

WORDS = "the model reads tokens and writes shards café naïve €5 日本 🙂 data loader epoch".split()
SIZES = ["--shard-tokens", "1500", "--val-tokens", "1000"]


def make_docs(n: int = 120) -> list[str]:
    rng = random.Random(0)
    docs = [" ".join(rng.choices(WORDS, k=rng.randint(3, 60))) for _ in range(n)]
    docs[7] = ""  # empty documents are consumed but skipped
    return docs


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    return train_demo_tokenizer(make_docs(), vocab_size=300).save(tmp_path_factory.mktemp("tok"))


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)) + "\n")
    return path


def prepared_docs(data_dir) -> list[str]:
    """Every document of the val shard then the train shards, decoded; checks each stream starts with EOT."""
    tok = load_data_tokenizer(data_dir)
    meta = read_meta(data_dir)
    docs = []
    for split in ("val", "train"):
        for index in range(meta[split]["shards"]):
            info, tokens = read_shard(data_dir / f"{split}_{index:05d}.bin", expected_fingerprint=tok.fingerprint)
            assert tokens[0] == tokens[-1] == tok.eot_id
            eots = np.flatnonzero(np.asarray(tokens) == tok.eot_id)
            docs += [tok.decode(tokens[a + 1 : b].tolist()) for a, b in zip(eots[:-1], eots[1:])]
    return docs


def shard_bytes(data_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data_dir.iterdir()) if p.suffix in (".bin", ".json")}


def test_jsonl_prepare_keeps_every_document_once_in_order(tmp_path, tokenizer_path):
    docs = make_docs()
    out = tmp_path / "out"
    argv = ["--source", str(write_jsonl(tmp_path / "c.jsonl", docs)), "--out", str(out), "--workers", "1"]
    assert main([*argv, *SIZES, "--tokenizer", str(tokenizer_path)]) == 0
    nonempty = [d for d in docs if d]
    assert prepared_docs(out) == nonempty  # val first, then train: nothing lost, duplicated or reordered
    meta = read_meta(out)
    assert meta["val"]["shards"] == 1 and meta["train"]["shards"] >= 3
    assert meta["val"]["docs"] + meta["train"]["docs"] == len(nonempty)
    assert meta["val"]["docs_consumed"] + meta["train"]["docs_consumed"] == len(docs)
    assert meta["progress"]["exhausted"] and meta["progress"]["complete"]
    assert meta["tokenizer"]["is_demo"] is False and meta["tokenizer"]["name"] == str(tokenizer_path)

    tok = load_data_tokenizer(out)
    inputs, targets, doc_pos = next(DataLoader(out, "train", 4, 32, expected_fingerprint=tok.fingerprint))
    assert inputs.shape == (4, 32) and torch.equal(inputs[:, 1:], targets[:, :-1])


def test_parquet_on_two_workers_matches_jsonl_on_one(tmp_path, tokenizer_path, monkeypatch):
    monkeypatch.setattr(prepare_fineweb, "DOCS_PER_TASK", 16)  # many tasks, so order across workers matters
    docs = make_docs()
    common = [*SIZES, "--tokenizer", str(tokenizer_path)]
    jsonl, parquet = tmp_path / "jsonl", tmp_path / "parquet"
    argv = ["--source", str(write_jsonl(tmp_path / "c.jsonl", docs)), "--out", str(jsonl), "--workers", "1"]
    assert main([*argv, *common]) == 0
    pq.write_table(pa.table({"text": [*docs[:50], None, *docs[50:]]}), tmp_path / "c.parquet", row_group_size=32)
    argv = ["--source", str(tmp_path / "c.parquet"), "--out", str(parquet), "--workers", "2", *common]
    assert main(argv) == 0
    a, b = shard_bytes(jsonl), shard_bytes(parquet)
    assert [n for n in a if n.endswith(".bin")] == [n for n in b if n.endswith(".bin")]
    assert all(a[n] == b[n] for n in a if n.endswith(".bin"))
    assert prepared_docs(parquet) == [d for d in docs if d]


def test_demo_corpus_is_the_stdlib_documentation_and_the_same_in_a_fresh_process():
    from pydoc_data.topics import topics

    docs = demo_documents()
    assert sum(len(d.encode()) for d in docs) > 2_000_000  # a few MB, not the 0.5 MB of the help() topics alone
    assert topics["if"] in docs and topics["if"] != docs[0]  # topics are documents whole, in a fixed mixed order
    json_doc = next(d for d in docs if d.startswith("module json\n"))
    assert "JSON (JavaScript Object Notation)" in json_doc and "comments in the source of json\n" in json_doc
    # parameter names only: a default's repr can be anything (cgi's defaults hold the whole os.environ)
    heading = "def json.dumps(obj, *, skipkeys, ensure_ascii, check_circular, allow_nan, cls, indent, separators, "
    assert heading in json_doc
    assert len(set(docs)) == len(docs)

    # two fresh processes, other hash seeds, a secret in the environment: the same corpus, and no secret in it.
    # (Fresh, because a host that patches stdlib hooks, as pytest does, changes what this process would document.)
    secret = "ppt-secret-value-that-must-not-leak"
    code = (
        "import hashlib; from ppt.sources import demo_documents; docs = demo_documents(); "
        f"print(hashlib.sha256(chr(0).join(docs).encode()).hexdigest(), any({secret!r} in d for d in docs))"
    )
    root = Path(__file__).resolve().parents[1]
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed, "PPT_TEST_SECRET": secret},
            cwd=root,
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2")
    ]
    outputs = [run.communicate(timeout=120)[0].split() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert outputs[0] == outputs[1] and outputs[0][1] == "False"


def test_demo_end_to_end_and_rerun_is_a_no_op(demo_data_dir, capsys):
    meta = read_meta(demo_data_dir)
    tok = load_data_tokenizer(demo_data_dir)
    assert tok.is_demo and tok.name == "demo-bpe-512" and meta["tokenizer"]["fingerprint"] == tok.fingerprint
    assert meta["source"] == "demo" and meta["progress"]["exhausted"] and meta["train"]["shards"] >= 5
    info, _ = read_shard(demo_data_dir / "train_00000.bin", expected_fingerprint=tok.fingerprint)
    assert info.is_demo and info.tokenizer_name == "demo-bpe-512" and info.dtype.itemsize == 2
    loader = DataLoader(demo_data_dir, "val", 2, 64, expected_fingerprint=tok.fingerprint)
    assert sum(batch[0].numel() for batch in loader.val_batches(10 * 64)) == 10 * 64
    docs = demo_documents()
    val_docs = meta["val"]["docs"]
    assert prepared_docs(demo_data_dir)[: val_docs + 1] == docs[: val_docs + 1]  # val: the first documents

    before = shard_bytes(demo_data_dir)
    argv = ["--source", "demo", "--out", str(demo_data_dir), "--vocab-size", "512", "--workers", "1"]
    assert main([*argv, "--shard-tokens", "8000", "--val-tokens", "4000"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert shard_bytes(demo_data_dir) == before


def test_interrupted_prepare_resumes_to_the_same_shards(tmp_path, tokenizer_path, capsys):
    docs = make_docs()
    corpus = write_jsonl(tmp_path / "c.jsonl", [*docs, *docs[::7]])  # copies after the resume point: dropped too
    common = ["--source", str(corpus), *SIZES, "--tokenizer", str(tokenizer_path), "--workers", "1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main([*common, "--out", str(whole)]) == 0
    # stop after two train shards, then leave what a kill mid-write leaves: a temp file and a shard written after
    # the last progress update (here stale, from another shard)
    assert main([*common, "--out", str(resumed), "--shards", "2"]) == 0
    assert read_meta(resumed)["train"]["shards"] == 2
    (resumed / "train_00002.bin").write_bytes((resumed / "train_00000.bin").read_bytes())
    (resumed / ".train_00003.bin.1234.tmp").write_bytes(b"partial")
    assert main([*common, "--out", str(resumed)]) == 0
    assert "resuming" in capsys.readouterr().out
    assert shard_bytes(resumed) == shard_bytes(whole)
    assert not list(resumed.glob(".*.tmp"))
    assert read_meta(whole)["train"]["duplicates"] == len(docs[::7]) - 1  # the empty document is no duplicate


def test_exact_duplicate_documents_are_dropped_and_counted_val_copies_first(tmp_path, tokenizer_path, capsys):
    """A folder of .txt documents beside a .jsonl of the same texts (and repeats within it): each text is kept once,
    the first time it comes; the copies of val documents in train are counted apart in meta.json and the summary."""
    docs = [d for d in make_docs(40) if d]
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "all.jsonl", [*docs, *docs[10:14]])  # read first (sorted by path): val comes from it
    for i, doc in enumerate(docs):
        (folder / f"doc{i:02d}.txt").write_text(doc)
    out = tmp_path / "out"
    argv = ["--source", str(folder), "--out", str(out), "--shard-tokens", "400", "--val-tokens", "200"]
    assert main([*argv, "--tokenizer", str(tokenizer_path), "--workers", "1"]) == 0
    assert prepared_docs(out) == docs
    meta = read_meta(out)
    val_docs = meta["val"]["docs"]
    assert 0 < val_docs < 10
    assert (meta["val"]["duplicates"], meta["train"]["duplicates"]) == (0, 4 + len(docs))
    assert meta["train"]["duplicates_of_val"] == val_docs  # each val document's .txt copy
    assert (
        f"exact-duplicate documents dropped: {val_docs} copies of val documents in train, {4 + len(docs) - val_docs} "
        "repeats within train, 0 within val" in capsys.readouterr().out
    )


@pytest.mark.parametrize("damage", ["delete", "truncate", "delete val", "bad id"])
def test_a_lost_shard_stops_training_and_the_rerun_of_prepare_rebuilds_it(tmp_path, tokenizer_path, capsys, damage):
    """meta.json records the shards: a missing one stops the loader with the fix, a missing or truncated one is
    rebuilt by the same prepare command (also asked for fewer --shards than were made), the same bytes as before."""
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs())
    out = tmp_path / "out"
    argv = ["--source", str(corpus), "--out", str(out), *SIZES, "--tokenizer", str(tokenizer_path), "--workers", "1"]
    assert main([*argv, "--shards", "3"]) == 0
    before = shard_bytes(out)
    lost = out / ("val_00000.bin" if damage == "delete val" else "train_00001.bin")
    if damage == "truncate":
        lost.write_bytes(lost.read_bytes()[:-10])
        with pytest.raises(PPTError, match=r"train_00001\.bin: truncated shard .*re-run the prepare command"):
            DataLoader(out, "train", 2, 16)
    elif damage == "bad id":  # a flipped bit deep in the tokens: found when the shard is first used, not at its row
        raw = bytearray(lost.read_bytes())
        raw[-20:-18] = (60_000).to_bytes(2, "little")
        lost.write_bytes(bytes(raw))
        loader = DataLoader(out, "train", 2, 16, vocab_size=300, prefetch=0)
        with pytest.raises(
            PPTError, match=r"train_00001\.bin holds token id 60000, but the model's vocabulary has 300"
        ):
            for _ in range(loader.rows_per_rank):  # until a batch draws from the damaged shard
                next(loader)
    else:
        lost.unlink()
        split = lost.name.split("_")[0]
        message = rf"lacks {lost.name} of the \d {split} shards its meta\.json records; re-run the prepare command"
        with pytest.raises(PPTError, match=message):
            DataLoader(out, split, 2, 16)
    capsys.readouterr()
    assert main([*argv, "--shards", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"{lost} is {'missing' if damage.startswith('delete') else 'damaged'}: writing it" in printed
    assert "nothing to do" not in printed and shard_bytes(out) == before


def test_long_documents_reach_the_tokenizer_in_pieces_with_the_tokens_they_have_whole(
    tmp_path, tokenizer_path, monkeypatch
):
    """The tokenizer needs about 140 bytes of memory per character it takes at once (a 50 MB one-line document took
    6.4 GB), so it takes about PIECE_CHARS characters a call; cut before a space between two non-space characters,
    the pieces give the tokens of the whole document: with pieces of 64 characters, the same data fingerprint."""
    docs = [*make_docs(), "two  spaces,\n\nlines\tand tabs 12 345 , then  ' quotes' " * 30]
    argv = ["--source", str(write_jsonl(tmp_path / "c.jsonl", docs)), *SIZES, "--tokenizer", str(tokenizer_path)]
    assert main([*argv, "--out", str(tmp_path / "whole"), "--workers", "1"]) == 0
    calls = []
    encode_batch = Tokenizer.encode_batch
    monkeypatch.setattr(shard_writer, "PIECE_CHARS", 64)
    monkeypatch.setattr(Tokenizer, "encode_batch", lambda tok, texts: calls.append(texts) or encode_batch(tok, texts))
    assert main([*argv, "--out", str(tmp_path / "pieces"), "--workers", "1"]) == 0
    assert max(len(piece) for texts in calls for piece in texts) <= 64 and max(map(len, map("".join, calls))) < 128
    assert sum(map(len, calls)) > 2 * len(docs)  # most documents were cut
    assert shards.dataset_fingerprint(tmp_path / "pieces") == shards.dataset_fingerprint(tmp_path / "whole")


def test_dataset_fingerprint_is_the_content_not_the_paths(tmp_path, tokenizer_path):
    """The same documents through a copy of the tokenizer at another path, into another directory: the same
    fingerprint (the headers differ: they name the tokenizer's path). Other tokens or another split: another one."""
    copy = tmp_path / "elsewhere" / "cosmo.json"
    copy.parent.mkdir()
    copy.write_bytes(tokenizer_path.read_bytes())
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs())
    other_docs = write_jsonl(tmp_path / "d.jsonl", make_docs()[::-1])
    runs = {
        "a": [corpus, tokenizer_path, SIZES],
        "b": [corpus, copy, SIZES],
        "other tokens": [other_docs, tokenizer_path, SIZES],
        "other split": [corpus, tokenizer_path, ["--shard-tokens", "1500", "--val-tokens", "600"]],
    }
    for name, (source, tokenizer, sizes) in runs.items():
        argv = ["--source", str(source), "--tokenizer", str(tokenizer), *sizes, "--workers", "1"]
        assert main([*argv, "--out", str(tmp_path / name)]) == 0
    fingerprints = {name: shards.dataset_fingerprint(tmp_path / name) for name in runs}
    assert (tmp_path / "a" / "val_00000.bin").read_bytes() != (tmp_path / "b" / "val_00000.bin").read_bytes()
    assert fingerprints["a"] == fingerprints["b"]
    assert len(set(fingerprints.values())) == 3


def test_a_reader_of_a_directory_a_prepare_is_still_starting_is_told_to_wait(tmp_path):
    lock = locks.lock_directory(tmp_path / "data", "pass another --out")  # as prepare holds it, before meta.json
    try:
        with pytest.raises(PPTError, match=rf"^{tmp_path / 'data'} is being written by a prepare \(pid \d+ .*\); wait "
                           "for it to finish$"):  # fmt: skip
            load_data_tokenizer(tmp_path / "data")
    finally:
        lock.release()
    with pytest.raises(PPTError, match="meta.json is missing; create it with"):
        load_data_tokenizer(tmp_path / "data")


def test_resume_refuses_different_settings(tmp_path, tokenizer_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs())
    common = ["--source", str(corpus), "--out", str(tmp_path / "out"), "--tokenizer", str(tokenizer_path)]
    assert main([*common, *SIZES, "--shards", "1", "--workers", "1"]) == 0
    assert main([*common, "--shard-tokens", "1500", "--val-tokens", "999"]) == 2
    assert "was prepared with settings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "docs, sizes, message",
    [
        (["", "  \n"], SIZES, "no documents"),
        (["one short document"], [], "holds one document, .* split it into several"),
        (["one document", "one document"], [], r"holds one document \(1 exact duplicates dropped\)"),
        (make_docs(), ["--val-tokens", "10000000"], "too small"),
        ([" ".join(WORDS * 60), "short"], SIZES, r"the first document \(2,6\d\d tokens\) .* fills a train shard by"),
    ],
)
def test_unusable_corpus_fails_and_leaves_nothing(tmp_path, tokenizer_path, capsys, docs, sizes, message):
    out = tmp_path / "new" / "out"
    argv = ["--source", str(write_jsonl(tmp_path / "c.jsonl", docs)), "--out", str(out), *sizes, "--workers", "1"]
    assert main([*argv, "--tokenizer", str(tokenizer_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err)
    assert not (tmp_path / "new").exists()  # no directory it made, parents included


def test_a_document_longer_than_the_val_split_goes_to_train_and_a_resume_agrees(tmp_path, tokenizer_path, capsys):
    """A huge document first in the stream cannot take the corpus into val: val takes no document longer than its
    plan (a note says so) and stays below twice it; a resume knows which early documents went to train, so it counts
    the later copies as the whole run does."""
    big = " ".join(WORDS * 30)  # 1,320 tokens: longer than the val split (1,000), shorter than a train shard
    docs = [d for d in make_docs() if d]
    corpus = write_jsonl(tmp_path / "c.jsonl", [big, *docs, big, *docs[:3]])  # a copy of a train document, of val ones
    common = ["--source", str(corpus), *SIZES, "--tokenizer", str(tokenizer_path), "--workers", "1"]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    assert re.search(r"note: the val split \(1,000 tokens planned\) takes no document longer than itself: 1 went to "
                     r"train, and val holds 1,\d{3} tokens\n", capsys.readouterr().out)  # fmt: skip
    meta = read_meta(tmp_path / "whole")
    assert meta["val"]["tokens"] < 2000 and meta["progress"]["val_passed_over"] == [0]
    in_val = meta["val"]["docs"]
    assert prepared_docs(tmp_path / "whole") == [*docs[:in_val], big, *docs[in_val:]]
    assert (meta["train"]["duplicates_of_val"], meta["train"]["duplicates"]) == (3, 4)
    assert main([*common, "--out", str(tmp_path / "resumed"), "--shards", "2"]) == 0
    assert main([*common, "--out", str(tmp_path / "resumed")]) == 0
    assert shard_bytes(tmp_path / "resumed") == shard_bytes(tmp_path / "whole")


def test_where_no_document_is_as_short_as_the_val_split_val_holds_the_first(tmp_path, tokenizer_path, capsys):
    books = [" ".join(WORDS * n) for n in (30, 40, 50)]
    argv = ["--source", str(write_jsonl(tmp_path / "c.jsonl", books)), "--out", str(tmp_path / "out")]
    assert main([*argv, "--val-tokens", "100", "--tokenizer", str(tokenizer_path), "--workers", "1"]) == 0
    assert "note: no document came shorter than the val split (100 tokens planned)" in capsys.readouterr().out
    assert prepared_docs(tmp_path / "out") == books and read_meta(tmp_path / "out")["val"]["docs"] == 1


def test_non_utf8_text_names_file_and_offset(tmp_path, tokenizer_path, capsys):
    good, bad = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("fine text " * 50)
    bad.write_bytes("caf\u00e9 ok, then ".encode() + b"\xff\xfe latin-1 bytes")
    argv = ["--source", str(tmp_path / "*.txt"), "--out", str(tmp_path / "out"), *SIZES]
    assert main([*argv, "--tokenizer", str(tokenizer_path), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "byte offset 15" in err and "re-encode it to UTF-8" in err


LINE = '{"text": "a line of text"}\n'  # a document in a .txt file and in a .jsonl one


@pytest.mark.parametrize(
    "content, message",
    [
        (LINE.encode("utf-16"), "is UTF-16 text, not UTF-8; re-encode it to UTF-8, e.g. `iconv -f utf-16 -t utf-8 u"),
        (LINE.encode("utf-16-le"), "is UTF-16 text, not UTF-8; re-encode it to UTF-8, e.g. `iconv -f utf-16le -t "),
        (bytes(64), "holds NUL bytes (the first at byte offset 0): binary data, not text; leave it out of --source\n"),
        (LINE.encode() + b"\0\1\2", f"holds NUL bytes (the first at byte offset {len(LINE)}): binary data"),
    ],
    ids=["utf-16", "utf-16le-without-a-mark", "nul-bytes", "text-then-binary"],
)
def test_utf16_and_nul_bytes_are_refused_with_the_fix(tmp_path, tokenizer_path, capsys, content, message):
    """Before, UTF-16 was advised `iconv -f latin1` (with a byte order mark) or read as text with NULs in it, and NUL
    bytes made a document."""
    (tmp_path / "a.txt").write_text("fine text " * 50)
    for name in ("u.txt", "u.jsonl"):
        (tmp_path / name).write_bytes(content)
        argv = ["--source", str(tmp_path / "a.txt"), str(tmp_path / name), "--out", str(tmp_path / "out"), *SIZES]
        assert main([*argv, "--tokenizer", str(tokenizer_path), "--workers", "1"]) == 2
        assert f"error: {tmp_path / name} {message}" in capsys.readouterr().err


def test_a_utf8_byte_order_mark_is_no_part_of_the_text(tmp_path, tokenizer_path):
    docs = [d for d in make_docs(30) if d]
    for i, doc in enumerate(docs):
        (tmp_path / f"d{i:02d}.txt").write_text(doc, encoding="utf-8-sig" if i % 2 else "utf-8")
    (tmp_path / "d99.txt").write_text(docs[0], encoding="utf-8-sig")  # a copy, but for its mark
    write_jsonl(tmp_path / "e.jsonl", docs[:2])
    (tmp_path / "e.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "e.jsonl").read_bytes())
    argv = ["--source", str(tmp_path / "*.txt"), str(tmp_path / "e.jsonl"), "--out", str(tmp_path / "out")]
    assert main([*argv, "--val-tokens", "200", "--tokenizer", str(tokenizer_path), "--workers", "1"]) == 0
    assert prepared_docs(tmp_path / "out") == docs
    assert read_meta(tmp_path / "out")["train"]["duplicates"] == 3


def test_globs_span_folders_and_links_to_nothing_are_named(tmp_path, tokenizer_path, capsys):
    books = [*write_books(tmp_path / "books"), "a book on top", "a book in a box"]
    (tmp_path / "books" / "top.txt").write_text(books[-2])
    (tmp_path / "books" / "shelf0" / "box").mkdir()
    (tmp_path / "books" / "shelf0" / "box" / "deep.txt").write_text(books[-1])
    (tmp_path / "books" / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    (tmp_path / "books" / "shelf0" / "loop.txt").symlink_to(tmp_path / "books" / "shelf0" / "loop.txt")
    common = ["--val-tokens", "500", "--tokenizer", str(tokenizer_path), "--workers", "1"]
    for name, source in [("glob", "books/**/*.txt"), ("folder", "books")]:
        assert main(["--source", str(tmp_path / source), "--out", str(tmp_path / name), *common]) == 0
        assert sorted(prepared_docs(tmp_path / name)) == sorted(books)
        where = f"--source '{tmp_path / source}'" if name == "glob" else str(tmp_path / source)
        note = f"note: {where}: left out 2 links that lead to no file (gone.txt, loop.txt)\n"
        assert note in capsys.readouterr().out


def test_a_folder_without_a_file_prepare_reads_is_refused_naming_the_suffixes_and_its_files(tmp_path, capsys):
    (tmp_path / "licences").mkdir()
    for name in ("LICENSE", "COPYING", "NOTICE.md"):
        (tmp_path / "licences" / name).write_text("Permission is hereby granted, free of charge, ...")
    argv = ["--source", str(tmp_path / "licences"), "--out", str(tmp_path / "out"), "--train-tokenizer"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'licences'} holds no .txt, .jsonl, .parquet file, the suffixes prepare reads, but 3 files "
        "of other names (COPYING, LICENSE, NOTICE.md); rename plain-text files to end in .txt (one document each), "
        "or pass another folder\n"
    )


def test_bad_sources_are_named(tmp_path, tokenizer_path, capsys):
    (tmp_path / "c.csv").write_text("text\nhello\n")
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    pq.write_table(pa.table({"text": make_docs()}), tmp_path / "whole.parquet")
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "whole.parquet").read_bytes()[:-100])
    cases = [
        (["--source", str(tmp_path / "cut.parquet")], "cut.parquet is not a readable parquet file ("),
        (["--source", str(tmp_path / "nothing*.jsonl")], "matches no file"),
        (["--source", str(tmp_path / "c.csv")], "unsupported file type"),
        (["--source", str(tmp_path / "c.jsonl")], "c.jsonl:2 has no string `text` field"),
        (["--source", "demo", str(tmp_path / "c.jsonl")], "not a mix"),
    ]
    for argv, message in cases:
        assert main([*argv, "--out", str(tmp_path / "out"), "--tokenizer", str(tokenizer_path)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("error: ")


def test_fineweb_unreachable_says_how_to_work_offline(tmp_path, tokenizer_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache: nothing to read offline
    out = tmp_path / "out"
    assert main(["--out", str(out), "--tokenizer", str(tokenizer_path)]) == 2
    err = capsys.readouterr().err
    assert "smollm-corpus" in err and "--source demo" in err and "HF_HUB_OFFLINE" in err
    assert not out.exists() or not any(out.iterdir())


# ---- a newcomer's own corpus ---------------------------------------------------------------------------------------


def write_books(folder, n: int = 12) -> list[str]:
    """A folder of plain-text "books" (one document each), in subfolders, with a file of another kind beside them."""
    rng = random.Random(1)
    books = [" ".join(rng.choices(WORDS, k=rng.randint(400, 900))) for _ in range(n)]
    for i, book in enumerate(books):
        path = folder / f"shelf{i % 2}" / f"book{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(book)
    (folder / "README.md").write_text("not a book")
    return books


def test_a_folder_of_text_with_its_own_tokenizer_and_a_val_split_sized_from_it(tmp_path, capsys):
    """No hub and no --val-tokens: the tokenizer is trained on the folder, the val split is 5% of it, and both are
    recorded; the folder's files are read in path order and the .md file is left out, with a note."""
    books = write_books(tmp_path / "books")
    out = tmp_path / "out"
    argv = ["--source", str(tmp_path / "books"), "--train-tokenizer", "--vocab-size", "300", "--workers", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "left out 1 files that are not .txt, .jsonl, .parquet (.md)" in printed
    assert re.search(r"corpus: 12 files, [\d.]+ kB of text, about [\d,]+ tokens .*; val split [\d,]+ tokens", printed)
    meta = read_meta(out)
    assert meta["tokenizer"]["name"] == "corpus-bpe-300" and meta["tokenizer"]["vocab_size"] == 300
    origin = meta["tokenizer"]["origin"]
    assert origin["kind"] == "trained on this corpus" and origin["vocab_size_asked"] == 300
    assert "12 documents" in origin["trained_on"] and "val included" in origin["trained_on"]
    total = meta["val"]["tokens"] + meta["train"]["tokens"]
    assert 0.03 * total < meta["settings"]["val_tokens"] < 0.07 * total  # about 5%, from the estimate
    order = sorted((tmp_path / "books").rglob("*.txt"))
    assert prepared_docs(out) == [p.read_text() for p in order] and sorted(books) == sorted(prepared_docs(out))


def test_shuffle_seed_mixes_the_documents_before_the_split_the_same_way_each_time(tmp_path):
    docs = make_docs(300)
    corpus = write_jsonl(tmp_path / "c.jsonl", docs)
    common = ["--source", str(corpus), "--train-tokenizer", "--vocab-size", "300", *SIZES, "--workers", "1"]
    for name, seed in [("a", "7"), ("b", "7"), ("plain", None)]:
        assert main([*common, "--out", str(tmp_path / name), *(["--shuffle-seed", seed] if seed else [])]) == 0
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    shuffled, plain = prepared_docs(tmp_path / "a"), prepared_docs(tmp_path / "plain")
    assert sorted(shuffled) == sorted(plain) == sorted(d for d in docs if d)
    val_docs = read_meta(tmp_path / "a")["val"]["docs"]
    assert shuffled[:val_docs] != plain[:val_docs]
    assert (
        read_meta(tmp_path / "a")["settings"]["shuffle_seed"] == 7
        and read_meta(tmp_path / "plain")["settings"]["shuffle_seed"] is None
    )


def test_a_val_split_the_corpus_cannot_hold_is_refused_before_tokenizing(tmp_path, tokenizer_path, capsys, monkeypatch):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs())
    monkeypatch.setattr(prepare_fineweb, "encode_in_order", lambda *a: pytest.fail("tokenized the corpus first"))
    argv = ["--source", str(corpus), "--out", str(tmp_path / "out"), "--val-tokens", "1e7", "--workers", "1"]
    assert main([*argv, "--tokenizer", str(tokenizer_path)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"error: the corpus is too small for --val-tokens 10,000,000, more than half of it \(1 file, about [\d.]+ kB "
        r"of text, about [\d,]+ tokens \([\d.]+ bytes per token on its first 1\.0 MB\)\); lower --val-tokens, e\.g\. "
        r"--val-tokens \d+ \(5%\)\n",
        err,
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--source", "demo", "--train-tokenizer"], "--train-tokenizer trains on local files; --source demo trains"),
        (["--train-tokenizer", "--tokenizer", "x.json"], "either --tokenizer .* or --train-tokenizer .*, not both"),
        (["--vocab-size", "512"], "--vocab-size is the size of a tokenizer prepare trains: add --train-tokenizer"),
        (["--source", "demo", "--shuffle-seed", "1"], "--shuffle-seed shuffles local files"),
        (["--source", "demo", "--tokenizer", "x.json"], "--source demo trains its own tokenizer; drop --tokenizer"),
    ],
)
def test_tokenizer_and_shuffle_flags_that_do_not_fit_the_source_are_refused(tmp_path, capsys, argv, message):
    if "--source" not in argv:
        argv = ["--source", str(write_jsonl(tmp_path / "c.jsonl", make_docs())), *argv]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


# ---- progress, full disk ---------------------------------------------------------------------------------------------


def test_progress_lines_when_not_on_a_terminal(tmp_path, tokenizer_path, capsys, monkeypatch):
    monkeypatch.setattr(prepare_fineweb, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(prepare_fineweb, "DOCS_PER_TASK", 16)
    argv = ["--source", str(write_jsonl(tmp_path / "c.jsonl", make_docs())), "--out", str(tmp_path / "out")]
    assert main([*argv, *SIZES, "--tokenizer", str(tokenizer_path), "--workers", "1"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokenizing:")]
    assert len(lines) >= 3
    pattern = r"tokenizing: \d+ shards written, [\d,]+ of about [\d,]+ tokens, [\d,]+ tokens/s, ETA (\d+[smhd])+"
    assert all(re.fullmatch(pattern, line) for line in lines), lines


@pytest.mark.parametrize("imported", ["after", "before"])
def test_no_progress_bar_is_drawn_off_a_terminal(tmp_path, tokenizer_path, imported):
    """Neither prepare's bar nor those of the hub's downloads and of datasets' streaming, whose redraws would pile up
    in a log as one endless line: stderr here is a pipe. Also where a caller of main imported those libraries first,
    before the settings main gives them through the environment could take effect."""
    argv = ["--source", str(write_jsonl(tmp_path / "c.jsonl", make_docs())), "--out", str(tmp_path / "out")]
    argv += [*SIZES, "--tokenizer", str(tokenizer_path), "--workers", "1"]
    libraries = "import datasets, huggingface_hub.utils as hub"
    code = (
        f"{libraries if imported == 'before' else ''}\nfrom scripts.prepare_fineweb import main\n"
        f"assert main({argv!r}) == 0\n{libraries}\n"
        "print(hub.are_progress_bars_disabled(), datasets.is_progress_bar_enabled())"
    )
    env = {key: value for key, value in os.environ.items() if "PROGRESS_BARS" not in key}
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-2:] == ["True", "False"] and "\r" not in run.stderr and "%|" not in run.stderr


class FillsUp:
    """Files that take `budget` bytes between them, then fail as a full disk does."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def wrap(self, f):
        disk = self

        class Limited:
            def write(self, data: bytes) -> int:
                if len(data) > disk.budget:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.budget -= len(data)
                return f.write(data)

            def __getattr__(self, name):
                return getattr(f, name)

        return Limited()


def test_a_full_disk_keeps_the_finished_shards_and_the_rerun_resumes(tmp_path, tokenizer_path, capsys, monkeypatch):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs())
    common = ["--source", str(corpus), *SIZES, "--tokenizer", str(tokenizer_path), "--workers", "1"]
    whole, full = tmp_path / "whole", tmp_path / "full"
    assert main([*common, "--out", str(whole)]) == 0
    real = shards.atomic_file
    disk = FillsUp(budget=12_000)  # shards and meta.json: the val shard, then about 2 of the 4-kB train shards

    @contextlib.contextmanager
    def filling(path):
        with real(path) as f:
            yield disk.wrap(f)

    with monkeypatch.context() as patched:
        patched.setattr(shards, "atomic_file", filling)  # shards and meta.json are written through it
        assert main([*common, "--out", str(full)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"error: could not write .*full/\S+ \(No space left on device\); the finished shards are kept\. Free space "
        r"\(a shard takes about [\d.]+ kB\) or pass another --out, then re-run the same command to resume\n",
        err,
    )
    assert not list(full.glob(".*.tmp")) and read_meta(full)["train"]["shards"] >= 1
    assert main([*common, "--out", str(full)]) == 0
    assert shard_bytes(full) == shard_bytes(whole)
