"""Incremental detokenization gives the same text as decoding the whole output."""

from __future__ import annotations

import random

import pytest
from dspark.engine.detokenizer import Detokenizer
from transformers import AutoTokenizer

TEXTS = [
    "Hello, world! Here is some code:\n\ndef f(x):\n    return x ** 2\n",
    "Multi-byte: naïve café, 日本語のテキスト, emoji 🎉🚀 and a flag 🇫🇷.",
    "  leading spaces,\ttabs and trailing newlines\n\n",
]


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    return AutoTokenizer.from_pretrained(smollm_dir)


def _token_streams(tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    streams = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    specials = list(tokenizer.all_special_ids)
    # Random ids split multi-byte characters anywhere; specials must be skipped as in decode().
    streams += [[rng.randrange(tokenizer.vocab_size) for _ in range(60)] + specials[:1] for _ in range(5)]
    return streams


class _CountingDecodes:
    """A tokenizer that counts its whole-output decodes."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.decodes = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def decode(self, *args, **kwargs) -> str:
        self.decodes += 1
        return self._inner.decode(*args, **kwargs)


def _feed(detok: Detokenizer, out: list[int], ids: list[int], rng: random.Random, full) -> None:
    """Append `ids` to the detokenizer's live list `out` a step at a time, checking its text."""
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)  # a step accepts one to several tokens
        chunk = ids[i : i + n]
        i += len(chunk)
        final = i >= len(ids)
        out.extend(chunk)
        text = detok.update(final=final)
        expected = full(ids[:i])
        if final:
            assert text == expected
        else:  # everything but an incomplete last character, which is held back
            assert expected.startswith(text) and len(expected.rstrip("\ufffd")) - len(text) <= 1


def test_streamed_text_matches_full_decode(tokenizer) -> None:
    rng = random.Random(1)
    for ids in _token_streams(tokenizer):
        out: list[int] = []
        counting = _CountingDecodes(tokenizer)
        detok = Detokenizer(counting, out)
        _feed(detok, out, ids, rng, lambda prefix: tokenizer.decode(prefix, skip_special_tokens=True))
        assert counting.decodes == 1  # the fast tokenizer streams: only the final text is decoded whole


class _SlowTokenizer:
    """A tokenizer with no fast backend to stream from (a Python-only one)."""

    def __init__(self, fast) -> None:
        self.decode = fast.decode


@pytest.mark.parametrize("slow", [True, False])
def test_tokenizers_that_cannot_stream_decode_the_whole_output(tokenizer, slow) -> None:
    if slow:
        subject = _SlowTokenizer(tokenizer)
    else:  # decode() post-processes the whole text: a stream would not see it
        subject = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
        subject.clean_up_tokenization_spaces = True
    full = lambda prefix: tokenizer.decode(prefix, skip_special_tokens=True)  # noqa: E731
    for ids in _token_streams(tokenizer)[:4]:
        out: list[int] = []
        counting = _CountingDecodes(subject)
        detok = Detokenizer(counting, out)
        _feed(detok, out, ids, random.Random(2), full)
        assert counting.decodes > 1  # every step decodes the whole output


def test_special_tokens_kept_stream_as_decode_and_spaced_apart(tokenizer) -> None:
    rng = random.Random(3)
    for ids in _token_streams(tokenizer):
        out: list[int] = []
        counting = _CountingDecodes(tokenizer)
        detok = Detokenizer(counting, out, skip_special_tokens=False, spaces_between_special_tokens=False)
        _feed(detok, out, ids, rng, lambda prefix: tokenizer.decode(prefix, skip_special_tokens=False))
        assert counting.decodes == 1  # kept special tokens stream too
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    words = [tokenizer.encode(w, add_special_tokens=False) for w in ("Hello", "world")]
    ids = [*words[0], start, *words[1], end]
    texts = {}
    for skip, spaced in ((True, True), (False, False), (False, True)):
        out = []
        detok = Detokenizer(tokenizer, out, skip_special_tokens=skip, spaces_between_special_tokens=spaced)
        _feed(detok, out, ids, rng, detok.decode)
        texts[skip, spaced] = detok.text
    assert texts[True, True] == "Helloworld"
    assert texts[False, False] == "Hello<|im_start|>world<|im_end|>"
    assert texts[False, True] == "Hello <|im_start|> world <|im_end|>"
    out = [*words[0], end]
    assert (
        Detokenizer(tokenizer, out, skip_special_tokens=False).update(final=True, drop_last=True) == "Hello"
    )
