"""Structured outputs through the OpenAI API on the real target with speculation: response_format
(json_object, json_schema), vLLM's structured_outputs, the openai client's parse() with a pydantic
model, and invalid constraints answered with 400 before they reach the batch."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from dspark.drafters.ngram import NgramDrafter
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from tests.engine.helpers import engine_on
from tests.serving.conftest import make_client, make_replica


@pytest.fixture(scope="module")
def client(smollm_dir):
    engine = engine_on(smollm_dir, NgramDrafter(4), "static:4", AutoTokenizer.from_pretrained(smollm_dir))
    replica = make_replica(engine, served_model_name="smollm2-135m", max_output_tokens=128)
    with make_client(replica) as c:
        yield c
    replica.shutdown()


def oai(client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)


def test_openai_parse_with_a_pydantic_model(client):
    completion = oai(client).beta.chat.completions.parse(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Give me a famous city as JSON."}],
        response_format=City,
        max_tokens=100,
        temperature=0,
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City), completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["answer", "tags"],
    "additionalProperties": False,
}


def chat(client, **fields) -> dict:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        "max_tokens": 60,
        "temperature": 0,
        "return_spec_stats": True,
        **fields,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_json_modes_and_structured_outputs_with_and_without_speculation(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    spec = chat(client, response_format=fmt)
    plain = chat(client, response_format=fmt, speculative={"enabled": False})
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(spec["choices"][0]["message"]["content"]), SCHEMA)
    assert plain["spec_decode_stats"]["draft_tokens"] == 0
    obj = chat(client, response_format={"type": "json_object"})["choices"][0]
    content = obj["message"]["content"]
    # This small model may fill the token budget inside an object; a finished one must parse.
    assert content.startswith("{") and (
        obj["finish_reason"] == "length" or isinstance(json.loads(content), dict)
    )
    choice = chat(client, structured_outputs={"choice": ["yes", "no"]})["choices"][0]["message"]["content"]
    assert choice in ("yes", "no")
    r = client.post(
        "/v1/completions",
        json={
            "model": "smollm2-135m",
            "prompt": "The year is",
            "max_tokens": 8,
            "temperature": 0,
            "structured_outputs": {"regex": " (19|20)[0-9]{2}\\."},
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"][:3] in (" 19", " 20"), r.text


def test_unterminated_schema_ends_with_length(client):
    long = {"type": "object", "properties": {"s": {"type": "string", "minLength": 500}}, "required": ["s"]}
    out = chat(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": long}},
        max_tokens=12,
    )
    assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"structured_outputs": {"regex": "[ab"}}, "unclosed"),
        ({"structured_outputs": {"json": {"type": "objectx"}}}, "objectx"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "nothing_defined"),
        ({"structured_outputs": {"regex": "a+"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_invalid_constraints_are_400(client, fields, needle):
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            **fields,
        },
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
