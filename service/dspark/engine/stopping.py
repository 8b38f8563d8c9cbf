"""Appending generated tokens to a request: EOS, stop tokens, max tokens, stop strings."""

from __future__ import annotations

from dspark.engine.request import Request


def append_tokens(request: Request, tokens: list[int], eos_ids: frozenset[int]) -> int:
    """Append tokens until a stop condition; return how many were kept and set finish_reason."""
    params = request.params
    for i, token in enumerate(tokens):
        request.output_token_ids.append(token)
        if (token in eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            request.finish_reason = "stop"
            return i + 1
        if len(request.output_token_ids) >= params.max_tokens:
            request.finish_reason = "length"
            return i + 1
    return len(tokens)


def new_text(request: Request, full_text: str) -> str:
    """The not-yet-emitted part of `full_text`, cut at a stop string (which then finishes the request;
    `include_stop_str_in_output` keeps the stop string). Stop strings count once `min_tokens` exist.

    Text that ends in an incomplete UTF-8 sequence is held back until it completes, and so is text
    that may be the start of a stop string (its last max(len(stop)) - 1 characters): no part of a
    stop string is ever emitted unless asked for.
    """
    params = request.params
    if request.finish_reason is None and full_text.endswith("\ufffd"):
        full_text = full_text.rstrip("\ufffd")
    if params.stop and len(request.output_token_ids) >= params.min_tokens:
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(request.text) - longest + 1)
        hits = [(i, s) for s in params.stop if (i := full_text.find(s, search_from)) >= 0]
        if hits:
            request.finish_reason = "stop"
            at, stop = min(hits, key=lambda hit: hit[0])
            full_text = full_text[: at + len(stop) if params.include_stop_str_in_output else at]
        elif request.finish_reason is None and not params.include_stop_str_in_output:
            full_text = full_text[: max(len(request.text), len(full_text) - longest + 1)]
    delta = full_text[len(request.text) :]
    request.text += delta
    return delta
