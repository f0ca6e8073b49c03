"""Text <-> token ids through a checkpoint's tokenizer.json (the `tokenizers` package).

``byte_level_tokenizer`` builds the demo models' tokenizer: one token per byte
(GPT-2's byte-to-unicode alphabet, no merges) plus special tokens, so any text
round-trips.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ..errors import StrataError

log = logging.getLogger(__name__)

TOKENIZER_NAME = "tokenizer.json"


class TokenizerError(StrataError):
    """The model's tokenizer is missing or cannot be read."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def byte_level_tokenizer(specials: list[str]) -> Tokenizer:
    """Ids 0..255 are the bytes; ``specials`` follow from id 256."""
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for offset, tok in enumerate(specials):
        vocab[tok] = 256 + offset
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


class TextCodec:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model_dir: str | Path) -> "TextCodec | None":
        """The model's tokenizer, or None when it ships no tokenizer.json."""
        path = Path(model_dir) / TOKENIZER_NAME
        if not path.exists():
            return None
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(f"{path}: cannot be read as a tokenizers file: {exc}") from exc

    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of input text that one token can stand for.

        A token's vocabulary string is at least as long in UTF-8 as the text it covers (byte-level 'Ġ' is two
        bytes for one, SentencePiece's '▁' three for one, '<0x41>' six for one); a normalizer may shrink text
        up to 4x (a 4-byte character to one byte), so then the bound is 4x. So a text of N bytes is at least
        N / max_token_bytes() tokens.
        """
        if not hasattr(self, "_max_token_bytes"):
            longest = max((len(t.encode("utf-8")) for t in self.tokenizer.get_vocab(with_added_tokens=True)),
                          default=1)
            self._max_token_bytes = max(1, longest) * (4 if self.tokenizer.normalizer is not None else 1)
        return self._max_token_bytes

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True):
        self.codec = codec
        self.skip_special_tokens = skip_special_tokens  # False: special tokens' text kept (tool-call markers)
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.codec.decode(self.ids, self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        piece, self.emitted = text[len(self.emitted):], text
        return piece

    def flush(self) -> str:
        text = self.codec.decode(self.ids, self.skip_special_tokens)
        piece, self.emitted = text[len(self.emitted):], text
        return piece
