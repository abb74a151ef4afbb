"""The narrow, picklable boundary between the gateway and a ModelServer replica.

The gateway sends a `GenerateRequest` (validated, already tokenized) and receives a stream of
`GenerateChunk`s (token ids, text and logprob deltas). Errors travel as data (`ErrorInfo` in a
chunk) rather than as exceptions, so the Ray hop never has to re-create exception types, and the
in-process and Ray paths behave identically. No tensors cross this boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engines.core.plan import TokenLogprob
from engines.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class ErrorInfo:
    """An OpenAI-style error: HTTP status, type, message, offending parameter, machine code."""

    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def kserve_body(self) -> dict:
        """The KServe v2 error body: `error` is the message string, as the v2 protocol says and as
        tritonclient reads it (its InferenceServerException concatenates it with text: an object there
        made str(exc) raise TypeError). type, param and code ride along as extra top-level keys."""
        return {"error": self.message, "type": self.type, "param": self.param, "code": self.code}


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway needs to validate, tokenize and render requests for a model."""

    name: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    max_seqs_per_request: int
    """A request asking for more sequences (prompts x n) could never be admitted."""
    tokenizer_json: str | None
    """tokenizers' JSON; None when the checkpoint has no tokenizer (token-id prompts only)."""
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    created: int = 0
    """Unix time the model was loaded."""
    weight_dtype: str = ""
    """Storage of the blocks' Linear weights as served: fp8, or the compute dtype (float32, bfloat16...)."""
    step_record_len: int = 256
    """Working steps each replica's engine keeps (EngineConfig.step_record_len): GET /v1/admin/steps' limit."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """SamplingParams fields from the checkpoint's generation_config.json (engines.core.sampling_params.
    generation_defaults): the gateway uses them for the fields a request leaves unset."""


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    """Unique within the server; the engine request of prompt j is `{request_id}-{j}`."""
    prompts: list[list[int]]
    """Token ids of each prompt; each produces params.n completions."""
    params: SamplingParams
    task: str | None = None
    """P-tuned task whose virtual tokens precede every prompt (engines/transforms/ptuning.py); None: plain."""
    stream: bool = False
    """Send an empty chunk as soon as the request is admitted, so a streaming response can start
    (and notice a client that leaves) while the request still waits for the engine."""
    max_tokens_cap: int | None = None
    """A length the server chose because the client set none (params.max_tokens is None): each prompt
    generates at most this many tokens, or up to the context where that ends first. The model server
    applies it per prompt, as only it knows each prompt's room (a p-tuned task's virtual tokens take
    context too): one length for a batch of prompts would refuse the long ones or let the short ones
    run past the server's limit."""


@dataclass
class Delta:
    """What one completion gained since the previous chunk."""

    index: int
    """Completion index within the request: prompt_index * n + completion_index."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class GenerateChunk:
    deltas: list[Delta] = field(default_factory=list)
    prompt_logprobs: dict[int, list[TokenLogprob | None]] | None = None
    """Per prompt index, when the request asked for them (echo with logprobs); sent once."""
    finished: bool = False
    """The last chunk of the request."""
    error: ErrorInfo | None = None
    usage: tuple[int, int] | None = None
    """(prompt tokens, generated tokens), on the last chunk."""
    virtual_tokens: int = 0
    """P-tuning: the task's virtual tokens over all prompts (not in usage's prompt tokens), last chunk."""
