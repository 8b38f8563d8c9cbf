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
    finished text is exactly `tokenizer.decode(ids, skip_special_tokens=...)`, an incomplete
    last character included (as U+FFFD).

    With special tokens kept (`skip_special_tokens=False`) and `spaces_between_special_tokens`,
    the added tokens are decoded apart from the text around them and joined to it by a space,
    as transformers' Python tokenizers do (its fast ones ignore the option); that text is
    decoded whole every step.

    `ids` is the caller's live list of output token ids (the request's own, not a copy); `update`
    decodes what was appended since the previous call.
    """

    def __init__(
        self,
        tokenizer,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = ids
        self._skip = skip_special_tokens
        self._decoded = 0  # how many of `ids` the stream has consumed
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._spaced: frozenset[int] = frozenset()
        if not skip_special_tokens and spaces_between_special_tokens:
            self._spaced = frozenset(getattr(tokenizer, "added_tokens_decoder", {}))
        if getattr(tokenizer, "clean_up_tokenization_spaces", False) or self._spaced:
            self._backend = None
        self._stream = DecodeStream(skip_special_tokens=self._skip) if self._backend is not None else None
        self.text = ""

    def update(self, final: bool = False, drop_last: bool = False) -> str:
        """The whole decoded text of `ids` so far; `drop_last` (with `final`) leaves the last token out."""
        if self._stream is None or final:
            self.text = self.decode(self._ids[:-1] if drop_last else self._ids)
            return self.text
        for token in self._ids[self._decoded :]:
            chunk = self._stream.step(self._backend, token)
            if chunk:
                self.text += chunk
        self._decoded = len(self._ids)
        return self.text

    def decode(self, ids: list[int]) -> str:
        """`ids` as text, with this detokenizer's treatment of special tokens."""
        if not self._spaced:
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip)
        parts, run = [], []
        for token in ids:
            if token in self._spaced:
                if run:
                    parts.append(self._tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self._tokenizer.decode([token], skip_special_tokens=False))
            else:
                run.append(token)
        if run:
            parts.append(self._tokenizer.decode(run, skip_special_tokens=False))
        return " ".join(parts)
