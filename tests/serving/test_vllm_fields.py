"""The request fields vLLM clients send beyond OpenAI's, each against its meaning: min_tokens,
ignore_eos, include_stop_str_in_output, skip_special_tokens and spaces_between_special_tokens over
the real engine on tiny targets; chat_template_kwargs, stream_options.continuous_usage_stats and
the /tokenize and /detokenize routes over the fake engine (and a real tokenizer)."""

from __future__ import annotations

import json

import pytest
from dspark.drafters.ngram import NgramDrafter
from transformers import AutoTokenizer

from tests.conftest import write_tiny_model
from tests.engine.helpers import engine_on
from tests.serving.conftest import make_client, make_replica
from tests.serving.fake_engine import EOS, CharTokenizer, FakeEngine

TOK = CharTokenizer()
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny_chars(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("chars") / "llama", "llama", seed=2, vocab_size=len(TOK))


@pytest.fixture(scope="module")
def real(tiny_chars):
    engine = engine_on(tiny_chars, NgramDrafter(4), "static:3", TOK, max_num_seqs=8)
    replica = make_replica(engine, served_model_name="tiny", max_output_tokens=64)
    with make_client(replica) as c:
        yield c
    replica.shutdown()


def complete(client, **fields) -> dict:
    body = {"model": "tiny", "prompt": "abcabc", "temperature": 0, **fields}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(real):
    free = complete(real, max_tokens=24, ignore_eos=True)["text"]
    stops = TOK.encode(free[1] + free[3])
    early = complete(real, max_tokens=24, ignore_eos=True, stop_token_ids=stops)
    assert early["finish_reason"] == "stop" and len(early["text"]) <= 3
    held = complete(real, max_tokens=24, ignore_eos=True, stop_token_ids=stops, min_tokens=10)
    assert len(held["text"]) >= 10 and not set(held["text"][:10]) & {free[1], free[3]}
    cut = complete(real, max_tokens=24, ignore_eos=True, stop=[free[1:3]])["text"]
    assert len(cut) == 1
    late = complete(real, max_tokens=24, ignore_eos=True, stop=[free[1:3]], min_tokens=12)["text"]
    assert late == free[: len(late)] and len(late) >= 10


def test_ignore_eos(real):
    eos_first = {"logit_bias": {str(EOS): 100}, "max_tokens": 8}
    stopped = complete(real, **eos_first)
    assert stopped["finish_reason"] == "stop" and stopped["text"] == ""
    ignored = complete(real, **eos_first, ignore_eos=True)
    assert ignored["finish_reason"] == "length"
    held = complete(real, **eos_first, min_tokens=5)
    assert held["finish_reason"] == "stop" and len(held["text"]) == 5  # EOS itself has no text


def test_include_stop_str_in_output(real):
    free = complete(real, max_tokens=24, ignore_eos=True)["text"]
    stop = free[4:6]
    assert complete(real, max_tokens=24, stop=[stop])["text"] == free[:4]
    assert complete(real, max_tokens=24, stop=[stop], include_stop_str_in_output=True)["text"] == free[:6]
    token = TOK.encode(free[4])
    assert complete(real, max_tokens=24, stop_token_ids=token)["text"] == free[:4]
    kept = complete(real, max_tokens=24, stop_token_ids=token, include_stop_str_in_output=True)
    assert kept["text"] == free[:5] and kept["finish_reason"] == "stop"
    streamed = real.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "abcabc", "temperature": 0, "max_tokens": 24, "stream": True}
        | {"stop": [stop], "include_stop_str_in_output": True},
    ).text
    chunks = [json.loads(e.removeprefix("data: ")) for e in streamed.strip().split("\n\n")[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == free[:6]


@pytest.fixture(scope="module")
def smollm_real(smollm_dir, tmp_path_factory):
    """A tiny target over SmolLM2's tokenizer: special tokens in the output."""
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    path = write_tiny_model(tmp_path_factory.mktemp("smol") / "llama", "llama", seed=1, vocab_size=len(tok))
    engine = engine_on(path, NgramDrafter(4), "static:3", tok, max_num_seqs=4)
    replica = make_replica(engine, served_model_name="tiny", max_output_tokens=16)
    with make_client(replica) as c:
        yield c, tok
    replica.shutdown()


def test_special_tokens_in_the_output_text(smollm_real):
    client, tok = smollm_real
    special = tok.convert_tokens_to_ids("<|im_start|>")
    word = tok.encode("Hi", add_special_tokens=False)[0]

    def choice(**fields) -> dict:
        # Both tokens favoured; the frequency penalty makes them take turns, so both occur.
        body = {"max_tokens": 6, "ignore_eos": True, "logit_bias": {str(special): 60, str(word): 60}}
        return complete(
            client, **body, frequency_penalty=2.0, logprobs=0, return_tokens_as_token_ids=True, **fields
        )

    skipped = choice()
    ids = [int(t.removeprefix("token_id:")) for t in skipped["logprobs"]["tokens"]]
    assert special in ids and word in ids
    assert (
        skipped["text"] == tok.decode(ids, skip_special_tokens=True) and "<|im_start|>" not in skipped["text"]
    )
    kept = choice(skip_special_tokens=False, spaces_between_special_tokens=False)["text"]
    assert kept == tok.decode(ids, skip_special_tokens=False) and kept.count("<|im_start|>") == ids.count(
        special
    )
    spaced = choice(skip_special_tokens=False)["text"]
    assert spaced.replace(" ", "") == kept.replace(" ", "") and spaced != kept
    words = spaced.split(" ")  # every special token stands alone between spaces
    assert words.count("<|im_start|>") == ids.count(special) and "".join(words) == kept


def test_chat_template_kwargs_reach_the_template(fake):
    engine, client = fake
    for kwargs in (None, {"enable_thinking": False}):
        r = client.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": CHAT, "max_tokens": 2, "chat_template_kwargs": kwargs},
        )
        assert r.status_code == 200, r.text
    default, no_thinking = (TOK.decode(prompt) for prompt, _ in engine.received)
    assert default.endswith("<assistant>") and no_thinking.endswith("<assistant><think></think>")
    for kwargs, needle in (({"tokenize": True}, "tokenize"), ({"bogus": 1}, "chat_template_kwargs")):
        r = client.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": CHAT, "chat_template_kwargs": kwargs},
        )
        assert r.status_code == 400 and needle in json.dumps(r.json()["error"]), r.text
    assert len(engine.received) == 2


def test_continuous_usage_stats_count_the_tokens_so_far():
    replica = make_replica(FakeEngine(step_delay_s=0.02))  # slow steps: one chunk each
    client = make_client(replica).__enter__()

    def chunks(options: dict) -> list[dict]:
        body = {
            "model": "fake-model",
            "prompt": "ab",
            "max_tokens": 9,
            "stream": True,
            "stream_options": options,
        }
        events = client.post("/v1/completions", json=body).text.strip().split("\n\n")
        assert events[-1] == "data: [DONE]"
        return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]

    steps = chunks({"include_usage": True, "continuous_usage_stats": True})
    emitted = 0
    for c in steps[:-1]:
        emitted += len(c["choices"][0]["text"])  # one character a token
        counts = {k: c["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert counts == {"prompt_tokens": 2, "completion_tokens": emitted, "total_tokens": 2 + emitted}
    assert len(steps) > 3 and steps[-1]["usage"]["completion_tokens"] == emitted == 9
    assert all(c["usage"] is None for c in chunks({"include_usage": True})[:-1])
    assert all("usage" not in c for c in chunks({"continuous_usage_stats": True}))
    client.__exit__(None, None, None)
    replica.shutdown()


def test_tokenize_and_detokenize(fake):
    engine, client = fake
    r = client.post("/tokenize", json={"model": "fake-model", "prompt": "hello", "return_token_strs": True})
    assert r.json() == {
        "count": 5,
        "max_model_len": 256,
        "tokens": TOK.encode("hello"),
        "token_strs": list("hello"),
    }
    chat = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    ids = client.post("/tokenize", json=chat).json()["tokens"]
    client.post("/v1/chat/completions", json={"model": "fake-model", "max_tokens": 1, **chat})
    assert ids == engine.received[-1][0]  # the prompt the completion sent to the engine
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": TOK.decode(ids)}
    bad = [
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"text": "x"}, 400, "prompt"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/detokenize", {"tokens": [len(TOK) + 3]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ]
    for path, body, status, needle in bad:
        r = client.post(path, json=body)
        assert r.status_code == status and needle in json.dumps(r.json()["error"]), (body, r.text)
    assert client.post("/tokenize", content=b"{not json").status_code == 400


def test_tokenize_with_a_real_chat_template(smollm_dir):
    """The chat form applies the model's template with chat_template_kwargs (a Qwen3-style switch
    added to SmolLM2's template here)."""
    from tests.serving.fake_engine import FakeEngine

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    tok.chat_template += (
        "{% if add_generation_prompt and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    )
    engine = FakeEngine()
    engine.tokenizer = tok
    replica = make_replica(engine)
    with make_client(replica) as client:
        body = {"messages": CHAT}
        plain = client.post("/tokenize", json=body).json()["tokens"]
        off = client.post(
            "/tokenize", json=body | {"chat_template_kwargs": {"enable_thinking": False}}
        ).json()
    replica.shutdown()

    def rendered(**variables) -> list[int]:
        text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **variables)
        return tok.encode(text, add_special_tokens=False)

    assert plain == rendered() and off["tokens"] == rendered(enable_thinking=False)
    assert off["tokens"][: len(plain)] == plain and off["count"] > len(plain)


def test_tokenizer_routes_need_the_api_key():
    replica = make_replica(FakeEngine())
    with make_client(replica, api_key="k") as client:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
            assert client.post(path, json=body).status_code == 401
            assert client.post(path, json=body, headers={"Authorization": "Bearer k"}).status_code == 200
    replica.shutdown()
