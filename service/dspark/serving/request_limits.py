"""Per-request size limits at the edge: what one request may ask for before any work is done on it.

Each is a `ServeConfig` setting; a request over one is a 400 naming the field (the body-size limit
is a 413, `body_limit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.serving.errors import bad_request


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 2 * 2**20  # as TGI
    max_messages: int = 2048  # as OpenAI
    max_stop_strings: int = 16
    max_stop_chars: int = 1024
    max_logit_bias: int = 300  # as OpenAI
    max_choices: int = 128  # n x prompts
    max_v2_inputs: int = 64

    @classmethod
    def from_config(cls, config) -> RequestLimits:
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})

    def check(self, req) -> None:
        """Raise a 400 naming the first field of `req` (a completion or chat request) over a limit."""
        stops = req.stop or []
        if len(stops) > self.max_stop_strings:
            raise bad_request(f"{len(stops)} stop strings; the limit is {self.max_stop_strings}", "stop")
        if (longest := max((len(s) for s in stops), default=0)) > self.max_stop_chars:
            raise bad_request(
                f"a stop string of {longest} characters; the limit is {self.max_stop_chars}", "stop"
            )
        bias = req.logit_bias or {}
        if len(bias) > self.max_logit_bias:
            raise bad_request(
                f"{len(bias)} logit_bias entries; the limit is {self.max_logit_bias}", "logit_bias"
            )
        messages = getattr(req, "messages", None)
        if messages is not None and len(messages) > self.max_messages:
            raise bad_request(f"{len(messages)} messages; the limit is {self.max_messages}", "messages")
        prompts = len(req.prompts) if hasattr(req, "prompts") else 1
        if req.n * prompts > self.max_choices:
            raise bad_request(
                f"n = {req.n} x {prompts} prompt(s) asks for {req.n * prompts} choices; the limit is "
                f"{self.max_choices}",
                "n",
            )

    def check_v2_inputs(self, count: int) -> None:
        if count > self.max_v2_inputs:
            raise bad_request(f"{count} input strings; the limit is {self.max_v2_inputs}", "text_input")
