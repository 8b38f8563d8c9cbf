"""A request's output text, decoded incrementally as its tokens arrive."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """Decodes only each step's new tokens.

    Decoding the whole output every step costs time proportional to its length, for every
    token: quadratic per request, and at many requests with long outputs a real share of the
    step. `tokenizers`' `DecodeStream` keeps the few tokens of context a decoder needs and
    yields text only once it is complete UTF-8. Tokenizers it cannot stream (slow, Python-only
    ones, or ones whose decode cleans up spaces over the whole text) decode the whole output
    every step instead. The last call (`final=True`) decodes the whole output once, so the
    finished text is exactly `tokenizer.decode(ids, skip_special_tokens=True)`, an incomplete
    last character included (as U+FFFD).

    `ids` is the caller's live list of output token ids (the request's own, not a copy); `update`
    decodes what was appended since the previous call.
    """

    def __init__(self, tokenizer, ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = ids
        self._decoded = 0  # how many of `ids` the stream has consumed
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = None
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None else None
        self.text = ""

    def update(self, final: bool = False) -> str:
        """The whole decoded text of `ids` so far."""
        if self._stream is None or final:
            self.text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
            return self.text
        for token in self._ids[self._decoded :]:
            chunk = self._stream.step(self._backend, token)
            if chunk:
                self.text += chunk
        self._decoded = len(self._ids)
        return self.text
