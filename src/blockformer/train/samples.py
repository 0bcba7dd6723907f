"""Text a language model writes during and after training: ``train.samples`` continuations
of ``train.sample_prompts`` (cycled), seeded, temperature 0.8 and top-k 50. The command line
prints them at the end; with TensorBoard among ``train.report_to`` each evaluation logs them
too, so a run's text can be watched as its loss falls."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..generate import generate
from ..generate.step import eval_mode
from ..tokenizers import EOS_ID


def lm_samples(model: nn.Module, tokenizer: Any, cfg: Any) -> list[str]:
    """``cfg.train.samples`` texts, each its prompt followed by what the model wrote."""
    prompts = cfg.train.sample_prompts or [""]
    texts = []
    with eval_mode(model):
        for i in range(cfg.train.samples):
            prompt = prompts[i % len(prompts)]
            [ids] = generate(model, [tokenizer.encode(prompt) or [EOS_ID]], cfg.train.sample_tokens,
                             temperature=0.8, top_k=50, eos_id=EOS_ID, seed=cfg.train.seed + i)
            texts.append(prompt + tokenizer.decode(ids))
    return texts


def samples_at_eval(cfg: Any) -> bool:
    """Whether evaluations log samples: a single-process decoder language model whose run
    reports to TensorBoard (a sharded model would need every rank to generate)."""
    return ("tensorboard" in cfg.train.report_to and cfg.model.arch == "decoder" and cfg.train.samples > 0
            and cfg.head.task == "none")
