"""Prompts for the load: a weighted mix of the math, code and chat domains, padded to a length."""

from __future__ import annotations

import random

from dspark.prompts.builtin import BUILTIN_PROMPTS

from dspark_loadtest.tiers import Workload


class PromptSampler:
    """Draws (domain, prompt) pairs by the workload's mix; reproducible for a given seed.

    `promptWords` > 0 lengthens a prompt to at least that many words by prefixing other prompts of
    the same domain as earlier context, so long prompts still read as that domain's traffic.
    """

    def __init__(
        self, workload: Workload, seed: int | None = None, prompts: dict[str, list[str]] | None = None
    ):
        self.prompts = prompts or BUILTIN_PROMPTS
        self.domains = [d for d, w in workload.mix.items() if w > 0]
        missing = [d for d in self.domains if not self.prompts.get(d)]
        if missing:
            raise ValueError(f"no prompts for domain(s) {missing}")
        self.weights = [workload.mix[d] for d in self.domains]
        self.min_words = workload.prompt_words
        self.rng = random.Random(seed)

    def sample(self) -> tuple[str, str]:
        domain = self.rng.choices(self.domains, self.weights)[0]
        pool = self.prompts[domain]
        question = self.rng.choice(pool)
        context: list[str] = []
        words = len(question.split())
        while words < self.min_words:
            earlier = self.rng.choice(pool)
            context.append(earlier)
            words += len(earlier.split())
        if not context:
            return domain, question
        return domain, "Earlier questions:\n\n" + "\n\n".join(
            context
        ) + "\n\nNow answer this one:\n\n" + question
