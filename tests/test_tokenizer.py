import json

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from ppt.common import PPTError
from ppt.tokenizer import Tokenizer, load_tokenizer, train_demo_tokenizer

# Multi-byte text: 2-byte (é, ï), 3-byte (€, 日本), 4-byte (🙂) characters, repeated so BPE merges their bytes.
MULTILINGUAL = ["naïve café costs €5 or €10 🙂", "日本語のテキスト €€€ 🙂🙂", "plain ascii text about the café"] * 20


@pytest.fixture(scope="module")
def multilingual_tokenizer() -> Tokenizer:
    return train_demo_tokenizer(MULTILINGUAL, vocab_size=300)


def reference_byte_alphabet() -> dict[str, int]:
    """Byte-level character -> byte, learned from the library's own pre-tokenizer on valid UTF-8 characters."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    table = {}
    for code_point in [*range(0x80), *range(0x80, 0x800, 7), 0x800, 0x1000, 0x8000, 0xE000, 0x10000, 0x40000, 0x100000]:
        text = chr(code_point)
        [(spelled, _)] = pre.pre_tokenize_str(text)
        table.update(zip(spelled, text.encode("utf-8")))
    return table


def test_token_bytes_count_raw_bytes_of_partial_utf8_tokens(multilingual_tokenizer):
    tok = multilingual_tokenizer
    counts = tok.token_bytes()
    assert counts.dtype == torch.int32 and counts.shape == (tok.vocab_size,)
    assert counts[tok.eot_id] == 0

    alphabet = reference_byte_alphabet()
    partial = []
    for token, token_id in tok.backend.get_vocab().items():
        if token_id == tok.eot_id or not all(ch in alphabet for ch in token):
            continue
        raw = bytes(alphabet[ch] for ch in token)
        assert counts[token_id] == len(raw), token
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            partial.append((token_id, raw))
    # merges inside €, 日, 🙂 produce multi-byte tokens that are not whole characters; decoding them yields U+FFFD
    multi_byte_partials = [(i, raw) for i, raw in partial if len(raw) >= 2]
    assert multi_byte_partials, "the test corpus should produce a multi-byte partial UTF-8 token"
    for token_id, raw in multi_byte_partials:
        assert counts[token_id] == len(raw) != len(tok.decode([token_id]).encode("utf-8"))


def test_token_bytes_sum_to_utf8_length_of_text(multilingual_tokenizer):
    tok = multilingual_tokenizer
    counts = tok.token_bytes()
    texts = ["€ naïve 🙂 日本語", "unseen words: Zürich ∑ ∞ 🚀", "x"]
    for text, ids in zip(texts, tok.encode_batch(texts)):
        assert ids[-1] == tok.eot_id and tok.eot_id not in ids[:-1]
        assert tok.decode(ids[:-1]) == text
        assert int(counts[ids].sum()) == len(text.encode("utf-8"))


def test_added_tokens_count_zero_if_special_and_their_text_otherwise(multilingual_tokenizer):
    backend = BackendTokenizer.from_str(multilingual_tokenizer.backend.to_str())
    backend.add_special_tokens(["<|im_start|>"])
    backend.add_tokens(["<plain>"])
    tok = Tokenizer(backend, "with-added")
    counts = tok.token_bytes()
    assert counts[backend.token_to_id("<|im_start|>")] == 0
    assert counts[backend.token_to_id("<plain>")] == len("<plain>")


def test_demo_training_is_deterministic_and_fingerprint_survives_save(tmp_path, multilingual_tokenizer):
    again = train_demo_tokenizer(MULTILINGUAL, vocab_size=300)
    assert again.fingerprint == multilingual_tokenizer.fingerprint
    assert train_demo_tokenizer(MULTILINGUAL, vocab_size=290).fingerprint != again.fingerprint
    assert (again.name, again.is_demo, again.eot_id, again.vocab_size) == ("demo-bpe-300", True, 0, 300)

    path = again.save(tmp_path)
    # the fingerprint is over canonical JSON: re-indenting the file does not change it
    path.write_text(json.dumps(json.loads(path.read_text()), indent=4))
    for where in (tmp_path, path):
        loaded = load_tokenizer(where)
        assert loaded.fingerprint == again.fingerprint
        assert loaded.encode_batch(["€ café"]) == again.encode_batch(["€ café"])


def test_hub_name_offline_and_not_cached_says_how_to_work_offline():
    with pytest.raises(PPTError, match="HF_HUB_OFFLINE.*--source demo"):
        load_tokenizer("HuggingFaceTB/cosmo2-tokenizer")


def test_hub_name_loads_from_the_ppt_cache(offline_private_cache, multilingual_tokenizer):
    multilingual_tokenizer.save(offline_private_cache / "tokenizers" / "SomeOrg--some-tokenizer")
    tok = load_tokenizer("SomeOrg/some-tokenizer")
    assert tok.name == "SomeOrg/some-tokenizer" and not tok.is_demo
    assert tok.fingerprint == multilingual_tokenizer.fingerprint


@pytest.mark.parametrize("bad", ["missing/dir/tokenizer.json", "./nothing-here", "not-a-hub-name"])
def test_missing_local_path_raises(bad):
    with pytest.raises(PPTError, match="no tokenizer at"):
        load_tokenizer(bad)


def test_invalid_json_and_missing_eot_raise(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(PPTError, match="not a valid tokenizers JSON"):
        load_tokenizer(bad)
    no_eot = BackendTokenizer(models.BPE())
    with pytest.raises(PPTError, match="<\\|endoftext\\|>"):
        Tokenizer(no_eot, "no-eot")


def test_non_byte_level_tokenizer_has_no_byte_table():
    backend = BackendTokenizer(models.WordLevel({"<|endoftext|>": 0, "héllo": 1}, unk_token="<|endoftext|>"))
    with pytest.raises(PPTError, match="not a byte-level BPE"):
        Tokenizer(backend, "wordlevel").token_bytes()
