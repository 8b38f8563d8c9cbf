"""Structured outputs: a grammar (JSON schema, regex, Lark grammar or a choice of strings) masks
the target's logits, through llguidance.

llguidance (Rust, no dependencies beyond its abi3 wheel) matches tokens incrementally, computes
the next-token mask in microseconds and rolls back consumed tokens. Under speculation, position k
of a verification block is masked with the grammar state advanced over draft tokens 0..k-1, then
rolled back; only the tokens the step accepts are committed. A draft token the grammar forbids has
zero target probability, so verification rejects it; the output is exactly plain constrained
decoding's (greedy) or distributed as it (sampled). Before the forward, each request's drafts are
checked against its grammar (`forbidden_drafts`), so that the forward stops short of a forbidden
draft instead of computing rows that verification can never reach.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from dspark.engine.sampling_params import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no whitespace loops, fewer tokens
CACHED_GRAMMARS = 256  # distinct constraints kept compiled; clients tend to reuse a few schemas


def compile_grammar(spec: StructuredOutput) -> str:
    """llguidance's grammar text for a request's constraint."""
    if spec.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return llguidance.LLMatcher.grammar_from_lark(spec.value)


class GrammarCompiler:
    """Compiles requests' constraints against the target's tokenizer. Thread-safe: a server compiles
    on worker threads (llguidance releases the GIL) while the engine steps.

    llguidance's view of the tokenizer takes about a second to build: `prepare` builds it (a server
    does at start-up), else the first structured request does. Compiling a constraint and building
    its matcher take 1.4 ms for a short regex or a small schema and seconds for a large one; the last
    `CACHED_GRAMMARS` constraints keep a matcher that no request advances, and each request gets a
    copy of it (microseconds).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._hf = hf_tokenizer
        self._vocab = vocab_size
        self._eos = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def prepare(self) -> None:
        """Build llguidance's tokenizer now (nothing without the engine's tokenizer)."""
        if self._hf is not None:
            self._llg_tokenizer()

    def compile(self, spec: StructuredOutput) -> GrammarState:
        """A new request's grammar state; ValueError names an invalid schema, regex or grammar."""
        if self._hf is None:
            raise ValueError("structured outputs need the engine's tokenizer")
        return GrammarState(self._pristine(spec).deep_copy(), self._eos)

    def _pristine(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The constraint's cached matcher, which no request advances; compiled on a miss, outside
        the lock (a large schema takes seconds)."""
        key = (spec.kind, spec.value)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        pristine = new_matcher(spec, self._llg_tokenizer())
        with self._lock:
            self._compiled[key] = pristine
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return pristine

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self._vocab, eos_token=self._eos
                )
            return self._tokenizer


def new_matcher(spec: StructuredOutput, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A matcher at the start of the constraint; ValueError names an invalid schema, regex or grammar."""
    try:
        grammar = compile_grammar(spec)
    except Exception as e:  # invalid JSON or schema the compiler rejects
        raise ValueError(f"invalid {spec.kind}: {e}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if problem:
        raise ValueError(f"invalid {spec.kind}: {problem}")
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"invalid {spec.kind}: {matcher.get_error()}")
    return matcher


class GrammarState:
    """One request's grammar matcher; `error` is set once the library failed for this request."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.eos_ids = frozenset(eos_ids)
        self.error: str | None = None

    def _until_eos(self, tokens: list[int]) -> list[int]:
        """Tokens before the first EOS: an EOS ends the request, the matcher never consumes it."""
        for i, t in enumerate(tokens):
            if t in self.eos_ids:
                return tokens[:i]
        return tokens

    def first_forbidden(self, drafts: list[int]) -> int | None:
        """Position of the first draft the grammar forbids (None: it takes them all), as the masks
        of `allowed` say: an EOS is forbidden unless the grammar may end there, and nothing after
        an EOS is read. The matcher's state is as before when it returns."""
        if self.error is not None:
            return None
        body = self._until_eos(drafts)
        try:
            valid = self.matcher.validate_tokens(body) if body else 0
            if valid < len(body):
                return valid
            if len(body) == len(drafts):
                return None
            # An EOS follows. validate_tokens refuses it once the grammar has stopped (no token
            # can follow), where the mask still allows it: ask is_accepting, as `advance` does.
            if body and not self.matcher.consume_tokens(body):
                self._fail(self.matcher.get_error() or "the grammar rejected validated tokens")
                return None
            ends = self.matcher.is_accepting()
            if body and not self.matcher.rollback(len(body)):
                self._fail("rollback failed")
                return None
        except Exception as e:  # a library failure fails this request alone
            self._fail(str(e))
            return None
        return None if ends else len(body)

    def allowed(self, drafts: list[int], width: int, vocab: int) -> torch.Tensor:
        """[width, vocab] bool: the tokens allowed at each block position, position k after drafts
        0..k-1. Past the first forbidden draft the rows are never read (it is rejected there)."""
        bits = torch.full((width, (vocab + 31) // 32), -1, dtype=torch.int32)
        drafts = self._until_eos(drafts[: width - 1])
        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        for k in range(valid + 1):
            llguidance.torch.fill_next_token_bitmask(self.matcher, bits, k)
            if k < valid and not self.matcher.consume_token(drafts[k]):
                break
        consumed = min(valid, k)
        if consumed and not self.matcher.rollback(consumed):
            self._fail("rollback failed")
        if self.matcher.is_error():
            self._fail(self.matcher.get_error())
        return unpack_bits(bits, vocab)

    def advance(self, tokens: list[int]) -> bool:
        """Commit generated tokens; False (and `error` set) when the grammar cannot take them."""
        body = self._until_eos(tokens)
        if self.error is None and body and not self.matcher.consume_tokens(body):
            self._fail(self.matcher.get_error() or f"the grammar rejected tokens {body}")
        if self.error is None and len(body) < len(tokens) and not self.matcher.is_accepting():
            self._fail("EOS before the grammar was complete")
        return self.error is None

    def _fail(self, message: str) -> None:
        self.error = self.error or f"structured output failed: {message}"


def unpack_bits(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask [N, ceil(V / 32)] (bit j of word i = token 32 i + j) -> bool [N, V]."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits[:, :, None] >> shifts) & 1).reshape(bits.shape[0], -1)[:, :vocab].bool()


def forbidden_drafts(
    grammars: Sequence[GrammarState | None], drafts: torch.Tensor, lengths: Sequence[int]
) -> list[int | None]:
    """Per row, the first of its `lengths[r]` verified drafts (drafts [R, >= max length], any
    device) that its grammar forbids; None for rows without a grammar or without such a draft."""
    rows = [i for i, g in enumerate(grammars) if g is not None and lengths[i] > 0]
    out: list[int | None] = [None] * len(grammars)
    if not rows:
        return out
    host = drafts[rows, : max(lengths[i] for i in rows)].tolist()
    for i, row_drafts in zip(rows, host, strict=True):
        out[i] = grammars[i].first_forbidden(row_drafts[: lengths[i]])
    return out


def grammar_masks(
    grammars: Sequence[GrammarState | None],
    drafts: torch.Tensor | None,
    lengths: Sequence[int],
    width: int,
    vocab: int,
) -> torch.Tensor | None:
    """[R, width, V] allowed tokens for the rows with a grammar (all True elsewhere); None when no
    row has one. drafts [R, >= width - 1] on any device; lengths: the drafts before each row's last
    position that verification reads."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    host = drafts[rows, : width - 1].tolist() if drafts is not None and width > 1 else [[] for _ in rows]
    masks = torch.ones((len(grammars), width, vocab), dtype=torch.bool)
    for i, row_drafts in zip(rows, host, strict=True):
        n = lengths[i]
        try:
            masks[i, : n + 1] = grammars[i].allowed(row_drafts[:n], n + 1, vocab)
        except Exception as e:  # a library failure fails this request alone
            grammars[i]._fail(str(e))
            continue
        if not masks[i, : n + 1].any(-1).all():  # no token allowed: softmax would be NaN
            grammars[i]._fail("the grammar allows no next token")
            masks[i] = True
    return masks


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Forbidden tokens to -inf; logits [R, W, V] or [R, V] with masks [R, W, V] / [R, 1, V]."""
    masks = masks.to(logits.device)
    if logits.dim() == 2:
        masks = masks[:, 0]
    return logits.float().masked_fill(~masks, float("-inf"))
