"""OpenAI's request and response bodies as pydantic models, its error format, and the mapping of its sampling
fields onto `fmoe_jax.generate`'s Hugging Face-style arguments. Used by `fmoe_jax.serve.app`.

Fields OpenAI defines that would change the output and are not implemented (`n` > 1, `best_of`, `echo`,
`suffix`, `logit_bias`, penalties other than 0, tools, structured output) are refused with a 400 naming them,
never ignored. vLLM's extensions `top_k`, `repetition_penalty` and `ignore_eos` are accepted.
"""

from __future__ import annotations

import secrets
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fmoe_jax.request import stop_strings


class APIError(Exception):
    """An error answered as OpenAI's JSON: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# generate's arguments that OpenAI's fields set under another name
GENERATE_ARGUMENTS = {
    "max_new_tokens": "max_tokens",
    "return_logprobs": "logprobs",
    "top_logprobs": "logprobs",
    "stop_at_eos": "ignore_eos",
}


# -- requests --------------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's API does."""

    model_config = ConfigDict(extra="ignore")
    prompt_param: ClassVar[str]  # the field holding the prompt, as errors name it
    default_max_tokens: ClassVar[int | None] = None  # None: the context left after the prompt

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = None  # vLLM's extension; -1, 0 or None: no restriction
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # vLLM's extension
    frequency_penalty: float | None = Field(0.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(0.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stop_strings(stop)  # generate's check and sentence: an empty string is refused, as generate does
        return stop

    def prompt_input(self) -> Any:
        """The prompt as `generate` takes it."""
        raise NotImplementedError

    def param_of(self, argument: str) -> str:
        """The field that set `generate`'s `argument` (what an `ArgumentError` names)."""
        return GENERATE_ARGUMENTS.get(argument, argument)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def refuse_unsupported(self) -> None:
        """APIError(400) for a field that would change the output in a way this server does not implement."""
        unsupported = {
            "n": self.n not in (None, 1),
            "frequency_penalty": self.frequency_penalty not in (None, 0),
            "presence_penalty": self.presence_penalty not in (None, 0),
            "logit_bias": bool(self.logit_bias),
        }
        for name, refused in unsupported.items():
            if refused:
                raise APIError(
                    400, f"{name}={getattr(self, name)!r} is not supported by fmoe-serve", param=name
                )
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    def generate_options(self, max_new_tokens: int) -> dict[str, Any]:
        """`fmoe_jax.generate`'s keyword arguments (less prompts): OpenAI's defaults (temperature 1, so
        sampling unless temperature is 0) in transformers' names; values `generate` refuses stay in, so that
        its ValueError, a sentence naming the value, becomes the 400's message."""
        temperature = 1.0 if self.temperature is None else self.temperature
        options: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=None if self.top_p in (None, 1) else self.top_p,
            top_k=None if self.top_k in (None, -1, 0) else self.top_k,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_at_eos=not self.ignore_eos,
            # OpenAI's unseeded requests differ from call to call; greedy decoding ignores the seed
            seed=self.seed if self.seed is not None else (0 if temperature == 0 else secrets.randbits(31)),
        )
        return options


class CompletionRequest(GenerationRequest):
    prompt_param: ClassVar[str] = "prompt"
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's default for /v1/completions

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo or self.suffix or self.best_of not in (None, 1):
            name = "echo" if self.echo else "suffix" if self.suffix else "best_of"
            raise APIError(400, f"{name}={getattr(self, name)!r} is not supported by fmoe-serve", param=name)

    def prompt_input(self) -> str | list[int]:
        return self.single_prompt()

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a string or token ids); a batch of prompts is refused (one choice per request)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    f"prompt holds {len(prompt)} prompts; fmoe-serve takes one per request",
                    param="prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return prompt

    def generate_options(self, max_new_tokens: int) -> dict[str, Any]:
        options = super().generate_options(max_new_tokens)
        if self.logprobs is not None:
            options.update(return_logprobs=True, top_logprobs=self.logprobs)
        return options


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        """The message as the chat template reads it (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(GenerationRequest):
    prompt_param: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def prompt_input(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def param_of(self, argument: str) -> str:
        return argument if argument == "top_logprobs" else super().param_of(argument)

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise APIError(400, "tools are not supported by fmoe-serve", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError(400, "response_format other than text is not supported", param="response_format")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def generate_options(self, max_new_tokens: int) -> dict[str, Any]:
        options = super().generate_options(max_new_tokens)
        if self.logprobs:
            options.update(return_logprobs=True, top_logprobs=self.top_logprobs or 0)
        return options


# -- responses --------------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """A completion, and (`object` "text_completion" too) each chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fmoe_jax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def finish_reason(reason: str | None) -> FinishReason | None:
    """generate's finish reason ("eos", "stop", "length") as OpenAI's: EOS and stop strings are "stop"."""
    return None if reason is None else "length" if reason == "length" else "stop"
