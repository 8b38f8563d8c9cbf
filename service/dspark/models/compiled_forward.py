"""The target's forward as inductor graphs on the CPU.

Eagerly, the norms, rotary embedding, residual adds and SwiGLU of a decode step are about 40
small kernels a layer, each paying dispatch. One graph per forward fuses them. Attention and
the KV write stay eager, as one opaque op per layer (`dspark::attention`): they read the ragged
batch's Python metadata, which as a graph input would be guarded, and so recompiled, every step.
The op finds that batch through `bind`, as vLLM's forward context does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.fx.experimental._config as shape_config

from dspark.models.forward_batch import ForwardBatch
from dspark.models.graph_ops import define_op
from dspark.models.kv_cache import KVCache
from dspark.models.static_batch import PaddedBatch
from dspark.models.transformer import DecoderModel, ForwardOutput

log = logging.getLogger(__name__)
# Without these, a token or logit-row count of 0 or 1, and counts that happen to be equal at the
# first call, each get a graph of their own: four compiles instead of two (a lone token still
# specialises, through the strides of its views).
_ONE_GRAPH_FOR_ALL_SIZES = shape_config.patch(backed_size_oblivious=True, use_duck_shape=False)
# Compiled code is cached per code object, so every model of the process (each test's, each
# dtype) adds graphs to the same two functions; past the limit a fullgraph compile raises.
_GRAPHS_FOR_MANY_MODELS = torch._dynamo.config.patch(recompile_limit=64)
_bound = threading.local()


@contextmanager
def bind(model: DecoderModel, batch: ForwardBatch, cache: KVCache) -> Iterator[None]:
    """Make `batch` and `cache` the ones `dspark::attention` reads on this thread."""
    _bound.value = (model, batch, cache)
    try:
        yield
    finally:
        _bound.value = None


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """`Attention.attend` of decoder layer `layer`, on the bound batch and cache."""
    model, batch, cache = _bound.value
    return model.model.layers[layer].self_attn.attend(q, k, v, batch, cache)


def _attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


define_op("attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor", _attention, _attention_shape)


class CompiledForward:
    """Called like `DecoderModel.forward`; padded static-shape batches (CUDA graphs) run eagerly.

    Shapes are dynamic, so there are two graphs per kind of output: one token, and any other count.
    A drafter's `hidden_layers` are sliced from a graph that returns every layer's
    output, not compiled in: dynamic shapes turn ints into symbols, and a tuple of layer numbers
    as a constant was not guarded reliably (torch 2.13 reused a graph built without it).

    `warm_up` compiles every shape class a step meets and then freezes the graphs: a shape none of
    them takes runs eagerly rather than stalling a step for a compile.
    """

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self._logits = torch.compile(self._logits_only, dynamic=True, fullgraph=True)
        self._layers = torch.compile(self._with_every_layer, dynamic=True, fullgraph=True)

    def _logits_only(self, input_ids: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor):
        return self.model.run(input_ids, positions, logit_rows, (), None, None)

    def _with_every_layer(self, input_ids: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor):
        every = tuple(range(len(self.model.model.layers)))
        return self.model.run(input_ids, positions, logit_rows, every, None, None)

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch | PaddedBatch,
        cache: KVCache,
        hidden_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        if isinstance(batch, PaddedBatch):
            return self.model(input_ids, batch, cache, hidden_layers)
        inputs = (input_ids, batch.positions, batch.logit_rows)
        with bind(self.model, batch, cache), _ONE_GRAPH_FOR_ALL_SIZES, _GRAPHS_FOR_MANY_MODELS:
            if not hidden_layers:
                return ForwardOutput(logits=self._logits(*inputs)[0], layer_hidden=None)
            logits, every = self._layers(*inputs)
        tokens, layers = every.shape[0], len(self.model.model.layers)
        hidden = every.view(tokens, layers, -1)[:, list(hidden_layers)].reshape(tokens, -1)
        return ForwardOutput(logits=logits, layer_hidden=hidden)

    def warm_up(self, cache: KVCache, hidden_layers: tuple[int, ...]) -> None:
        """Compile every shape class a step meets, on a KV slot borrowed while no request runs (or of
        a cache of its own): one request decoding, a prompt chunk with and without its last token's
        logits, a one-token chunk without them, verification; then `freeze`."""
        device = cache.k.device
        slot = cache.allocate()
        try:
            for layers in {(), hidden_layers}:
                for length, logit_rows in ((1, [0]), (5, [4]), (5, []), (1, []), (3, [0, 1, 2])):
                    batch = ForwardBatch.build([slot], [0], [length], logit_rows, device)
                    self(torch.zeros(length, dtype=torch.int64, device=device), batch, cache, layers)
        finally:
            cache.free(slot)
        self.freeze()

    def freeze(self) -> None:
        """Run only the graphs compiled so far; a call none of them takes runs eagerly."""
        self._logits = torch._dynamo.run(self._logits_only)
        self._layers = torch._dynamo.run(self._with_every_layer)


def forward_kind(forward: CompiledForward | DecoderModel) -> str:
    """Whether `forward` is "compiled" or "eager": the two step at different rates."""
    return "compiled" if isinstance(forward, CompiledForward) else "eager"


def compiled_or_eager(
    model: DecoderModel, cache: KVCache, hidden_layers: tuple[int, ...], required: bool
) -> CompiledForward | DecoderModel:
    """The model's compiled forward, warmed up; engines sharing a model share it (a new one would
    recompile). Where inductor cannot build (no C++ compiler, an unsupported op), the eager model
    with a warning, or an error when compiling was `required`."""
    compiled = model.__dict__.get("compiled_forward") or CompiledForward(model)
    log.info("compiling the target's forward (about a minute the first time, seconds once cached)")
    start = time.perf_counter()
    try:
        compiled.warm_up(cache, hidden_layers)
    except Exception as e:  # inductor and dynamo raise many types; all mean "cannot compile here"
        if required:
            raise ValueError(f"cannot compile the target's forward: {e}") from e
        log.warning("running the target's forward eagerly: compiling it failed (%s)", str(e).splitlines()[0])
        return model
    log.info("compiled the target's forward in %.1f s", time.perf_counter() - start)
    model.__dict__["compiled_forward"] = compiled
    return compiled
