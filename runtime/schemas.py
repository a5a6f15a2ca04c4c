"""OpenAI-compatible wire models (requests in, responses out).

These are not table rows: the store's rows never leave the API; routes map
them to the `*Public` models here or in `whet.memory.store`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)


def invalid_text_at(value: Any, path: str = "") -> str | None:
    """The path of the first string in ``value`` that is not valid Unicode (a lone surrogate such
    as ``"\\ud800"``, which JSON can spell but no tokenizer, embedder or store can take), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_unset=True)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := invalid_text_at(key, path)) is not None:
            return found
        if (found := invalid_text_at(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


# OpenAI chat-completion request fields this server knows and cannot honour, with what to do instead.
# Each is refused by name (400 ``unsupported_field``); a field in neither the model nor here is refused
# as unknown. Nothing a client sends is silently dropped.
REFUSED_FIELDS: dict[str, str] = {
    "metadata": "stored-completion metadata is not kept by this server; leave it unset",
    "service_tier": "this server has one service tier; leave it unset",
    "modalities": "this server answers in text only; leave it unset or ['text']",
    "audio": "this server does not produce audio; leave it unset",
    "prediction": "predicted outputs are not supported by this server; leave it unset",
    "reasoning_effort": "the served model has no reasoning-effort setting; leave it unset",
    "verbosity": "the served model has no verbosity setting; leave it unset",
    "web_search_options": "this server does not search the web; give it an MCP tool instead",
    "functions": "the deprecated functions field is not read; send tools",
    "function_call": "the deprecated function_call field is not read; send tool_choice",
    "moderation": "this server runs no moderation; leave it unset",
    "prompt_cache_key": "this server reuses prompt prefixes on its own; leave it unset",
    "prompt_cache_options": "this server reuses prompt prefixes on its own; leave it unset",
    "prompt_cache_retention": "this server reuses prompt prefixes on its own; leave it unset",
    "safety_identifier": "this server does not read it; send user to name the end user",
}
# the same for fields of a message (the openai client's message types carry them)
REFUSED_MESSAGE_FIELDS: dict[str, str] = {
    "audio": "a reference to an earlier audio answer cannot be read by this server; send its transcript as content",
    "function_call": "the deprecated function_call is not read; send tool_calls",
}


def refused_field(loc: tuple[Any, ...]) -> str:
    """Why the request field at ``loc`` (as pydantic reports an extra input) is refused."""
    name = str(loc[-1]) if loc else ""
    known = REFUSED_MESSAGE_FIELDS if len(loc) == 3 and loc[0] == "messages" else REFUSED_FIELDS if len(loc) == 1 else {}
    shown = name if len(name) <= 80 else f"{name[:80]}..."
    return known.get(name) or f"'{shown}' is not a field this server reads"


class Strict(BaseModel):
    """A request model: a field it does not declare is refused by name, never ignored, and a value
    is taken only in the JSON type its schema names (``"0.5"`` is not a number, ``1`` not true)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def only(*values: Any) -> Any:
    """The schema of a field whose type reads more than this server honours: it says which values
    are served (the route refuses the rest by name, see ``ChatCompletionRequest.unsupported``)."""
    return WithJsonSchema({"anyOf": [{"const": v} if not isinstance(v, dict) else v for v in values]
                           + [{"type": "null"}]})  # fmt: skip


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: int) -> Any:
    """JSON's integer (5 and 5.0; not "5", 5.5 or true) within ``bounds`` (``gt=0``...)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]  # the bounds inside: the schema shows them


Int = integer()
NO_NUL = {"pattern": "^[^\\x00]*$"}  # a user id with NUL is refused (no store can index it)


class FunctionCall(Strict):
    name: str
    arguments: str = "{}"


class ToolCallWire(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(Strict):
    """One part of list content. Only text is read (the served models read text): a part of any
    other type is refused by name rather than dropped."""

    type: Literal["text"] = Field(description="'text'; other part types (images, audio) are refused")
    text: str


class ChatMessage(Strict):
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
        "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string", "minLength": 1}}},
    })  # fmt: skip

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallWire] | None = None
    tool_call_id: str | None = None
    refusal: str | None = Field(None, description="an assistant's earlier refusal, echoed back: read as its content "
                                "when it has none")  # fmt: skip

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        for n, part in enumerate(v if isinstance(v, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is None:
                raise ValueError(f"content part {n} has no type; send {{\"type\": \"text\", \"text\": ...}}")
            if kind != "text":
                raise ValueError(f"content part {n} is of type {kind!r}; only text parts are read")
        return v

    @model_validator(mode="after")
    def _tool_results_name_their_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        """Content as plain text: list-of-parts content joins its text parts; an assistant's echoed
        refusal stands for content it does not have."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


class FunctionSpec(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Annotated[bool | None, only(False)] = Field(None, description="true (arguments held to the schema "
                                                        "exactly) is refused: this server does not constrain decoding")


class ToolSpec(Strict):
    type: Literal["function"] = "function"
    function: FunctionSpec


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: Annotated[bool | None, only(False)] = Field(None, description="true is refused: this server "
                                                                     "pads no stream chunks")


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(Strict):

    model: str
    messages: list[ChatMessage] = Field(description="at least one (at most server.max_messages); the last from the "
                                        "user, or a tool result for a client-side tool")  # fmt: skip
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[ToolSpec] | None = None
    # the fields below read OpenAI's full range; the schema names the part this server honours
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None, only("none", "auto")] = None
    parallel_tool_calls: Annotated[bool | None, only(True)] = None
    response_format: Annotated[ResponseFormat | None, only({
        "type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"], "additionalProperties": False,
    })] = None  # fmt: skip
    logprobs: bool | None = None
    top_logprobs: Annotated[integer(ge=0, le=20) | None, only(0)] = None
    frequency_penalty: Annotated[float | None, only(0)] = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Annotated[float | None, only(0)] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, float] | None, only({"type": "object", "maxProperties": 0})] = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: integer(gt=0) | None = None
    max_completion_tokens: integer(gt=0) | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    user: str | None = Field(None, max_length=256, json_schema_extra=NO_NUL)
    n: integer(ge=1, le=1) = 1
    store: bool | None = Field(None, description=(
        "false: serve and keep this request for its session, but never learn from it (no training "
        "sample, no lesson); true or absent: learn from it, whet's default"))

    @field_validator("user")
    @classmethod
    def _no_nul(cls, v: str | None) -> str | None:
        if v is not None and "\x00" in v:
            raise ValueError("a user id cannot contain NUL bytes")
        return v

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    @model_validator(mode="after")
    def _ends_sensibly(self) -> ChatCompletionRequest:
        if self.messages[-1].role not in ("user", "tool"):
            raise ValueError("the last message must be from the user (or a tool result for a client-side tool)")
        return self

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field this server cannot honour as asked; None when all can be."""
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            return "tool_choice", "forcing a tool call is not supported by this server; use 'auto' or 'none'"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", f"'{self.response_format.type}' output is not enforced by this server; use 'text'"
        if self.top_logprobs:
            return "top_logprobs", "the engine records only the sampled token's log-prob; use logprobs without top_logprobs"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                return name, "penalties are not supported by this server; leave it unset or 0"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by this server; leave it unset"
        if self.parallel_tool_calls is False:
            return "parallel_tool_calls", "the agent runs a step's tool calls together; leave it unset or true"
        for n, tool in enumerate(self.tools or ()):
            if tool.function.strict:
                return f"tools.{n}.function.strict", "arguments are not held to the schema by this server; leave it unset or false"
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            return "stream_options.include_obfuscation", "this server pads no stream chunks; leave it unset or false"
        return None

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallWire] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None  # the policy version that answered


class FeedbackRequest(Strict):
    model_config = ConfigDict(json_schema_extra={"anyOf": [  # at least one signal
        {"required": ["score"], "properties": {"score": {"not": {"type": "null"}}}},
        {"required": ["thumbs"], "properties": {"thumbs": {"not": {"type": "null"}}}},
        {"required": ["text"], "properties": {"text": {"type": "string", "minLength": 1}}},
    ]})  # fmt: skip

    turn_id: str
    score: Annotated[float | Literal["up", "down", "thumbs_up", "thumbs_down"] | None, WithJsonSchema({"anyOf": [
        {"type": "number", "minimum": -1, "maximum": 1}, {"enum": ["up", "down", "thumbs_up", "thumbs_down"]},
        {"type": "null"}]})] = None  # fmt: skip
    thumbs: Literal["up", "down"] | None = None
    text: str | None = Field(None, max_length=8000)

    @field_validator("score", mode="before")
    @classmethod
    def _not_a_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):  # JSON true is not the number 1
            raise ValueError("give a number from -1 to 1 or 'up'/'down', not true/false")
        return v

    @model_validator(mode="after")
    def _has_signal(self) -> FeedbackRequest:
        if self.score is None and self.thumbs is None and not self.text:
            raise ValueError("give a score (-1..1), thumbs ('up'|'down') or a text")
        if isinstance(self.score, (int, float)) and not -1.0 <= self.score <= 1.0:
            raise ValueError("score must be between -1 and 1")
        return self

    def numeric_score(self) -> float:
        if isinstance(self.score, (int, float)):
            return float(self.score)
        word = self.thumbs or self.score
        if word in ("up", "thumbs_up"):
            return 1.0
        if word in ("down", "thumbs_down"):
            return -1.0
        return 0.0


class FeedbackAck(BaseModel):
    id: int
    turn_id: str
    score: float
    closed_turn: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "whet"
    backend: str
    adapter: str | None  # the live adapter version (None = base weights)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ToolPublic(BaseModel):
    name: str
    server: str
    description: str
    input_schema: dict[str, Any]
    annotations: dict[str, Any] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


# ----------------------------------------------------------------------------- what the web page reads


class SessionSummary(BaseModel):
    id: str
    title: str  # the first thing the user said
    turns: int
    created_at: datetime
    updated_at: datetime


class ToolStep(BaseModel):
    name: str
    arguments: str
    result: str | None  # None: not run here (a client-side tool) or not answered yet
    is_error: bool = False
    waiting: bool = False  # held until a person approves (the exchange's ``approval``)


class Exchange(BaseModel):
    """One chat request: what the user said, the tool steps, and the answer."""

    request_id: str
    user: str | None
    tools: list[ToolStep]
    answer: str
    turn_id: str  # the answering turn: what feedback rates
    policy_version: str | None
    created_at: datetime
    feedback: list[dict[str, Any]]  # {"score", "text"} in the order given
    verdict: dict[str, Any] | None  # the learner's {"score", "hint", "reason"} once judged
    approval: ApprovalView | None = None  # a pending approval holding this request's last step


class SessionDetail(BaseModel):
    id: str
    exchanges: list[Exchange]
    messages: list[dict[str, Any]]  # the conversation to send back to continue it


class AdapterView(BaseModel):
    id: str
    scope: str
    user_id: str | None
    status: str  # live | candidate | rejected | retired | rolled back
    parent: str | None
    created_at: datetime
    promoted_at: datetime | None
    gate: dict[str, Any] | None  # accepted, reason and the gate's numbers
    train: dict[str, Any] | None
    seconds: dict[str, float] | None = None  # where the step's time went: start, replay_before, train, repair, replay_after, pinned_after
    # learner.rehearsal.repair_passes: the rehearsal small talk within repair_margin of a tool call, before each pass
    repairs: list[int] | None = None
    replayed: int | None = None  # learner.replay_hints and replay_taught: earlier hinted samples the step taught again
    rolled_back: str | None  # why, when it was


class JudgedTurn(BaseModel):
    turn_id: str
    session_id: str
    created_at: datetime
    score: int
    hint: str | None
    reason: str
    judge: str
    policy_version: str | None
    action: str  # what the model did: its text, or its tool calls
    next_state: str  # what followed, as text


class LessonView(BaseModel):
    id: int
    text: str
    kind: str
    source_turn_id: str | None
    min_score: float | None = None  # shown only to requests this similar (the lesson check narrowed it)
    created_at: datetime


class LearningView(BaseModel):
    scope: str  # learner.scope: global | user
    learner: dict[str, Any] | None  # the in-process learner's counters; None when it runs elsewhere
    live: dict[str, str | None]  # scope -> live version (None = base weights)
    adapters: list[AdapterView]  # oldest first
    judgments: list[JudgedTurn]  # newest first
    lessons: list[LessonView]  # oldest first


class TrainAck(BaseModel):
    """``POST /v1/learning/train``: the step is asked for; it runs at the learner's next round."""

    lineage: str  # "global", or "user:<id>" (learner.scope: user)
    waiting: int  # trainable verdicts of that lineage no step has taken yet (what the step will train)


class ApprovalDecision(Strict):
    """``POST /v1/approvals/{id}``: a person's decision on a held step."""

    decision: Literal["approve", "reject"]
    reason: str | None = Field(None, max_length=2000)  # a rejection's reason reaches the model and the learner
    stream: bool = False  # the continued answer as SSE chunks, as /v1/chat/completions streams


class ApprovalCallView(BaseModel):
    name: str
    arguments: Any  # the parsed arguments (the raw text when they are not JSON)


class ApprovalView(BaseModel):
    """A held step as the API shows it."""

    id: str
    status: Literal["pending", "approved", "rejected", "expired"]
    user_id: str
    session_id: str
    turn_id: str
    calls: list[ApprovalCallView]
    reason: str | None
    decided_by: str | None
    created_at: datetime
    expires_at: datetime
    decided_at: datetime | None
