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
        detok = Detokenizer(tokenizer, out)
        assert detok.streaming  # the fast tokenizer streams: this test checks DecodeStream
        _feed(detok, out, ids, rng, lambda prefix: tokenizer.decode(prefix, skip_special_tokens=True))


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
        detok = Detokenizer(subject, out)
        assert not detok.streaming
        _feed(detok, out, ids, random.Random(2), full)
