"""The OpenAI routes' backend in a front-end process: each call goes to an engine replica through a
Ray Serve deployment handle (streamed frames included), so the engine deployment's request router
sees the parsed request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from dspark.serving.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from dspark.serving.openai_service import Frame, JSONReply


class HandleBackend:
    """`OpenAIBackend` over a handle to the `EngineBackend` deployment."""

    def __init__(self, handle: Any):
        self.handle = handle

    def completion(self, req: CompletionRequest) -> AsyncIterator[Frame]:
        return self._frames("completion", req)

    def chat(self, req: ChatCompletionRequest) -> AsyncIterator[Frame]:
        return self._frames("chat", req)

    async def models(self) -> dict[str, Any]:
        return await self.handle.models.remote()

    async def tokenize(self, req: TokenizeRequest) -> JSONReply:
        return await self.handle.tokenize.remote(req)

    async def detokenize(self, req: DetokenizeRequest) -> JSONReply:
        return await self.handle.detokenize.remote(req)

    async def _frames(self, route: str, req: Any) -> AsyncIterator[Frame]:
        gen = self.handle.options(stream=True).openai.remote(route, req)
        done = False
        try:
            async for frame in gen:
                yield frame
            done = True
        finally:
            if not done:
                gen.cancel()  # the client went away: the replica aborts the request
