"""Target features of the self-distilled sequences, stored as hidden states only.

For every sample (prompt + response) one target forward gives the outputs of the chosen decoder
layers (HF `hidden_states[l + 1]`) and the final normed hidden state; p^t = lm_head(last) is
recomputed during training, so the store grows with the hidden size, not the vocabulary. Shards
(`features-NNNNN.safetensors`, `samples_per_shard` samples each) hold, concatenated over their
samples: `features` [T, m*hidden] and `last` [T, hidden] (bf16), `tokens` [T], and per sample
`offsets` [n+1] and `prompt_lens` [n]. Existing shards are kept, so extraction resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

SHARD_PATTERN = "features-{:05d}.safetensors"
DOMAIN_IDS = {"chat": 0, "code": 1, "math": 2}
CHUNK_ROWS = 128  # positions per normaliser matmul: [128, V] float32 logits stay in cache
GPU_CHUNK_ROWS = 2048  # on an accelerator fewer, larger matmuls: [2048, V] fp32 is 400 MB at V = 49k


@torch.inference_mode()
def target_hidden(
    model, sequences: list[list[int]], layers: tuple[int, ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: (concat of the chosen layers' outputs [T, m*h], final normed hidden [T, h])."""
    device = next(model.parameters()).device
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    # Built on the host, copied once: a copy per row is a host-device round trip each.
    ids, mask = ids.to(device), mask.to(device)
    out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hidden = out.hidden_states
    feats = torch.cat([hidden[layer + 1] for layer in layers], dim=-1)
    last = out.last_hidden_state
    return [(feats[row, : len(seq)], last[row, : len(seq)]) for row, seq in enumerate(sequences)]


def length_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so that (batch size x longest) stays within max_tokens; sorted by length."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current, longest = [], [], 0
    for i in order:
        longest_if = max(longest, lengths[i])
        if current and longest_if * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest_if = [], lengths[i]
        current.append(i)
        longest = longest_if
    if current:
        batches.append(current)
    return batches


def extract_features(
    model,
    samples: list[dict],
    layers: tuple[int, ...],
    data_dir: Path,
    max_tokens: int = 4096,
    samples_per_shard: int = 256,
    progress: bool = True,
) -> list[Path]:
    """Write the feature shards of `samples` (dicts with prompt_ids / response_ids / domain)."""
    paths = []
    n_shards = (len(samples) + samples_per_shard - 1) // samples_per_shard
    bar = tqdm(total=len(samples), desc="features", unit="seq", disable=not progress)
    for shard in range(n_shards):
        path = data_dir / SHARD_PATTERN.format(shard)
        paths.append(path)
        chunk = samples[shard * samples_per_shard : (shard + 1) * samples_per_shard]
        if path.is_file():
            bar.update(len(chunk))
            continue
        seqs = [s["prompt_ids"] + s["response_ids"] for s in chunk]
        results: list = [None] * len(seqs)
        for group in length_batches([len(s) for s in seqs], max_tokens):
            for i, res in zip(group, target_hidden(model, [seqs[i] for i in group], layers), strict=True):
                results[i] = res
            bar.update(len(group))
        lengths = torch.tensor([len(s) for s in seqs])
        offsets = torch.zeros(len(seqs) + 1, dtype=torch.long)
        offsets[1:] = lengths.cumsum(0)
        tensors = {
            "features": torch.cat([f for f, _ in results]).to(torch.bfloat16).contiguous(),
            "last": torch.cat([h for _, h in results]).to(torch.bfloat16).contiguous(),
            "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "offsets": offsets,
            "prompt_lens": torch.tensor([len(s["prompt_ids"]) for s in chunk], dtype=torch.long),
            "domains": torch.tensor([DOMAIN_IDS[s["domain"]] for s in chunk], dtype=torch.long),
        }
        tmp = path.with_suffix(".tmp")
        save_file(tensors, tmp, metadata={"layers": ",".join(map(str, layers))})
        tmp.rename(path)
    bar.close()
    return paths


@dataclass
class Sequence:
    tokens: torch.Tensor  # [T] long
    features: torch.Tensor | None  # [T, m*h] bf16 (the stored layers); None until computed online
    last: torch.Tensor | None  # [T, h] bf16
    prompt_len: int
    domain: int
    log_norm: torch.Tensor | None = None  # [T] fp32 log sum exp of the target's logits (see below)


def load_sequences(paths: list[Path], layers: tuple[int, ...], use_layers: tuple[int, ...]) -> list[Sequence]:
    """Sequences from feature shards, keeping the feature columns of `use_layers` (subset of `layers`)."""
    sequences = []
    for path in paths:
        with safe_open(path, framework="pt") as f:
            stored = tuple(int(x) for x in f.metadata()["layers"].split(","))
            if stored != tuple(layers):
                raise ValueError(f"{path} holds layers {stored}, the config says {tuple(layers)}")
            feats, last = f.get_tensor("features"), f.get_tensor("last")
            tokens, offsets = f.get_tensor("tokens").long(), f.get_tensor("offsets")
            prompt_lens, domains = f.get_tensor("prompt_lens"), f.get_tensor("domains")
        hidden = last.shape[-1]
        if tuple(use_layers) != tuple(layers):
            cols = torch.cat([torch.arange(hidden) + layers.index(layer) * hidden for layer in use_layers])
            feats = feats[:, cols]
        for i in range(len(prompt_lens)):
            a, b = int(offsets[i]), int(offsets[i + 1])
            sequences.append(
                Sequence(tokens[a:b], feats[a:b], last[a:b], int(prompt_lens[i]), int(domains[i]))
            )
    return sequences


def add_log_normalizers(
    sequences: list[Sequence], head: torch.Tensor, device: torch.device, progress: bool = True
) -> None:
    """Set each sequence's `log_norm`: log sum_v exp(lm_head(last)_v) at every response position.

    With it, training forms p^t only over a drafter's reduced vocabulary (p^t_v = exp(logit_v -
    log_norm)) instead of the whole one, once per run instead of once per block position.
    """
    head = head.to(device)
    for seq in tqdm(sequences, desc="target normalisers", disable=not progress, leave=False):
        seq.log_norm = log_normalizer(seq.last, seq.prompt_len, head).cpu()


@torch.no_grad()
def log_normalizer(last: torch.Tensor, prompt_len: int, head: torch.Tensor) -> torch.Tensor:
    """[T] fp32 log sum exp of `last @ head.T` from the last prompt position on (0 before it), on
    the head's device."""
    norm = torch.zeros(len(last), dtype=torch.float32, device=head.device)
    rows = CHUNK_ROWS if head.device.type == "cpu" else GPU_CHUNK_ROWS
    for chunk in range(max(prompt_len - 1, 0), len(last), rows):
        logits = last[chunk : chunk + rows].to(device=head.device, dtype=head.dtype) @ head.T
        norm[chunk : chunk + rows] = torch.logsumexp(logits.float(), dim=-1)
    return norm
