"""`dspark serve` read with vLLM's spellings (docs/serving.md's table of `vllm serve` flags)."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner
from dspark.commands.serve import serve
from dspark.commands.vllm_compat import IGNORED, REFUSED
from dspark.serving.generation_defaults import generation_defaults

from tests.serving.conftest import make_client, make_replica
from tests.serving.fake_engine import FakeEngine

SPEC = '{"method": "dspark", "model": "deepseek-ai/dspark_qwen3_8b_block7", "num_speculative_tokens": 7}'


def effective(*args: str) -> dict:
    result = CliRunner().invoke(serve, [*args, "--print-config"], env={"DSPARK_CONFIG": ""})
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.stdout)


def refused(*args: str) -> str:
    result = CliRunner().invoke(serve, [*args, "--print-config"], env={"DSPARK_CONFIG": ""})
    assert result.exit_code == 2, result.output
    return result.output


def test_positional_model_and_speculative_config():
    config = effective("HuggingFaceTB/SmolLM2-135M-Instruct", "--speculative-config", SPEC)
    assert config["engine"]["target"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config["engine"]["drafter"] == "dspark:deepseek-ai/dspark_qwen3_8b_block7"
    assert config["engine"]["gamma"] == 7
    assert effective("--model", "org/m")["engine"]["target"] == "org/m"
    assert effective("org/m", "--target", "org/m")["engine"]["target"] == "org/m"


@pytest.mark.parametrize(
    ("spec", "drafter", "gamma"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 4}', "ngram", 4),
        ('{"method": "eagle3"}', "eagle3", 7),
        ('{"method": "dflash", "model": "/ckpt/dflash"}', "dflash:/ckpt/dflash", 7),
    ],
)
def test_speculative_methods_select_the_drafter(spec, drafter, gamma):
    engine = effective("--speculative-config", spec)["engine"]
    assert (engine["drafter"], engine["gamma"]) == (drafter, gamma)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--speculative-config", SPEC, "--drafter", "ngram"), "leave out --drafter"),
        (("--speculative-config", SPEC, "--gamma", "4"), "--gamma 4 and num_speculative_tokens 7 disagree"),
        (("--speculative-config", '{"method": "medusa"}'), "method: Input should be"),
        (("--speculative-config", '{"method": "ngram", "model": "a/b"}'), "it takes no model"),
        (
            ("--speculative-config", '{"method": "dspark", "num_speculative_tokens": 0}'),
            "num_speculative_tokens",
        ),
        (("--speculative-config", '{"method": "dspark", "draft_tp": 1}'), "draft_tp: Extra inputs"),
        (("--speculative-config", "{"), "Invalid JSON"),
        (("org/a", "--target", "org/b"), "MODEL 'org/a' and --target 'org/b' disagree"),
        (("--enforce-eager", "--compile"), "--enforce-eager contradicts"),
    ],
)
def test_conflicts_and_bad_values_are_usage_errors(args, message):
    assert message in refused(*args)


def test_same_gamma_in_both_places_is_fine():
    assert effective("--speculative-config", SPEC, "--gamma", "7")["engine"]["gamma"] == 7


def test_vllm_spellings_of_existing_flags():
    engine = effective(
        "--max-num-batched-tokens", "256", "--no-enable-prefix-caching", "--max-model-len", "1024",
        "--max-num-seqs", "8", "--dtype", "bfloat16", "--enforce-eager",
    )["engine"]  # fmt: skip
    assert engine["max_batch_tokens"] == 256 and engine["prefix_caching"] is False
    assert (engine["max_model_len"], engine["max_num_seqs"], engine["dtype"]) == (1024, 8, "bfloat16")
    assert engine["compile"] is False and engine["cuda_graphs"] is False
    assert effective("--enable-prefix-caching")["engine"]["prefix_caching"] is True


def test_seed_tokenizer_chat_template_revision():
    engine = effective(
        "org/m", "--revision", "v2", "--seed", "11", "--tokenizer", "org/tok", "--chat-template", "t.jinja"
    )["engine"]
    assert engine["target"] == "org/m@v2" and engine["seed"] == 11
    assert engine["tokenizer"] == "org/tok" and engine["chat_template"] == "t.jinja"
    result = CliRunner().invoke(
        serve, ["org/m@v1", "--revision", "v2", "--print-config"], env={"DSPARK_CONFIG": ""}
    )
    assert result.exit_code == 1 and "names revision 'v1' but revision is 'v2'" in result.output


def test_several_served_model_names_in_either_spelling():
    assert effective("--served-model-name", "chat", "qwen")["server"]["served_model_name"] == ["chat", "qwen"]
    repeated = effective("org/m", "--served-model-name", "chat", "--served-model-name", "qwen")
    assert (
        repeated["server"]["served_model_name"] == ["chat", "qwen"]
        and repeated["engine"]["target"] == "org/m"
    )
    assert effective("--served-model-name=chat")["server"]["served_model_name"] == ["chat"]


def test_generation_config_values(tmp_path):
    assert effective("--generation-config", "vllm")["server"]["generation_config"] == "vllm"
    (tmp_path / "generation_config.json").write_text("{}")
    assert effective("--generation-config", str(tmp_path))["server"]["generation_config"] == str(tmp_path)
    result = CliRunner().invoke(
        serve, ["--generation-config", "/nowhere", "--print-config"], env={"DSPARK_CONFIG": ""}
    )
    assert (
        result.exit_code == 1
        and "generation_config: '/nowhere' is not auto, vllm or a directory" in result.output
    )


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flags_name_their_reason(flag):
    reason, _ = REFUSED[flag]
    assert reason in refused(flag, "2")


@pytest.mark.parametrize(("args", "accepted"), [(("-tp", "1"), True), (("--tensor-parallel-size=1",), True),
                                                (("--load-format", "safetensors"), True), (("-q", "awq"), False)])  # fmt: skip
def test_refused_flags_accept_the_value_that_asks_for_nothing(args, accepted):
    result = CliRunner().invoke(serve, [*args, "--print-config"], env={"DSPARK_CONFIG": ""})
    assert (result.exit_code == 0) is accepted, result.output


@pytest.mark.parametrize("flag", sorted(IGNORED))
def test_ignored_flags_warn_and_change_nothing(flag):
    takes_value, reason = IGNORED[flag]
    args = [flag, "0.9"] if takes_value else [flag]
    result = CliRunner().invoke(serve, [*args, "--print-config"], env={"DSPARK_CONFIG": ""})
    assert result.exit_code == 0, result.output
    assert reason in result.stderr
    assert yaml.safe_load(result.stdout) == effective()


# ---- what the served model does with them ----------------------------------------------------------


def test_all_served_names_are_listed_and_answered():
    replica = make_replica(FakeEngine(), served_model_name=["chat", "qwen"], max_output_tokens=8)
    try:
        with make_client(replica) as client:
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["chat", "qwen"]
            for name in ("chat", "qwen"):
                r = client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200 and r.json()["model"] == "chat"
            assert client.post("/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404
    finally:
        replica.shutdown()


def test_generation_config_fills_only_what_requests_leave_out(tmp_path):
    file = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 5}
    (tmp_path / "generation_config.json").write_text(json.dumps({**file, "do_sample": True}))
    (tmp_path / "config.json").write_text("{}")
    assert generation_defaults(str(tmp_path), None) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 5
    }  # fmt: skip
    assert generation_defaults("auto", str(tmp_path)) == generation_defaults(str(tmp_path), None)
    for spec, want in ((str(tmp_path), (0.6, 0.9, 20, 1.1, 5)), ("vllm", (1.0, 1.0, 0, 1.0, 16))):
        engine = FakeEngine()
        replica = make_replica(engine, generation_config=spec, served_model_name="m", max_output_tokens=16)
        try:
            with make_client(replica) as client:
                assert client.post("/v1/completions", json={"model": "m", "prompt": "a"}).status_code == 200
                r = client.post(
                    "/v1/completions", json={"model": "m", "prompt": "a", "temperature": 0, "top_k": 3}
                )
                assert r.status_code == 200
        finally:
            replica.shutdown()
        (_, left_out), (_, given) = engine.received
        got = (
            left_out.temperature,
            left_out.top_p,
            left_out.top_k,
            left_out.repetition_penalty,
            left_out.max_tokens,
        )
        assert got == want
        assert (given.temperature, given.top_k, given.top_p) == (0, 3, want[1])


def test_engine_takes_tokenizer_chat_template_and_seed(smollm_dir, tiny_dirs, tmp_path):
    import torch
    from dspark.builder import engine_from_config, read_chat_template
    from dspark.engine.config import EngineConfig

    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "t.jinja")) == template == read_chat_template(template)
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template("missing.jinja")
    torch.manual_seed(0)
    config = EngineConfig(
        target=str(tiny_dirs["llama"]), tokenizer=str(smollm_dir), chat_template=str(tmp_path / "t.jinja"), seed=5,
        drafter="none", policy="none", dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64,
    )  # fmt: skip
    engine = engine_from_config(config)
    assert torch.initial_seed() == 5
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<<hi>>"


def test_served_model_names_from_the_environment():
    from dspark.serving.config import load_config

    assert load_config(environ={"DSPARK_SERVED_MODEL_NAME": "chat, qwen"}).served_model_name == [
        "chat",
        "qwen",
    ]
    with pytest.raises(ValueError, match="served_model_name"):
        load_config(overrides={"served_model_name": ["chat", " "]}, environ={})
