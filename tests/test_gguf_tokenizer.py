"""A GGUF file's tokenizer metadata built into a `tokenizers` Tokenizer: the same ids as the tokenizer it was
written from, on text that exercises the split regex, the merges and the special tokens; what is not supported
is named, and a tokenizer.json beside the file stands in for it."""

from __future__ import annotations

import shutil

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.model.gguf_tokenizer import LLAMA3, QWEN2, gguf_codec, gguf_tokenizer
from coordinator.model.tokenizer import TextCodec, TokenizerError
from shm.gguf_file import GgufFile

from gguf_writer import write_gguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog. It's 2026; isn't it?",
          "Über naïve café: 東京 and 大阪, 1234567 apples, 89 pears!!\n\n  indented\tline",
          "def main():\n    return x_1 + y_22 == 333  # done",
          "We'll see, they'd said; I'M SURE you've LL'd it."] * 20
TEXTS = ["The quick fox's 12345 tokens, isn't it?\n\n\n  spaced   out\t",
         "<|im_start|>user\nÜber café 東京 99<|im_end|>\n<|im_start|>assistant\n",
         "unseen wörds: zyxw 42!!! ...", ""]


def trained(regex: str, ignore_merges: bool = False) -> Tokenizer:
    """A small byte-level BPE of the kind Qwen's and Llama 3's tokenizer.json hold."""
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tok") / "m", seed=9, hidden_size=64, moe_intermediate_size=96,
                      vocab_size=512)


@pytest.mark.parametrize("pre, regex, ignore", [("qwen2", QWEN2, False), ("llama-bpe", LLAMA3, True)])
def test_the_metadata_builds_the_tokenizer_it_was_written_from(ckpt, tmp_path, pre, regex, ignore):
    want = trained(regex, ignore)
    path = tmp_path / "m.gguf"
    write_gguf(ckpt, path, tokenizer=want, pre=pre)
    got = gguf_tokenizer(GgufFile(path).metadata)
    assert got.get_vocab_size() == want.get_vocab_size()
    merged = 0
    for text in TEXTS + CORPUS[:4]:
        ids = want.encode(text).ids
        assert got.encode(text).ids == ids, text
        assert got.decode(ids, skip_special_tokens=False) == text
        merged += sum(i >= 256 + len(SPECIALS) for i in ids)
    assert merged > 20  # the merges were used, not only single bytes
    specials = got.encode(TEXTS[1]).ids
    assert specials[0] == want.token_to_id("<|im_start|>") and got.decode(specials).startswith("user")


def test_what_is_not_supported_is_named_and_a_tokenizer_json_beside_stands_in(ckpt, tmp_path):
    tok = trained(QWEN2)
    odd = tmp_path / "odd" / "m.gguf"
    odd.parent.mkdir()
    write_gguf(ckpt, odd, tokenizer=tok, pre="deepseek-v3")
    meta = GgufFile(odd).metadata
    with pytest.raises(TokenizerError, match=r"pre-tokenizer 'deepseek-v3' is not supported yet.*tokenizer.json"):
        gguf_codec(meta, odd)
    with pytest.raises(TokenizerError, match=r"tokenizer model 'llama' is not supported yet"):
        gguf_tokenizer({**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="2 tokens but 1 token types"):
        gguf_tokenizer({**meta, "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": ["a", "b"],
                        "tokenizer.ggml.token_type": [1]})
    # a merge whose pieces are not tokens (llama.cpp's converter can write one) is left out, as llama.cpp ignores it
    good = {**meta, "tokenizer.ggml.pre": "qwen2"}
    bad = {**good, "tokenizer.ggml.merges": ["zq9 xw8"] + list(meta["tokenizer.ggml.merges"])}
    assert "zq9" not in tok.get_vocab()
    assert gguf_tokenizer(bad).encode(TEXTS[0]).ids == gguf_tokenizer(good).encode(TEXTS[0]).ids == \
        tok.encode(TEXTS[0]).ids
    shutil.copy(ckpt / "tokenizer.json", odd.parent / "tokenizer.json")
    beside = gguf_codec(meta, odd)
    assert beside.tokenizer.to_str() == TextCodec.load(ckpt).tokenizer.to_str()


def test_the_engine_reads_text_through_the_files_tokenizer(ckpt, tmp_path):
    path = tmp_path / "m.gguf"  # no tokenizer.json beside it
    write_gguf(ckpt, path, tokenizer=TextCodec.load(ckpt).tokenizer, pre="default")
    with Engine.open(path, EngineConfig(pool="inproc")) as eng, Engine.open(ckpt, EngineConfig(pool="inproc")) as ref:
        text = "Hello, wörld! <|im_end|>"
        assert eng.codec.tokenizer.encode(text).ids == ref.codec.tokenizer.encode(text).ids
        assert eng.codec.tokenizer.token_to_id("<|im_end|>") == 258
