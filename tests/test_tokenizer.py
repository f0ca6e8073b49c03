"""The byte-level tokenizer make_model writes: any text round-trips; streaming never splits a character."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.cli.make_model import EOS_ID, SPECIAL_TOKENS, make_model
from coordinator.text.tokenizer import TOKENIZER_NAME, StreamDecoder, TextCodec, TokenizerError, bytes_to_unicode

# No surrogates (not encodable), and no U+FFFD: StreamDecoder treats a trailing
# U+FFFD as "character not complete yet", so real ones are only held back.
# text that spells a special token ("<|im_start|>") encodes to that token, by design: keep it out
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"),
               max_size=60).filter(lambda s: "<|" not in s)

SAMPLES = [
    "",
    "hello, world",
    "😀🎉👨‍👩‍👧‍👦",
    "日本語のテキスト、中文文本，한국어",
    "\x00\x01\x07\t\n\r\x1b\x7f",
    "mixed: é ß ∑ 𝄞 \u200b end",
    "  leading and trailing spaces  ",
]


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    d = make_model(tmp_path_factory.mktemp("tok") / "m")
    c = TextCodec.load(d)
    assert c is not None
    return c


def test_byte_alphabet_is_a_bijection():
    m = bytes_to_unicode()
    assert sorted(m) == list(range(256))
    assert len(set(m.values())) == 256


@pytest.mark.parametrize("text", SAMPLES)
def test_samples_round_trip(codec, text):
    ids = codec.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert codec.decode(ids) == text


@settings(deadline=None, max_examples=200)
@given(TEXT)
def test_any_text_round_trips(codec, text):
    ids = codec.encode(text)
    assert ids == list(text.encode("utf-8"))  # one token per UTF-8 byte
    assert codec.decode(ids) == text


@settings(deadline=None, max_examples=100)
@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=80).filter(lambda s: "<|" not in s))
def test_ascii_ids_are_the_byte_values(codec, text):
    assert codec.encode(text) == [ord(ch) for ch in text]


def test_special_token_encodes_to_its_id_and_is_skipped_on_decode(codec):
    assert SPECIAL_TOKENS[0] == "<|endoftext|>" and EOS_ID == 256
    assert codec.encode("<|endoftext|>") == [256]
    ids = codec.encode("ab<|endoftext|>cd")
    assert ids == [ord("a"), ord("b"), 256, ord("c"), ord("d")]
    assert codec.decode(ids) == "abcd"
    assert codec.decode([256]) == ""
    assert codec.encode("<|im_start|>x<|im_end|>") == [257, ord("x"), 258]


def stream_pieces(codec, ids):
    stream = StreamDecoder(codec)
    pieces = [stream.push(i) for i in ids]
    return pieces, stream.flush()


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_byte_by_byte_samples(codec, text):
    ids = codec.encode(text)
    pieces, tail = stream_pieces(codec, ids)
    assert "".join(pieces) + tail == codec.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces + [tail])
    assert tail == ""  # valid UTF-8: everything was emitted by the time the last byte came


@settings(deadline=None, max_examples=150)
@given(TEXT)
def test_stream_byte_by_byte_never_emits_a_partial_character(codec, text):
    ids = codec.encode(text)
    pieces, tail = stream_pieces(codec, ids)
    assert "".join(pieces) + tail == codec.decode(ids) == text
    for p in pieces + [tail]:
        assert "\ufffd" not in p
    # a piece is emitted exactly when a character completes
    emitted_at = [k for k, p in enumerate(pieces) if p]
    boundaries = []
    pos = 0
    for ch in text:
        pos += len(ch.encode("utf-8"))
        boundaries.append(pos - 1)
    assert emitted_at == boundaries


def test_stream_skips_special_tokens(codec):
    ids = codec.encode("hi") + [EOS_ID]
    pieces, tail = stream_pieces(codec, ids)
    assert pieces == ["h", "i", ""] and tail == ""


def test_stream_flush_emits_an_incomplete_tail(codec):
    ids = list("é".encode()) + list("😀".encode())[:2]  # a complete character, then half of one
    pieces, tail = stream_pieces(codec, ids)
    assert pieces == ["", "é", "", ""]
    assert "".join(pieces) + tail == codec.decode(ids)
    assert tail.startswith("\ufffd")  # the incomplete bytes only come out at the end, as replacement


def test_load_without_tokenizer_json_is_none(tmp_path):
    assert TextCodec.load(tmp_path) is None


def test_corrupt_tokenizer_json_names_the_path(tmp_path):
    path = tmp_path / TOKENIZER_NAME
    path.write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=re.escape(str(path)) + ": cannot be read"):
        TextCodec.load(tmp_path)


def test_engine_without_tokenizer_refuses_text(tmp_path):
    from coordinator import Engine
    from coordinator.errors import StrataError

    d = make_model(tmp_path / "m")
    (d / TOKENIZER_NAME).unlink()
    with Engine.open(d) as engine:
        assert engine.codec is None
        with pytest.raises(StrataError, match="no tokenizer.json"):
            engine.encode("hi")
        assert len(engine.generate([1, 2, 3], 2)) == 2
