"""The OpenAI API's request and response bodies, as pydantic models (the subset the server serves).

Requests are parsed and type-checked by pydantic (FastAPI turns a failure into a 400 naming the
field); the values' ranges are then checked by :class:`~ninfer_kv.engine.SamplingParams`, so the
server and the Python engine accept exactly the same values.  Unknown fields are ignored, as the
OpenAI API and vLLM do; known fields the engine cannot honour (``echo``, ``best_of``, penalties,
``logit_bias``, tools, response formats) are refused by name when set to anything but their
default.  Sizes are bounded: the body by the server's request limit, and lists here.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

__all__ = [
    "MAX_PROMPTS",
    "MAX_MESSAGES",
    "StreamOptions",
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
    "PromptTokensDetails",
    "Usage",
    "CompletionLogprobs",
    "CompletionChoice",
    "CompletionResponse",
    "TopLogprob",
    "TokenLogprob",
    "ChoiceLogprobs",
    "AssistantMessage",
    "ChatChoice",
    "ChatCompletionResponse",
    "Delta",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "CompletionChunkChoice",
    "CompletionChunk",
    "ModelCard",
    "ModelList",
    "ErrorBody",
    "ErrorResponse",
]

MAX_PROMPTS = 256
"""Most prompts one completions request may batch."""
MAX_MESSAGES = 4096
"""Most messages one chat request may hold."""
_MAX_NAME = 512


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """Fields both endpoints share."""

    model: str = Field(max_length=_MAX_NAME)
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = Field(default=None, max_length=_MAX_NAME)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> list[str]:
        """Fields set to a value the engine cannot honour."""
        out = []
        if self.presence_penalty:
            out.append("presence_penalty")
        if self.frequency_penalty:
            out.append("frequency_penalty")
        if self.logit_bias:
            out.append("logit_bias")
        return out


TokenIds = list[StrictInt]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: bool = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.echo:
            out.append("echo")
        if self.best_of not in (None, 1, self.n):
            out.append("best_of")
        if self.suffix:
            out.append("suffix")
        return out


class _TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str = Field(max_length=64)
    content: str | list[_TextPart] | None = None
    name: str | None = Field(default=None, max_length=_MAX_NAME)

    def text(self) -> str:
        """The message's text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.tools:
            out.append("tools")
        if self.tool_choice not in (None, "none"):
            out.append("tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            out.append("response_format")
        return out


# -- responses -----------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ninfer_kv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
