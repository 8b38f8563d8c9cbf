"""The training loop: packed anchor blocks, the DSpark objective, resumable checkpoints, export.

State (`out_dir/state.pt`: trainable weights, optimizer, step, tokens seen, the drafting
vocabulary) is written every `checkpoint_every` steps and at the end; a rerun with the same config
continues from it, and a run without one starts from its warm start (`warmstart.py`).
The batch of step s is a pure function of (seed, s), so a resumed run sees the same data as an
uninterrupted one. The exported drafter (`out_dir/final`) is bf16 without the target's shared
weights, loadable by `load_drafter`.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from dspark.drafters.checkpoint import save_draft_model
from dspark.drafters.dspark_model import DSparkModel
from dspark.training.build import draft_vocabulary, drafter_raw_config, new_drafter
from dspark.training.config import TrainConfig, as_current
from dspark.training.features import Sequence, add_log_normalizers
from dspark.training.forward import dspark_block_logits, eagle3_block_logits
from dspark.training.losses import block_loss, expected_tau, position_weights
from dspark.training.online import OnlineFeatures
from dspark.training.packing import PackedBatch, pack
from dspark.training.warmstart import WarmStart, apply_warm_start, find_warm_start, mismatch
from tqdm import tqdm

log = logging.getLogger(__name__)
STATE_FILE = "state.pt"
FINAL_DIR = "final"


def lr_at(step: int, total: int, cfg) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    )


def step_sequences(sequences: list[Sequence], step: int, cfg: TrainConfig) -> list[Sequence]:
    """The sequences of step `step`: a seeded permutation per epoch, so a pure function of the step."""
    per_step = cfg.optim.sequences_per_step
    per_epoch = max(1, len(sequences) // per_step)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(
        len(sequences), generator=torch.Generator().manual_seed(cfg.optim.seed * 7919 + epoch)
    )
    return [sequences[int(i)] for i in order[index * per_step : (index + 1) * per_step]]


def batch_for_step(
    sequences: list[Sequence],
    step: int,
    cfg: TrainConfig,
    fill: Callable[[list[Sequence]], list[Sequence]] | None = None,
    chosen: list[Sequence] | None = None,
) -> PackedBatch:
    """The packed blocks of step `step` (its sequences, or `chosen` when already drawn); `fill`
    gives the drawn sequences their target features when those are computed online."""
    if chosen is None:
        chosen = step_sequences(sequences, step, cfg)
    if fill is not None:
        chosen = fill(chosen)
    generator = torch.Generator().manual_seed(cfg.optim.seed * 1_000_003 + step)
    return pack(chosen, cfg.optim.anchors_per_sequence, cfg.drafter.block_size, generator)


def total_steps(n_sequences: int, cfg: TrainConfig) -> int:
    if cfg.optim.max_steps is not None:
        return cfg.optim.max_steps
    per_epoch = max(1, n_sequences // cfg.optim.sequences_per_step)
    return max(1, math.ceil(cfg.optim.epochs * per_epoch))


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        sequences: list[Sequence],
        target_config: dict,
        shared: tuple[torch.Tensor, torch.Tensor],
        target_state: dict[str, torch.Tensor] | None,
        mask_token_id: int,
        dtype: torch.dtype,
        device: torch.device,
        online: OnlineFeatures | None = None,
    ) -> None:
        if not sequences:
            raise ValueError("no training sequences")
        self.cfg = cfg
        self.sequences = sequences
        self.online = online
        self.dtype = dtype
        self.device = device
        self.out_dir = Path(cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        spec = cfg.drafter
        raw = drafter_raw_config(spec, target_config, cfg.target_layer_ids, mask_token_id)
        self.vocab_size = raw["vocab_size"]
        state = self._load_state()
        warm = find_warm_start(cfg.warm_start, spec.kind, target_config) if state is None else None
        embed, head = shared
        low = dtype if dtype != torch.float32 else torch.float32
        shared_low = (embed.to(low), head.to(low))
        self.model, self.draft_vocab, warm = self._start_model(raw, shared_low, target_state, state, warm)
        self.warm_start = str(warm.source) if warm is not None else None
        self.model = self.model.to(device)
        self.to_target = self.model.draft_token_ids()
        self.target_head = self._target_head(head.to(device=device, dtype=low))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, betas=(0.9, 0.95)
        )
        self.weights = position_weights(spec.block_size, cfg.loss.decay, device)
        self.step = 0
        self.tokens_seen = 0  # response tokens of the sequences drawn so far (the learning curves' x)
        self.elapsed = 0.0
        self.total = total_steps(len(sequences), cfg)
        if state is not None:
            self._resume(state)

    def _start_model(
        self,
        raw: dict,
        shared: tuple[torch.Tensor, torch.Tensor],
        target_state: dict[str, torch.Tensor] | None,
        state: dict | None,
        warm: WarmStart | None,
    ) -> tuple[torch.nn.Module, torch.Tensor | None, WarmStart | None]:
        """The drafter and its drafting vocabulary, warm-started where the warm start fits (an `auto`
        one that does not is dropped with a warning, a required one is an error), and the warm
        start actually used."""
        spec = self.cfg.drafter
        if (
            warm is not None
            and warm.draft_vocab is not None
            and len(warm.draft_vocab) != spec.draft_vocab_size
        ):
            problem = f"{warm.source} drafts over {len(warm.draft_vocab)} tokens, the config {spec.draft_vocab_size}"
            if warm.required:
                raise ValueError(f"warm_start: {problem}")
            log.warning("not warm-starting: %s", problem)
            warm = None
        model, vocab = self._new_model(raw, shared, target_state, state, warm)
        if warm is None:
            return model, vocab, None
        problem = mismatch(model, warm)
        if problem is None:
            apply_warm_start(model, warm)
            return model, vocab, warm
        if warm.required:
            raise ValueError(f"warm_start: {problem}")
        log.warning("not warm-starting: %s", problem)  # auto: the shipped drafter has another shape
        model, vocab = self._new_model(raw, shared, target_state, state, None)
        return model, vocab, None

    def _new_model(
        self,
        raw: dict,
        shared: tuple[torch.Tensor, torch.Tensor],
        target_state: dict[str, torch.Tensor] | None,
        state: dict | None,
        warm: WarmStart | None,
    ) -> tuple[torch.nn.Module, torch.Tensor | None]:
        """A fresh drafter; its drafting vocabulary comes from the checkpoint being resumed, else the
        warm start, else this run's responses."""
        spec = self.cfg.drafter
        vocab = None
        if spec.draft_vocab_size and spec.draft_vocab_size < self.vocab_size:
            if state is not None:
                vocab = state["draft_vocab"]
            elif warm is not None and warm.draft_vocab is not None:
                vocab = warm.draft_vocab
            else:
                vocab = self.response_vocabulary()
        model = new_drafter(
            raw,
            shared[0],
            shared[1],
            target_state,
            spec.init_from_target_layers,
            vocab,
            seed=self.cfg.optim.seed,
        )
        return model, vocab

    def _target_head(self, head: torch.Tensor) -> torch.Tensor:
        """p^t's head: the target's own (never the EAGLE-3 drafter's trained one), over the drafting
        vocabulary's rows when there is one (its normaliser is computed once per position)."""
        if self.to_target is None:
            return head
        if self.online is not None:
            self.online.norm_head = head  # each batch's normalisers come with its features
        elif any(seq.log_norm is None for seq in self.sequences):
            add_log_normalizers(self.sequences, head, self.device)
        return head[self.to_target]

    def _resume(self, state: dict) -> None:
        missing = self.model.load_state_dict(state["model"], strict=False)
        if missing.unexpected_keys:
            raise ValueError(f"{self.out_dir / STATE_FILE} does not match this drafter config")
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.tokens_seen = state.get("tokens_seen", 0)
        self.elapsed = state.get("elapsed_s", 0.0)
        log.info("resuming %s at step %d", self.out_dir, self.step)

    def response_vocabulary(self) -> torch.Tensor:
        """The `draft_vocab_size` most frequent response tokens of the training data (sorted ids)."""
        counts = Counter(t for s in self.sequences for t in s.tokens[s.prompt_len :].tolist())
        return draft_vocabulary(counts, self.cfg.drafter.draft_vocab_size, self.vocab_size)

    @staticmethod
    def _resume_key(config: dict) -> dict | None:
        """What a checkpoint's config must share with this one to be resumed: all but the step budget,
        how features are obtained (both give the same batches) and the starting point (done with).
        None for a config that no longer validates."""
        key = as_current(TrainConfig, config)
        if key is None:
            return None
        key["optim"].pop("max_steps", None)
        key.pop("features", None)
        key.pop("warm_start", None)
        return key

    def _load_state(self) -> dict | None:
        path = self.out_dir / STATE_FILE
        if not path.is_file():
            return None
        state = torch.load(path, map_location="cpu", weights_only=False)
        current = self._resume_key(self.cfg.model_dump(mode="json"))
        if self._resume_key(state.get("config") or {}) != current:
            raise ValueError(f"{path} was written by a different training config; use another out_dir")
        return state

    def save_state(self) -> None:
        trainable = {k for k, p in self.model.named_parameters() if p.requires_grad}
        state = {
            "config": self.cfg.model_dump(mode="json"),
            "model": {
                k: v for k, v in self.model.state_dict().items() if k in trainable or "d2t" in k or "t2d" in k
            },
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed,
            "draft_vocab": self.draft_vocab,
        }
        tmp = self.out_dir / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out_dir / STATE_FILE)

    def loss(self, batch: PackedBatch):
        autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)
        with autocast:
            if isinstance(self.model, DSparkModel):
                draft_logits, conf_logits = dspark_block_logits(self.model, batch, draft_rows=True)
            else:
                draft_logits, conf_logits = eagle3_block_logits(self.model, batch), None
        return self.block_terms(batch, draft_logits, conf_logits)

    def block_terms(
        self, batch: PackedBatch, draft_logits: torch.Tensor, conf_logits: torch.Tensor | None = None
    ):
        """The loss terms of draft (and confidence) logits already computed for `batch`."""
        autocast = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)
        with autocast, torch.no_grad():
            target_logits = batch.target_last.to(self.target_head.dtype) @ self.target_head.T
        n = draft_logits.shape[0]
        log_norm = batch.target_log_norm
        return block_loss(
            draft_logits,
            target_logits.reshape(n, *target_logits.shape[2:]),
            batch.labels.reshape(n, -1),
            batch.valid.reshape(n, -1),
            self.weights,
            conf_logits,
            self.to_target,
            (self.cfg.loss.ce, self.cfg.loss.tv, self.cfg.loss.conf, self.cfg.loss.kl),
            log_norm.reshape(n, -1) if log_norm is not None else None,
        )

    def train(
        self, progress: bool = True, stop_after: int | None = None, export_every: int | None = None
    ) -> dict:
        """Train up to the configured number of steps (or `stop_after` more); returns the last metrics.
        `export_every` N exports the drafter to out_dir/step-NNNNNN every N steps."""
        cfg = self.cfg.optim
        end = self.total if stop_after is None else min(self.total, self.step + stop_after)
        bar = tqdm(
            total=self.total, initial=self.step, desc=f"train {self.cfg.drafter.kind}", disable=not progress
        )
        metrics: dict = {}
        self.model.train()
        positions, started = 0, time.perf_counter()
        while self.step < end:
            fill = self.online.fill if self.online is not None else None
            chosen = step_sequences(self.sequences, self.step, self.cfg)
            self.tokens_seen += sum(len(seq.tokens) - seq.prompt_len for seq in chosen)
            batch = batch_for_step(self.sequences, self.step, self.cfg, fill, chosen).to(self.device)
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(self.step, self.total, cfg)
            terms = self.loss(batch)
            self.optimizer.zero_grad(set_to_none=True)
            terms.total.backward()
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            self.optimizer.step()
            self.step += 1
            positions += batch.block_positions
            now = time.perf_counter()
            metrics = {
                "step": self.step,
                "tokens": self.tokens_seen,
                "loss": round(terms.total.item(), 4),
                "ce": round(terms.ce.item(), 4),
                "tv": round(terms.tv.item(), 4),
                "conf": round(terms.conf.item(), 4),
                **({"kl": round(terms.kl.item(), 4)} if self.cfg.loss.kl else {}),  # not computed at 0
                "accept": [round(a, 3) for a in terms.accept.tolist()],
                "tau_est": round(expected_tau(terms.accept), 3),
                "pos_per_s": round(positions / max(now - started, 1e-9), 1),
            }
            bar.update(1)
            bar.set_postfix(
                loss=metrics["loss"], tv=metrics["tv"], tau=metrics["tau_est"], pos_s=metrics["pos_per_s"]
            )
            if self.step % cfg.checkpoint_every == 0 or self.step == end:
                self.elapsed += now - started
                positions, started = 0, time.perf_counter()
                self.save_state()
                with open(self.out_dir / "log.jsonl", "a") as f:
                    f.write(json.dumps({**metrics, "elapsed_s": round(self.elapsed, 1)}) + "\n")
            if export_every and self.step % export_every == 0:
                self.export(self.out_dir / f"step-{self.step:06d}")
        bar.close()
        return metrics

    def export(self, out: Path | None = None) -> Path:
        """bf16 checkpoint without the shared weights: out_dir/final (or `out`)."""
        target = Path(out) if out is not None else self.out_dir / FINAL_DIR
        # A bf16 copy: training may go on with the weights at full precision.
        save_draft_model(copy.deepcopy(self.model).to(torch.bfloat16).eval(), target)
        info = {
            "steps": self.step,
            "tokens_seen": self.tokens_seen,
            "train_wall_s": round(self.elapsed, 1),
            "sequences": len(self.sequences),
            "features": self.cfg.features,
            "warm_start": self.warm_start,
            "config": self.cfg.model_dump(mode="json"),
        }
        (target / "training.json").write_text(json.dumps(info, indent=2) + "\n")
        return target
