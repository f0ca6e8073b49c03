"""A GGUF file's tokenizer metadata built into a `tokenizers` Tokenizer: the same ids as the tokenizer it was
written from, on text that exercises the split regex, the merges and the special tokens; what is not supported
is named, and a tokenizer.json beside the file stands in for it."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.text.gguf_tokenizer import LLAMA3, QWEN2, gguf_codec, gguf_tokenizer
from coordinator.text.tokenizer import TextCodec, TokenizerError
from shm.gguf_file import GgufFile, metadata_value

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
    write_gguf(ckpt, odd, tokenizer=tok, pre="kimi-k2")
    meta = GgufFile(odd).metadata
    with pytest.raises(TokenizerError, match=r"pre-tokenizer 'kimi-k2' is not supported yet.*tokenizer.json"):
        gguf_codec(meta, odd)
    with pytest.raises(TokenizerError, match=r"tokenizer model 'bert' is not supported yet"):
        gguf_tokenizer({**meta, "tokenizer.ggml.model": "bert"})
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


# -- SentencePiece ("llama"): Mixtral's and Llama 2's tokenizer ------------------------------------------------


def spm_reference(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's llm_tokenizer_spm, written from its description: "▁" for every space and before the text,
    then join the adjacent pair whose joined piece is in the vocabulary with the highest score (the leftmost on
    a tie) until none is; a piece outside the vocabulary is its UTF-8 bytes' <0xXX> tokens. No text, no tokens."""
    if not text:
        return []
    symbols = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in vocab and (best is None or scores[vocab[joined]] > best[0]):
                best = (scores[vocab[joined]], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    ids = []
    for s in symbols:
        ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
    return ids


def spm_metadata() -> dict:
    """A SentencePiece BPE vocabulary as llama.cpp's converter writes one: <unk>, <s>, </s>, the 256 byte
    tokens, then pieces (trained here); their scores shuffled, so that which pair joins first decides the
    result far more often than with scores in training order."""
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)  # few whole words: most words are split
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.train_from_iterator(CORPUS, trainer)
    pieces = [p for p, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in np.random.default_rng(4).permutation(len(pieces))]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": scores}


def test_sentencepiece_metadata_tokenizes_as_llama_cpp():
    meta = spm_metadata()
    tok = gguf_tokenizer(meta)
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    joined = 0
    novel = ["quirky brownish foxes jumped overtly lazily", "indentations of 1234 appled pears", "东京 Übers ☃ x"]
    for text in TEXTS[:1] + TEXTS[2:] + CORPUS[:4] + novel:
        want = spm_reference(text, vocab, meta["tokenizer.ggml.scores"])
        assert tok.encode(text).ids == want, text
        assert tok.decode(want) == text
        joined += sum(i >= 259 and len(meta["tokenizer.ggml.tokens"][i]) > 1 for i in want)
    assert joined > 20
    snowman = tok.encode("☃").ids  # not in the vocabulary: its three UTF-8 bytes
    assert [meta["tokenizer.ggml.tokens"][i] for i in snowman][-3:] == ["<0xE2>", "<0x98>", "<0x83>"]
    assert tok.encode("<s>hi</s>").ids[0] == 1 and tok.encode("<s>hi</s>").ids[-1] == 2  # control tokens whole
    with pytest.raises(TokenizerError, match="3 scores"):
        gguf_tokenizer({**meta, "tokenizer.ggml.scores": [0.0, 0.0, 0.0]})


def test_sentencepiece_metadata_read_back_from_a_file(tmp_path):
    """Scores and types as the gguf writer stores them (float32, int32 arrays) and shm.gguf_file reads them."""
    meta = spm_metadata()
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    read = {k: metadata_value(f) for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.")}
    text = "quirky brownish foxes, 东京"
    assert gguf_tokenizer(read).encode(text).ids == gguf_tokenizer(meta).encode(text).ids


def test_sentencepiece_joins_the_highest_scoring_pair_first_on_random_vocabularies():
    """Overlapping pieces with random scores: which pair joins first decides the result ("abcd" with ab < cd <
    bc < bcd gives a|bcd, not ab|cd), so a conversion that ranked the merges otherwise would differ here."""
    rng = np.random.default_rng(5)
    alphabet = "\u2581abcde"
    for trial in range(20):
        pieces = sorted({"".join(rng.choice(list(alphabet), rng.integers(2, 5))) for _ in range(60)})
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(alphabet) + pieces
        types = [2, 3, 3] + [6] * 256 + [1] * (len(alphabet) + len(pieces))
        scores = [0.0] * 259 + [-1000.0] * len(alphabet) + [-float(i) for i in rng.permutation(len(pieces))]
        meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores}
        tok = gguf_tokenizer(meta)
        vocab = {t: i for i, t in enumerate(tokens)}
        for _ in range(20):
            text = "".join(rng.choice(list("abcde "), rng.integers(1, 24)))
            assert tok.encode(text).ids == spm_reference(text, vocab, scores), (trial, text)
    handmade = ["a", "b", "c", "d", "ab", "bc", "cd", "bcd"]
    tokens = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + handmade
    scores = [0.0] * 257 + [-100.0] * 5 + [-3.0, -1.0, -2.0, -0.5]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": [2] + [6] * 256 + [1] * 9, "tokenizer.ggml.add_space_prefix": False}
    assert [tokens[i] for i in gguf_tokenizer(meta).encode("abcd").ids] == ["a", "bcd"]
