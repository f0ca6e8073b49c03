"""A GGUF file's tokenizer (its ``tokenizer.ggml.*`` metadata) as a `tokenizers` Tokenizer, as llama.cpp reads it.

    tokenizer.ggml.model        "gpt2": byte-level BPE (Qwen, DeepSeek, GLM)
                                "llama": SentencePiece BPE (Mixtral, Llama 2): pieces with scores, "▁" for a
                                space, unknown characters as <0xXX> byte tokens
                                others: not yet, named
    tokenizer.ggml.pre          which split regex runs before BPE, by name (llama.cpp's llama-vocab.cpp):
                                PRE_REGEX below; an unknown name is refused, never guessed
    tokenizer.ggml.tokens       the vocabulary, in id order (byte-level strings: GPT-2's byte alphabet)
    tokenizer.ggml.token_type   per token: 1 normal, 2 unknown, 3 control (special), 4 user-defined, 5 unused,
                                6 byte
    tokenizer.ggml.merges       "left right" per merge, in rank order (gpt2)
    tokenizer.ggml.scores       per token, its score (llama: the piece merged first has the highest)
    tokenizer.ggml.add_space_prefix     llama: a "▁" before the text (default true)

Control tokens become special added tokens (matched whole in the text, skipped when decoding with
skip_special_tokens), user-defined ones plain added tokens, as llama.cpp treats them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .tokenizer import TextCodec, TokenizerError

log = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
SPACE = "\u2581"  # SentencePiece's "▁"

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), the same strings Hugging Face's tokenizer.json files hold
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-V3/R1's: three splits in turn (digits by three, CJK runs, then the rest), as its tokenizer.json's
# Sequence of Split pre-tokenizers (CR and LF literal in the character classes, as published)
DEEPSEEK_V3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
               "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
               "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
PRE_REGEX = {"default": GPT2, "gpt-2": GPT2, "gpt2": GPT2, "qwen2": QWEN2, "llama3": LLAMA3, "llama-bpe": LLAMA3,
             "deepseek-v3": DEEPSEEK_V3,
             "glm4": LLAMA3}  # llama.cpp's CHATGLM4: Llama 3's split, its contractions' case spelled out
# a piece that is itself a token is taken whole (llama.cpp, and HF's files)
IGNORE_MERGES = {"llama3", "llama-bpe", "glm4"}


def has_tokenizer(metadata: dict) -> bool:
    return "tokenizer.ggml.tokens" in metadata


def gguf_tokenizer(metadata: dict, source: str = "the GGUF file") -> Tokenizer:
    """The Tokenizer the metadata describes; TokenizerError naming what is not supported."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(f"{source}: tokenizer model {kind!r} is not supported yet (byte-level BPE 'gpt2' and "
                             "SentencePiece 'llama' are); put the model's tokenizer.json beside the file")
    tokens = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
    types = list(metadata.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    if len(types) != len(tokens):
        raise TokenizerError(f"{source}: {len(tokens)} tokens but {len(types)} token types")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"{source}: the vocabulary repeats a token")
    if kind == "llama":
        tok = _sentencepiece(metadata, tokens, types, vocab, source)
    else:
        tok = _byte_level(metadata, vocab, source)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ttype in zip(tokens, types) if ttype == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ttype in zip(tokens, types) if ttype == USER_DEFINED])
    return tok


def _byte_level(metadata: dict, vocab: dict[str, int], source: str) -> Tokenizer:
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_REGEX:
        raise TokenizerError(f"{source}: pre-tokenizer {pre!r} is not supported yet (known: "
                             f"{', '.join(sorted(PRE_REGEX))}); put the model's tokenizer.json beside the file")
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise TokenizerError(f"{source}: a merge is not two tokens separated by a space")
    usable = [m for m in merges if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    if len(usable) < len(merges):  # llama.cpp falls back to the bytes of a merge that makes no token; so does this
        log.warning("%s: %d of %d merges make or use a piece that is not in the vocabulary; left out", source,
                    len(merges) - len(usable), len(merges))
        merges = usable
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES))
    regexes = PRE_REGEX[pre] if isinstance(PRE_REGEX[pre], tuple) else (PRE_REGEX[pre],)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(metadata: dict, tokens: list[str], types: list[int], vocab: dict[str, int],
                   source: str) -> Tokenizer:
    """llama.cpp's SentencePiece BPE: the adjacent pair whose joined piece scores highest is joined first (the
    leftmost on a tie). As BPE merges: every split of a normal piece into two pieces, ranked by the joined
    piece's score (as transformers converts a SentencePiece model); characters outside the vocabulary fall
    back to their <0xXX> byte tokens."""
    scores = list(metadata.get("tokenizer.ggml.scores", []))
    if len(scores) != len(tokens):
        raise TokenizerError(f"{source}: {len(tokens)} tokens but {len(scores)} scores")
    merges = []  # (left, right, score of left + right), in id order, then by (id of left, id of right)
    for piece, ttype, score in zip(tokens, types, scores):
        if ttype != NORMAL or len(piece) < 2:
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(left, right, score) for left, right in sorted(splits, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))]
    merges.sort(key=lambda m: -m[2])  # stable: ties keep the order above
    unknown = next((t for t, ttype in zip(tokens, types) if ttype == UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], unk_token=unknown,
                               byte_fallback=True, fuse_unk=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def gguf_codec(metadata: dict, path: Path) -> TextCodec | None:
    """The tokenizer of the GGUF file at ``path``: its metadata's (as llama.cpp uses it), else a tokenizer.json
    beside the file, else None (token ids only). Metadata of a kind not supported yet, with no tokenizer.json
    beside, is an error that says so."""
    if not has_tokenizer(metadata):
        return TextCodec.load(path.parent)
    try:
        return TextCodec(gguf_tokenizer(metadata, str(path)))
    except TokenizerError as exc:
        beside = TextCodec.load(path.parent)
        if beside is None:
            raise
        log.info("%s; using %s", exc, path.parent / "tokenizer.json")
        return beside
