"""What vLLM's benchmark client (`vllm bench serve`) sends: each request's prompt and output lengths, when it sends
them (--request-rate: all at once by default, else Poisson arrivals) and how many it keeps outstanding
(--max-concurrency: a closed loop of that many users).

Datasets, as the client samples them:
  random    every prompt `input_len` tokens after a shared prefix of `prefix_len` (--random-prefix-len), every
            answer `output_len` (exact with --ignore-eos).
  sharegpt  ShareGPT's first turns after the client's filter (prompt 4-1024 tokens, prompt + answer <= 2048, answer
            >= 4). The dataset is not bundled: its lengths are drawn from a lognormal of the given means and the shape
            SHAREGPT_SIGMA (assumed), cut to that filter — so the longest answers, which set how long a run's last
            requests take, are the assumption's.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

from memfit.core.errors import MemfitError

DATASETS = ("random", "sharegpt")
MAX_PROMPTS = 100_000
SHAREGPT_SIGMA = 1.0               # assumed: the spread of log(length) of ShareGPT's prompts and answers
SHAREGPT_PROMPT = (4, 1024)        # vLLM's sample_sharegpt_requests filter
SHAREGPT_TOTAL = 2048
SHAREGPT_MEANS = (217, 200)        # ShareGPT_V3's first turns with the Llama-3 / Qwen tokenizers (published runs)


@dataclass(frozen=True)
class Load:
    input_len: float          # tokens per prompt (sharegpt: the mean)
    output_len: float         # tokens per answer (sharegpt: the mean)
    num_prompts: int
    request_rate: float = math.inf
    max_concurrency: int | None = None
    dataset: str = "random"
    seed: int = 0
    prefix_len: int = 0       # --random-prefix-len: tokens every prompt starts with (a shared system prompt)

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise MemfitError(f"unknown --dataset {self.dataset!r}; choose {' or '.join(DATASETS)}.")
        for name in ("input_len", "output_len"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 1:
                raise MemfitError(f"--{name.replace('_', '-')} must be at least 1 token, got {value!r}.")
        for name in ("input_len", "output_len"):
            value = getattr(self, name)
            if self.dataset == "random" and value != int(value):
                raise MemfitError(f"--{name.replace('_', '-')} {value}: the random dataset takes whole tokens.")
        if not isinstance(self.num_prompts, int) or isinstance(self.num_prompts, bool) or self.num_prompts < 1:
            raise MemfitError(f"--num-prompts must be a positive integer, got {self.num_prompts!r}.")
        if isinstance(self.prefix_len, bool) or not isinstance(self.prefix_len, int) or self.prefix_len < 0:
            raise MemfitError(f"--random-prefix-len must be a whole number of tokens, got {self.prefix_len!r}.")
        if self.prefix_len and self.dataset != "random":
            raise MemfitError("--random-prefix-len is the random dataset's: ShareGPT's prompts share no prefix.")
        if self.num_prompts > MAX_PROMPTS:
            raise MemfitError(f"--num-prompts {self.num_prompts}: memfit simulates up to {MAX_PROMPTS:,} requests (a "
                              "run's figures settle long before).")
        if not isinstance(self.request_rate, int | float) or not self.request_rate > 0:
            raise MemfitError(f"--request-rate must be > 0 requests/s (inf: all at once), got {self.request_rate!r}.")
        if self.max_concurrency is not None and (not isinstance(self.max_concurrency, int)
                                                 or isinstance(self.max_concurrency, bool) or self.max_concurrency < 1):
            raise MemfitError(f"--max-concurrency must be a positive integer, got {self.max_concurrency!r}.")

    def requests(self) -> list[tuple[int, int]]:
        """(prompt, answer) tokens of each request, in the order the client sends them."""
        if self.dataset == "random":
            return [(self.prefix_len + int(self.input_len), int(self.output_len))] * self.num_prompts
        rng = random.Random(self.seed)
        prompts = _lognormal_lengths(self.input_len, self.num_prompts, *SHAREGPT_PROMPT)
        answers = _lognormal_lengths(self.output_len, self.num_prompts, 4, SHAREGPT_TOTAL - SHAREGPT_PROMPT[0])
        rng.shuffle(prompts)
        rng.shuffle(answers)
        return [(p, min(a, SHAREGPT_TOTAL - p)) for p, a in zip(prompts, answers)]

    def arrivals(self) -> list[float]:
        """When the client would send each request, before --max-concurrency holds it back: all at 0 (inf), else
        Poisson arrivals (exponential gaps, seeded)."""
        if math.isinf(self.request_rate):
            return [0.0] * self.num_prompts
        rng = random.Random(self.seed)
        times, now = [], 0.0
        for _ in range(self.num_prompts):
            times.append(now)
            now += rng.expovariate(self.request_rate)
        return times


def _lognormal_lengths(mean: float, count: int, low: int, high: int) -> list[int]:
    """`count` lengths at evenly spaced quantiles of a lognormal (SHAREGPT_SIGMA) cut to [low, high], its location
    chosen so their mean is `mean`."""
    if not low < mean < high:
        raise MemfitError(f"a ShareGPT mean length of {mean} tokens is outside its filter ({low} to {high}).")
    quantiles = [NormalDist().inv_cdf((i + 0.5) / count) for i in range(count)]

    def lengths(mu: float) -> list[int]:
        return [min(high, max(low, round(math.exp(mu + SHAREGPT_SIGMA * q)))) for q in quantiles]

    lo, hi = math.log(low) - 3, math.log(high) + 3
    for _ in range(60):   # the mean grows with mu: bisect
        mid = (lo + hi) / 2
        if sum(lengths(mid)) / count < mean:
            lo = mid
        else:
            hi = mid
    return lengths((lo + hi) / 2)
