"""Prefix caching on the traffic it is for: multi-turn conversations, interleaved, each resending
its whole history. Every turn after the first reuses its own conversation's earlier KV, whether
that sits in a slot or, with more conversations than slots, in the prefix store; outputs are the
uncached ones."""

from __future__ import annotations

import pytest
import torch
from dspark.drafters.ngram import NoDrafter
from dspark.engine.prefix_store import PrefixStore
from dspark.engine.sampling_params import SamplingParams
from transformers import AutoTokenizer

from tests.engine.helpers import engine_on

SYSTEM = list(range(1, 21))  # a short system prompt every conversation shares
TINY_ANSWER = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _tokens(seed: int, length: int, vocab: int = 64) -> list[int]:
    return torch.randint(vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _turn(engine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(prompt, params)
    request = engine.requests[rid]
    while rid in engine.requests:
        engine.step()
    return request


def _token_conversations(engine, conversations: int, turns: int) -> tuple[float, list[list[int]]]:
    """Round-robin turns of conversations opening on their own 60-token document: (prompt-token
    hit rate, every answer)."""
    histories = [SYSTEM + _tokens(c, 60) for c in range(conversations)]
    queried = hit = 0
    answers = []
    for turn in range(turns):
        for c, history in enumerate(histories):
            request = _turn(engine, history, TINY_ANSWER)
            queried, hit = queried + len(history), hit + request.stats.cached_tokens
            answers.append(request.output_token_ids)
            history += request.output_token_ids + _tokens(1000 * turn + c, 5)
    return hit / queried, answers


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return tiny_dirs["llama"]


@pytest.fixture(scope="module")
def plain_answers(tiny):
    plain = engine_on(tiny, NoDrafter(), "none", max_num_seqs=4, prefix_caching=False)
    return _token_conversations(plain, 8, 4)[1]


def test_a_new_conversation_never_takes_another_ones_slot_for_a_shared_system_prompt(tiny, plain_answers):
    """4 conversations in 4 slots, no store: each turn finds its own history in a slot (a new one
    sharing only the system prompt copies it into another slot instead of taking that one over)."""
    engine = engine_on(tiny, NoDrafter(), "none", max_num_seqs=4, prefix_cache_gib=0)
    rate, answers = _token_conversations(engine, 4, 4)
    assert rate >= 0.7, rate  # all of each earlier turn's prompt and answer, in whole blocks: 0.76
    assert answers == [a for i, a in enumerate(plain_answers) if i % 8 < 4]


def test_more_conversations_than_slots_stay_warm_in_the_store(tiny, plain_answers):
    engine = engine_on(tiny, NoDrafter(), "none", max_num_seqs=2)
    rate, answers = _token_conversations(engine, 8, 4)
    assert rate >= 0.7, rate
    assert answers == plain_answers
    # Without the store, 8 conversations through 2 slots keep none of their history: what hits
    # is the shared system prompt.
    slots_only = engine_on(tiny, NoDrafter(), "none", max_num_seqs=2, prefix_cache_gib=0)
    assert _token_conversations(slots_only, 8, 4)[0] < 0.3


def test_the_store_evicts_the_least_recently_used_prefix(tiny):
    engine = engine_on(tiny, NoDrafter(), "none", max_num_seqs=1)
    prefix = engine.scheduler.prefix_cache
    prefix.store = PrefixStore(engine.cache, num_blocks=6, block_size=16)  # two 3-block prefixes
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a, b, c, d = (_tokens(20 + i, 40) for i in range(4))
    for prompt in (a, b, c, d):  # each pushes the one before out of the only slot
        _turn(engine, prompt, params)
    assert prefix.num_stored == 2  # b and c: a, the oldest, made room for c
    again_b = _turn(engine, b, params)
    assert again_b.stats.cached_tokens == 32 and again_b.prefix_source[0][0] == "stored"
    assert _turn(engine, a, params).stats.cached_tokens == 0


# ---- the real target through its chat template ------------------------------------------------

CHAT_SYSTEM = "You are a helpful assistant. Answer in one short sentence."
WORDS = [
    "river",
    "market",
    "stone",
    "winter",
    "garden",
    "letter",
    "engine",
    "silver",
    "harbor",
    "forest",
    "morning",
    "candle",
    "bridge",
    "window",
    "orchard",
    "village",
    "thunder",
    "meadow",
    "lantern",
    "copper",
    "valley",
    "mirror",
    "island",
    "shadow",
]
QUESTIONS = ["What is this text about?", "Name one word it repeats.", "Say it again, shorter."]
CHAT_ANSWER = SamplingParams(temperature=0.0, max_tokens=12)


def _document(seed: int, words: int = 40) -> str:
    rng = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (words,), generator=rng).tolist())


def _chat_conversations(engine, tokenizer, conversations: int) -> tuple[float, list[list[int]]]:
    """Interleaved conversations rendered by the chat template each turn, as a server renders them
    (the assistant's answers as text): (prompt-token hit rate, every answer)."""
    chats = [
        [
            {"role": "system", "content": CHAT_SYSTEM},
            {"role": "user", "content": f"{_document(c)}\n\n{QUESTIONS[0]}"},
        ]
        for c in range(conversations)
    ]
    queried = hit = 0
    answers = []
    for turn in range(len(QUESTIONS)):
        for chat in chats:
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            prompt = tokenizer.encode(text, add_special_tokens=False)
            request = _turn(engine, prompt, CHAT_ANSWER)
            queried, hit = queried + len(prompt), hit + request.stats.cached_tokens
            answers.append(request.output_token_ids)
            chat.append({"role": "assistant", "content": request.text})
            if turn + 1 < len(QUESTIONS):
                chat.append({"role": "user", "content": QUESTIONS[turn + 1]})
    return hit / queried, answers


def test_chat_turns_hit_their_history_and_decode_as_uncached(smollm_dir):
    """4 conversations through 2 slots and the store, on smollm2's chat template."""
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    cached = engine_on(smollm_dir, NoDrafter(), "none", tokenizer, max_num_seqs=2, compile=False)
    rate, answers = _chat_conversations(cached, tokenizer, 4)
    plain = engine_on(
        smollm_dir, NoDrafter(), "none", tokenizer, max_num_seqs=2, prefix_caching=False, compile=False
    )
    assert answers == _chat_conversations(plain, tokenizer, 4)[1]
    assert rate >= 0.55, rate  # turns 2-3 reuse the whole earlier prompt at least
