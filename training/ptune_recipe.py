"""The p-tuning recipe: one flat section of typed keys (unknown keys and wrong types are errors).

    shardserve ptune --model DIR --task NAME --data FILE --set lr=0.01 --set encoder=lstm

A recipe is frozen; the REST job API takes the same keys as `recipe` overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from engines.core.config import ConfigError
from training.recipe import _build, _require


@dataclass(frozen=True)
class PtuneRecipe:
    num_virtual_tokens: int = 16
    """N: virtual tokens prepended to every input (they count against the context window)."""
    prompt_depth: Literal["input", "every_layer"] = "every_layer"
    """input: the virtual tokens are input embeddings (p-tuning / prompt tuning; PEFT P_TUNING or
    PROMPT_TUNING). every_layer: they are keys and values in every layer (P-tuning v2, PEFT
    PREFIX_TUNING), trained directly from the keys/values the init text gives (encoder must be
    `embedding`). A small base that a prefix of input embeddings
    cannot steer follows one of every layer: on the default model the format task went from 0% to
    100% compliance (BENCHMARKS.md, issue 14)."""
    encoder: Literal["mlp", "lstm", "embedding"] = "embedding"
    """Reparameterisation of the table while training: embedding (the table itself: prompt tuning,
    and the only choice for every_layer), mlp (PEFT's PromptEncoder default) or lstm (bidirectional,
    as in the p-tuning paper), both for prompt_depth input."""
    encoder_hidden_size: int = 0
    """Width of the encoder's hidden layers; 0: the model's hidden size."""
    encoder_residual: bool = False
    """mlp/lstm: output = input + encoder(input) with the last layer zero-initialised, so training
    starts at the init embeddings; False is PEFT's layout (the encoder's output alone)."""
    init_text: str = ""
    """Start the virtual tokens from the embeddings of this text's tokens, repeated or cut to N (PEFT's
    TEXT init; a task description such as "Classify the topic: love or war" gives the optimizer a
    prompt that already means something). Empty: embeddings of N random vocabulary tokens."""
    append_eos: bool = True
    """Append EOS to every answer, so the task learns to stop after it. Off for a label or a prefix
    that the caller reads with a fixed max_tokens: then the loss is on the answer tokens alone."""
    template: str = "{input}"
    """How an example's `input` becomes the prompt; exactly one {input} slot. Saved in task.json."""
    choice_loss: float = 4.0
    """Weight of a second loss for classification-like data: when the answers' first tokens take 2 to
    `choice_limit` distinct values (labels), the cross-entropy of the right label among the labels alone
    is added to the full-vocabulary loss (which still teaches answering with a label at all). Its
    gradient is the classes' difference alone. Without it, keyword classification on the default model
    sat on "always the majority label" for 300-2,500 steps in 7 of 28 runs; at weight 1 one seed of 10
    still did for 1,400 steps; at 4, 10 of 10 seeds reached >= 91.9% balanced accuracy (BENCHMARKS.md,
    issue 14). Data whose answers all start alike (a format task) or vary widely is unaffected. 0: off."""
    choice_limit: int = 32
    """At most this many distinct first answer tokens count as labels for `choice_loss`."""
    lr: float = 0.0
    """Peak AdamW learning rate of the table or encoder (no weight decay). 0: by what is trained:
    0.03 for every_layer's keys/values (SmolLM2-135M, the default model, 4-step sweeps on the validation
    splits: play 0.03 val loss 1.27 vs 0.1's 4.23; next_speaker 0.1 val accuracy 56 % vs 0.03's 38 %;
    0.3, fitted on the old 10M model, diverged; the safe side is the default; issue 39; but at play's full
    80-step budget, same batches, 256 validation rows: 0.01 best accuracy 34.4 % vs 0.03's 30.9 %, 0.1's
    27.0 %, 0.003's 27.0 %: short sweeps favour high rates, and a hard many-class task wants a lower one),
    0.1 for an input embedding table, 3e-3 for an mlp/lstm encoder (issue 14)."""
    warmup_steps: int = 10
    """Linear warm-up from lr/10 to lr over these steps (at most max_steps), then cosine decay to
    lr/10 at max_steps; 0: start at lr."""
    batch_size: int = 16
    max_steps: int = 300
    """Optimizer steps at most (early stopping may end sooner)."""
    eval_every: int = 20
    """Steps between validation passes."""
    select_by: Literal["loss", "accuracy"] = "loss"
    """Which validation pass's table is kept (and what early stopping waits on): loss, the lowest
    validation loss; accuracy, the highest exact-match validation accuracy (ties: the lower loss).
    Loss is the default by validation evidence (issue 39, SmolLM2, 64 validation rows, pick the pass
    on one half and score it on the other): loss >= accuracy in all 6 trainer-task-run checks, better
    in 3 (next speaker, ours: 79.7 % vs 73.4 %; play, PEFT: 28.1 vs 26.6 % and 26.6 vs 25.0 %);
    accuracy on 32-64 rows moves in steps of 1.6-3 points and picks noise."""
    patience: int = 5
    """Validation passes without a better validation score (select_by) before stopping early; 0 disables."""
    val_fraction: float = 0.1
    """Share of the examples held out (at least one, and at least one left to train on), unless the
    data marks its validation records with "split": "val" (a fixed split, training/ptune_tasks.py)."""
    max_examples: int = 50_000
    """Datasets with more examples are refused (a REST job's upload is bounded by this)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """The frozen base's forward/backward: bf16 autocast or fp32. auto: bf16 where the CPU/GPU has
    native bf16 matmuls (AMX, AVX512-BF16, CUDA; engines.core.hardware.detect), else fp32 (emulated bf16
    is slower). The table and encoder stay fp32 either way."""
    time_budget_s: float = 0.0
    """Stop after this many seconds of training; 0: no limit."""
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("num_virtual_tokens", "batch_size", "max_steps", "eval_every", "max_examples", "choice_limit"):
            v = getattr(self, key)
            _require(isinstance(v, int) and v > 0, key, f"must be a positive integer, got {v!r}")
        _require(self.num_virtual_tokens <= 512, "num_virtual_tokens", "must be at most 512")
        _require(self.prompt_depth in ("input", "every_layer"), "prompt_depth",
                 f"must be 'input' or 'every_layer', got {self.prompt_depth!r}")
        _require(self.prompt_depth == "input" or self.encoder == "embedding", "encoder",
                 f"prompt_depth every_layer trains each layer's keys/values directly: set encoder to 'embedding' "
                 f"(got {self.encoder!r})")
        _require(self.encoder_hidden_size >= 0, "encoder_hidden_size", "must be >= 0")
        _require(self.patience >= 0, "patience", "must be >= 0")
        _require(self.select_by in ("accuracy", "loss"), "select_by",
                 f"must be 'accuracy' or 'loss', got {self.select_by!r}")
        _require(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "warmup_steps",
                 f"must be an integer >= 0, got {self.warmup_steps!r}")
        _require(0 < self.val_fraction < 1, "val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        _require(self.lr >= 0, "lr", f"must be > 0 (or 0: chosen by prompt_depth and encoder), got {self.lr}")
        _require(self.choice_loss >= 0, "choice_loss", f"must be >= 0, got {self.choice_loss}")
        _require(self.time_budget_s >= 0, "time_budget_s", "must be >= 0")
        _require(self.template.count("{input}") == 1, "template",
                 f"must contain exactly one {{input}} slot, got {self.template!r}")

    @property
    def peak_lr(self) -> float:
        if self.lr:
            return self.lr
        return 0.03 if self.prompt_depth == "every_layer" else 0.1 if self.encoder == "embedding" else 3e-3

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def ptune_recipe_from_dict(d: Any) -> PtuneRecipe:
    """A recipe from a mapping of overrides; ConfigError names a bad key (e.g. `ptune.lrr: unknown key`)."""
    recipe = _build("ptune", PtuneRecipe, d)
    return recipe


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """`key=value` strings (values parsed as YAML scalars) -> a mapping."""
    import yaml

    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out
