"""The one typed config tree.

Built once at an entrypoint with :func:`load_config`: the shipped defaults in
``config/whet.yaml``, then an optional user file (``--config FILE``), then
``WHET_*`` environment variables (``WHET_MODEL__ID=...``; ``__`` descends a
level). Everything below the entrypoint receives the resulting
:class:`WhetConfig` and never reads the environment itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from whet.config.jsontext import JsonTextError, parse_json


class ConfigError(Exception):
    """A config problem a person can fix: names the key and the fix."""

    def __init__(self, key: str, problem: str, fix: str = "") -> None:
        self.key, self.problem, self.fix = key, problem, fix
        message = f"config error at '{key}': {problem}"
        if fix:
            message += f"\n  fix: {fix}"
        super().__init__(message)


def _usable_path(path: Path) -> Path:
    """A path whet can open later: ``~user`` names a user here and there is no NUL in it (both
    would otherwise surface as a crash at start, far from the key that caused them)."""
    if "\x00" in str(path):
        raise ValueError("a path cannot contain a NUL character")
    try:
        path.expanduser()
    except RuntimeError:
        raise ValueError(f"'{str(path).split('/')[0]}' names no user on this machine") from None
    return path


UserPath = Annotated[Path, AfterValidator(_usable_path)]

MASK = "***"


class _SecretValue:
    """Field marker: the whole value is a secret (an API key)."""

    def mask(self, value: Any) -> Any:
        return MASK if value else value


class _SecretKeys:
    """Field marker: a mapping whose keys are secrets (API key -> user)."""

    def mask(self, value: Any) -> Any:
        return [f"{MASK} -> {user}" for user in value.values()]


class _UrlWithSecret:
    """Field marker: a URL whose password (``scheme://user:password@host``) is a secret."""

    def mask(self, value: Any) -> Any:
        if not value:
            return value
        try:
            parts = urlsplit(value)
            password = parts.password
        except ValueError:  # not parseable as a URL: it may hold anything, show none of it
            return MASK
        if password is None:
            return value
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:{MASK}@{host}"))


Secret = Annotated[str | None, _SecretValue()]
"""A secret string: masked wherever the config is logged (:meth:`WhetConfig.redacted`)."""
SecretUrl = Annotated[str | None, _UrlWithSecret()]
"""A URL that may carry a password: the password is masked wherever the config is logged."""
SecretKeys = Annotated[dict[str, str], _SecretKeys()]
"""Secret keys mapping to what they stand for (API key -> user): keys masked when logged."""
_MARKERS = (_SecretValue, _SecretKeys, _UrlWithSecret)


def redact(model: BaseModel) -> dict[str, Any]:
    """``model`` as JSON-ready data with every field typed Secret, SecretUrl or SecretKeys masked."""
    data = model.model_dump(mode="json")
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        marker = next((m for m in info.metadata if isinstance(m, _MARKERS)), None)
        if marker is not None:
            data[name] = marker.mask(data[name])
        elif isinstance(value, BaseModel):
            data[name] = redact(value)
    return data


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # bearer API key -> user id; when empty, the request's `user` field or default_user
    api_keys: SecretKeys = Field(default_factory=dict)
    # users whose keys are operator (admin) keys: they see every user's turns and may forget any user
    admin_users: list[str] = Field(default_factory=list)
    default_user: str = "default"
    max_body_bytes: int = Field(1_000_000, gt=0)
    # limits on one chat request (400 when broken): messages in it, and the max_tokens (or
    # max_completion_tokens) it may ask for; within the cap, answers still stop at model.max_new_tokens
    max_messages: int = Field(512, gt=0)
    max_tokens_cap: int = Field(32_768, gt=0)
    # limits per client (the user of an API key; with keys off, everyone together) on generating
    # requests (429 with Retry-After when broken); 0 turns either off
    max_concurrent_per_key: int = Field(32, ge=0)
    rate_limit_per_minute: int = Field(600, ge=0)
    # false: a request naming another model is served by the one model here (clients keep their own
    # model names); true: such a request gets 404
    strict_model_names: bool = False

    @field_validator("admin_users")
    @classmethod
    def _admins_have_keys(cls, v: list[str], info: ValidationInfo) -> list[str]:
        users = set((info.data.get("api_keys") or {}).values())
        keyless = [user for user in v if user not in users]
        if keyless:
            raise ValueError(f"{keyless[0]!r} is no user of a key in server.api_keys; map a key to it there")
        return v


class ModelConfig(Section):
    backend: Literal["transformers", "openai", "vllm"] = "transformers"
    # HF model id, local folder, "smollm2" (the default model, built into the data dir on first
    # start) or "tiny" (an untrained tiny model built in seconds, for tests of the serving paths)
    id: str = "smollm2"
    # name clients use in the `model` field; defaults to the id
    served_name: str | None = None
    device: str = "auto"
    # weights and activations (log-probs are float32 always); auto = bfloat16 on CUDA, float32 on
    # CPU, where bfloat16 decoded 2-5x slower on the tiny model (no bf16 instructions; see README)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_new_tokens: int = Field(256, gt=0)
    max_context_tokens: int = Field(4096, gt=0)
    temperature: float = Field(0.7, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # remote backends (openai, vllm)
    base_url: SecretUrl = None
    api_key: Secret = None
    request_timeout: float = Field(120.0, gt=0)
    # in-process generation worker threads: requests beyond this wait, never the event loop
    workers: int = Field(8, ge=1)

    @field_validator("id")
    @classmethod
    def _demo_was_replaced(cls, v: str) -> str:
        if v == "demo":
            raise ValueError("model.id demo was replaced by smollm2 (the default model), or tiny for tests")
        return v

    @property
    def name(self) -> str:
        return self.served_name or self.id


class AgentConfig(Section):
    system_prompt: str = (
        "You are whet, a helpful personal assistant. Use the tools when they help; "
        "answer briefly and plainly."
    )
    max_steps: int = Field(6, ge=1, le=64)
    lessons_k: int = Field(4, ge=0)
    # a lesson less similar than this (cosine) to the request stays out of the prompt: small talk
    # gets no lessons about the time at home to misread
    lessons_min_score: float = Field(0.3, ge=-1.0, le=1.0)
    # and one further than this below the closest lesson stays out too: the lesson about *this*
    # request is not drowned by the user's other lessons of the same kind (Sam's city beside three
    # about home); lessons about as close as each other are all shown
    lessons_margin: float = Field(0.1, ge=0.0, le=2.0)
    lesson_token_budget: int = Field(256, ge=0)
    # above this many tools, only the tools_k most relevant to the request are shown
    tools_k: int = Field(16, ge=1)


class McpConfig(Section):
    # path of an mcpServers JSON file; None means the shipped config/mcp.json (bundled servers)
    config: UserPath | None = None
    call_timeout: float = Field(30.0, gt=0)
    max_result_chars: int = Field(16_000, gt=0)
    start_timeout: float = Field(20.0, gt=0)
    # whet serves at once; a chat in the first start_wait seconds waits for servers still starting
    start_wait: float = Field(10.0, ge=0)
    restart_backoff_max: float = Field(30.0, gt=0)
    # tools that run only once a person approves the call: "server.tool" or "server.*"; tools
    # annotated destructiveHint: true need approval too unless approve_destructive is false
    approval_required: list[str] = Field(default_factory=list)
    approve_destructive: bool = True
    approval_timeout: float = Field(600.0, gt=0)  # seconds an undecided approval waits; then it expires

    @field_validator("approval_required")
    @classmethod
    def _server_dot_tool(cls, v: list[str]) -> list[str]:
        for entry in v:
            server, dot, tool = entry.partition(".")
            if not (server and dot and tool):
                raise ValueError(f"{entry!r} is not 'server.tool' (or 'server.*'), e.g. 'notes.delete_note'")
        return v


class StoreConfig(Section):
    # SQLAlchemy URL; None means SQLite (WAL) at <data_dir>/whet.db
    url: SecretUrl = None
    # SQLite only. normal: a commit does not wait for the disk; survives whet crashing or being killed,
    # a power cut may take back the last commits. full: every commit waits for the disk (slower)
    sqlite_sync: Literal["normal", "full"] = "normal"


class BusConfig(Section):
    # None: in-process bus; mqtt://host:port[/prefix]: MQTT broker
    url: SecretUrl = None
    client_id: str | None = None

    @field_validator("url")
    @classmethod
    def _mqtt_only(cls, v: str | None) -> str | None:
        if v and not v.startswith(("mqtt://", "mqtts://")):
            raise ValueError("bus.url must start with mqtt:// or mqtts:// (or be empty for the in-process bus)")
        return v


class MemoryConfig(Section):
    embedder: Literal["auto", "minilm", "hashing"] = "auto"


class JudgeConfig(Section):
    # rules: feedback, tool errors, corrections and thanks; rules+llm: an LLM judges what rules leave at 0
    kind: Literal["rules", "rules+llm"] = "rules"
    # the LLM judge's OpenAI-compatible endpoint; None = the served model itself
    base_url: SecretUrl = None
    model: str | None = None
    api_key: Secret = None
    votes: int = Field(3, ge=1, le=15)
    temperature: float = Field(0.7, ge=0.0)


class ObjectiveConfig(Section):
    # rl: evaluative scores only; opd: hindsight distillation from hints only; combined: both
    kind: Literal["combined", "rl", "opd"] = "combined"
    rl_weight: float = Field(1.0, ge=0.0)
    # scale on RL's negative advantages: a -1 names no token, and pushed down whole a wrong call
    # loses its format with its value (0: learn from successes only; hints still teach). With
    # hindsight: action, a -1 pushes down only the tokens where it differs from the hinted action
    rl_negative_weight: float = Field(0.25, ge=0.0, le=1.0)
    # with hindsight: action, a -1 whose hinted teacher wrote nothing new (no hint, one that names nothing such
    # as "That's wrong.", or the action the policy wrote) pushes down its whole response: false, no token of
    # it (nothing says where the mistake was; pushed down whole it pushes down a list the request named too)
    blame_unhinted: bool = True
    opd_weight: float = Field(1.0, ge=0.0)
    kl_weight: float = Field(0.0, ge=0.0)  # > 0 adds a KL penalty to the base model
    clip_low: float = Field(0.2, gt=0.0, lt=1.0)
    clip_high: float = Field(0.28, gt=0.0)
    advantage_clip: float = Field(5.0, gt=0.0)  # per-token OPD advantages are clipped to +-this
    baseline_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    # how a hint teaches: token = the sampled tokens' advantage logp_teacher - logp_student;
    # distribution = the hinted teacher's whole next-token distribution at every response position
    # (KL; experimental: it keeps [batch, tokens, vocabulary] log-probs in memory for the step);
    # action = the hinted teacher writes the action and the policy without the hint learns it
    hindsight: Literal["token", "distribution", "action"] = "action"
    # with hindsight: action, > 0: each pass also raises every teacher action above the step's other teacher
    # actions of the same tool with other values, on its own prompt (a value bound to its request, not to the tool)
    contrast_weight: float = Field(0.0, ge=0.0)


class LoraConfig(Section):
    rank: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    learning_rate: float = Field(1e-4, gt=0.0)
    # adamw, or sgd: a plain gradient step (lr x the clipped gradient). A step that starts from the base
    # weights (every candidate while the gate rejects) starts AdamW afresh, and AdamW's first updates
    # move every adapter weight by about the learning rate whatever its gradient (m / sqrt(v) is its
    # sign): the weights the batch barely touches move as far as the ones it needs. SGD moves each in
    # proportion to its gradient; its learning rate is on another scale (about 1000x AdamW's)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = Field(0.0, ge=0.0)
    # a step from a live version continues its AdamW state; false: without its first moment (the running
    # mean of the gradients, which keeps pushing the way the version before was taught for the next step's
    # first updates: run BN's steps 3 and 4, two samples about dates and a reminder each, turned pinned
    # "Convert 40 celsius to fahrenheit." to kelvin, step 2's lesson), keeping its second (each weight's scale)
    carry_momentum: bool = True
    max_grad_norm: float = Field(1.0, gt=0.0)
    # optimizer passes over each batch (the hinted teacher's side is computed once): few
    # interactions give few batches, and one pass over each moves an adapter little
    epochs: int = Field(4, ge=1)
    # train only the top N transformer layers (the ones below run without gradients); null = all
    layers: int | None = Field(None, ge=1)
    # the conversation's own tokens carry gradients too, not only the reply's (the system prompt and tool
    # list the step's prompts share stay without): a request's words ("back home", a person's name) can then
    # learn what they mean where they are read; a step's backward pass grows by each prompt's own length
    train_prompt: bool = False
    # the step's matmuls: auto = bfloat16 (autocast over float32 weights) on CUDA and on CPUs
    # with native bfloat16, where it is about twice as fast; else float32
    precision: Literal["auto", "float32", "bfloat16"] = "auto"


class GateConfig(Section):
    # share of requests held out from training: the gate replays them on candidate and live
    holdout_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    holdout_max: int = Field(64, ge=0)
    # a candidate is rejected when its preference margin (nats/token) is below -tolerance
    tolerance: float = Field(0.01, ge=0.0)
    # ...once this many held-out turns have been judged: on fewer, one turn's noise decides (the same settings'
    # first steps were promoted on 3 held-out turns and rejected on 1), so the margin is reported and the
    # regression checks decide alone
    holdout_min_turns: int = Field(4, ge=1)
    # JSONL of {"messages": [...], "response": "...", "tools"?: [...]}: pinned turns whose likelihood
    # must not drop; "bundled" = the shipped set of general skill (config/regression.jsonl); null = none
    regression_set: str | None = "bundled"
    regression_tolerance: float = Field(0.05, ge=0.0)  # nats/token, the set's average
    regression_item_tolerance: float | None = Field(None, ge=0.0)  # nats/token, any one item (null: unchecked)
    # nats/token the set's average may sit below the base model's: the checks above compare a candidate with the
    # live version, so a lineage's steps each within them add up (run CS: five promoted steps put it 0.14 below
    # the base, and general tasks fell 0.875 -> 0.75); a step towards the base passes it, even from beyond; null: unchecked
    regression_total_tolerance: float | None = Field(0.08, ge=0.0)
    # the regression set's turns answered greedily by live and candidate: how many that the live
    # version does right (the pinned call, or an answer without one) the candidate may get wrong
    # (null: unchecked)
    regression_actions_lost: int | None = Field(0, ge=0)
    # ...not counting a pinned call the base model makes by less than this many nats at its closest token (the
    # log-probability of its token there against the best other): a near tie that the noise of any step tips
    # either way (the warm start calls calculate on "What's 23 plus 24?" by 0.03 nats over another tool's name;
    # of two runs of the same first step, one tipped it and was turned away); the likelihood checks still hold it
    pinned_tie_margin: float = Field(0.5, ge=0.0)
    # after promotion: roll back when the live adapter's mean judged score over this many
    # recent turns falls below its predecessor's by more than rollback_margin
    rollback_window: int = Field(16, ge=1)
    rollback_margin: float = Field(0.25, ge=0.0)
    # ...and by more than this many standard errors of the two windows' difference (0: the margin alone)
    rollback_z: float = Field(2.0, ge=0.0)
    # lessons pass the same pinned turns: a new lesson that a pinned turn would be shown (the agent's
    # retrieval rule) must not make the served model answer it wrong, greedily, where it answers it
    # right without; such a lesson is added narrowed: shown only to requests at least lesson_scope_margin
    # more similar to it than the closest turn it broke (none, when that is 1 or more: not added; both
    # logged). Needs the served model: `whet learn` alone adds lessons unchecked
    check_lessons: bool = True
    # 2 (or anything over 1) holds back every lesson that breaks a pinned turn
    lesson_scope_margin: float = Field(0.15, ge=0.0)
    # more general turns (the regression set's format) of which the check also asks the lesson_probes_asked most
    # similar to a new lesson: look-alikes the pinned set lacks (its three calls an intent held no distance
    # conversion, and a random "in feet" about "How much is 10 km?" made "Convert 25 miles to km." an answer in
    # feet); "bundled" = the shipped probes (config/lesson_probes.jsonl); null = the pinned turns alone. Off (0) by
    # default: a look-alike such as "How many km is 40 miles?" is as close to a distance lesson as the user's own
    # ways of asking, so narrowing it away from one took it from the other (bench run CH: jun's memory arm 0.92 -> 0.67)
    lesson_probes: str | None = "bundled"
    lesson_probes_asked: int = Field(0, ge=0)
    # a lesson whose value a call copied into a request the user then corrected (the correction not naming
    # that value) misled it: it is shown from then on only to requests lesson_scope_margin more similar to it
    # than that one (learner.learner.misled_lessons). Needs the agent's lesson index: not under `whet learn` alone
    narrow_misled: bool = True


class RehearsalConfig(Section):
    # JSONL of {"messages", "response", "tools"?} (the regression set's format) that each training
    # step also learns, so one user's lessons do not cost everyone's general skill; "bundled" = the
    # shipped set (config/rehearsal.jsonl, general tool use and small talk); null = none
    set: str | None = "bundled"
    per_step: int = Field(16, ge=0)  # items drawn into every step
    weight: float = Field(1.0, ge=0.0)  # their token-mean log-likelihood loss, times this
    # and their first tokens' mean log-likelihood loss, times this: a reply's first token decides between a
    # tool call and an answer, and is one token of some forty in a chat reply's share of the token mean
    first_token_weight: float = Field(0.0, ge=0.0)
    # after a step's passes, up to this many more optimizer passes while any of the set's small talk opens within
    # repair_margin nats of a tool call: each learns those chats' replies (first token and token mean) beside the
    # step's items, starting without the step's AdamW momentum (with it, each pass carried on teaching the step)
    repair_passes: int = Field(0, ge=0)
    repair_margin: float = Field(1.0, ge=0.0)
    # ...and while any of this many of the set's tool calls, and answers read off a tool's result, that the base
    # model writes greedily (by more than gate.pinned_tie_margin) is no longer written so (a token of it no likelier
    # than the best other there; an answer read to its last digit, at least its opening): the replies the gate's
    # greedy check holds, watched on other requests of the same kinds (run EP: jun's steps at --lora-lr 2e-3 were
    # turned away three times for "What day of the week is 2027-10-30?"; run ES: alex's three times for a date
    # sum's answer). Taken round robin over the tools, calls and answers apart, the closest first; each check reads
    # them all, one forward pass each; 0 = small talk only
    repair_calls: int = Field(0, ge=0)
    # every pass also holds each of the set's small talk's log-probability of opening with a tool call at or
    # below where the step found it (the mean rise, times this): a step's pull towards calls on every chat,
    # not only on the ones already near one
    anchor_weight: float = Field(1.0, ge=0.0)
    # every pass also adds the drawn items' token-mean KL divergence from the base model's next-token
    # distributions (adapter off) along their replies, times this: the whole distribution held, not one reply's
    # tokens (bench/weights_drift.py measures what a step learns against what it moves the gate's pinned set)
    kl_weight: float = Field(0.0, ge=0.0)
    # each drawn item whose request would be shown lessons now (the step's user's; learner.lessons and
    # learner.relesson on) is also rehearsed on the prompt the agent would build with them: a general request beside
    # a lesson that only reads like it is still answered as it asks, as the weights learn the lessons' own requests
    lessons: bool = False


class LearnerConfig(Section):
    # The field defaults here are the learner's plain form, which the unit tests build on. config/whet.yaml, which
    # every entrypoint loads first, ships the setting tuned on the default model (SmolLM2-135M, stop 77): the
    # contrast, the hold to the base model and the repair on, 8 passes a step on the top 15 layers, the hints of
    # turned-away steps taught again; the comments below say what each one does and the runs that measured it.
    # run the learner inside `whet serve` (false: run `whet learn` elsewhere, or no learning)
    enabled: bool = True
    # one adapter for everyone (global), or one per user (user, multi-LoRA); auto = user when
    # server.api_keys names more than one user, else global: one user's feedback never steers
    # the model another user gets (resolved when the config is read: every part sees global or user)
    scope: Literal["auto", "global", "user"] = "auto"
    # global scope: only these users' turns train the shared adapter (the others' are judged and
    # give their own lessons, never weights); null = everyone's
    trusted_users: list[str] | None = None
    train: bool = True  # false: judge and keep lessons only, never change weights
    lessons: bool = True  # false: train weights only, keep no lessons
    # with lessons: a sample trains on its prompt as the agent would build it at the step (the user's
    # lessons retrieved again, its own among them), so the weights learn to follow what the lessons
    # say rather than memorise it (needs whet serve's lesson index; `whet learn` trains on prompts
    # as recorded); false: always as recorded
    relesson: bool = True
    # false: a request that is a correction ("No, I meant Tokyo time.") does not train its first call on
    # its own prompt, where a short complaint answered with a tool call teaches small talk to call tools;
    # what it corrects is taught by the hint on the corrected request. true: it trains like any turn
    train_corrections: bool = False
    # false: an answer written from tool results ("Added milk to your errands list.") trains nothing; what
    # the user meant is in the call before it, and rewarded, such answers taught requests to be answered in
    # their shape without the call. true: they train as successes (a hint on them goes to the call)
    train_tool_answers: bool = True
    # true: a correction that names what was meant ("No, I meant Lisbon time.") after the request was asked
    # again or called "wrong" also gives its hint to the request's earlier askings, judged with a hint that
    # names nothing (which makes no hinted teacher), so the question asked afresh is taught, not only the
    # re-ask behind the failed tries; false: only the turn it answers and its request's failed calls take it.
    # Off until measured against a control: with it the lora arm gave alex 0.21 and jun 0.42 (runs EG, EH, stop 65;
    # jun had 0.62 at the defaults in runs DY and EB of earlier code)
    credit_asked: bool = False
    # each step also trains on up to this many of its lineage's earlier hinted samples whose step the gate
    # rejected or a rollback retired (newest first): a hint that came with a step turned away is taught again
    # beside the new batch, not lost; 0 = none
    replay_hints: int = Field(0, ge=0)
    # each step also trains again on up to this many of its lineage's earlier hinted samples that the live
    # weights were trained on (newest first): the user's other requests of a kind beside the new batch's, so
    # that a step that learns one value (Mum's city) does not write it into every request of its kind (back
    # home, Sam's place: bench runs DQ, DT); 0 = none. 8: the lora arm 0.42 -> 0.62 on jun in two runs (DY, EB), and
    # memory_lora met its targets on both profiles with general skill kept (EC)
    replay_taught: int = Field(8, ge=0)
    # how the two replays above pick among their lineage's hinted samples: newest = the newest first; spread =
    # round robin over the distinct hints ("The user meant Lisbon time", "... Tokyo time", "... miles"), the
    # newest of each first, so a value taught once early (a request the user makes rarely) is taught again in
    # every later step and contrasted with the values of the steps after it, not crowded out by the user's
    # commonest requests; reads up to replay_window of them
    replay_order: Literal["newest", "spread"] = "newest"
    replay_window: int = Field(256, ge=1)
    batch_size: int = Field(16, ge=1)  # judged samples per optimizer step...
    batch_timeout_s: float = Field(60.0, gt=0)  # ...or this long after the first one is ready
    # after the gate turns away r candidates made from a lineage's live version, its next step waits for
    # batch_size * 2**min(r, backoff) samples (no timeout): a lineage the gate holds at its bound stops
    # spending the CPU that serving needs on steps it will turn away (the samples wait, none is dropped,
    # and a promotion resets it); 0 = every batch as above
    backoff: int = Field(3, ge=0)
    poll_s: float = Field(5.0, gt=0)  # how often store-side catch-up runs (events are the fast path)
    device: str = "auto"  # where training runs: auto | cpu | cuda | cuda:1
    # CPU threads a training step may use (torch intra-op, in the training thread only), so serving
    # keeps the rest; null = half the cores this process may run on (at least 1)
    threads: int | None = Field(None, ge=1)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    rehearsal: RehearsalConfig = Field(default_factory=RehearsalConfig)
    gate: GateConfig = Field(default_factory=GateConfig)


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    # console: readable lines; json: one JSON object per line, with request, session and user ids
    format: Literal["console", "json"] = "console"
    json_logs: bool = False  # older spelling of format: json, still honoured

    @property
    def is_json(self) -> bool:
        return self.format == "json" or self.json_logs


# set while a config that has read the WHET_* env takes the overrides: the env is not read again
_ENV_READ: ContextVar[bool] = ContextVar("whet_env_read", default=False)


class WhetConfig(BaseSettings):
    """The whole resolved configuration."""

    model_config = SettingsConfigDict(env_prefix="WHET_", env_nested_delimiter="__", extra="forbid")

    data_dir: UserPath = Path("~/.local/share/whet")
    server: ServerConfig = Field(default_factory=ServerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    mcp: McpConfig = Field(default_factory=McpConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    _scope_auto: bool = PrivateAttr(False)  # learner.scope was auto, resolved from server.api_keys

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # env beats the merged files handed in as init kwargs; the overrides, applied to a config
        # that has read the env already, beat both (load_config)
        return (init_settings,) if _ENV_READ.get() else (env_settings, init_settings)

    @model_validator(mode="after")
    def _resolve_scope(self) -> WhetConfig:
        """``learner.scope: auto`` becomes ``user`` when the API keys name more than one user."""
        if self.learner.scope == "auto":
            users = set(self.server.api_keys.values())
            self.learner.scope = "user" if len(users) > 1 else "global"
            self._scope_auto = True
        return self

    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser()

    @property
    def store_url(self) -> str:
        return self.store.url or f"sqlite:///{self.data_path / 'whet.db'}"

    def mcp_config_path(self) -> Path:
        return self.mcp.config.expanduser() if self.mcp.config else shipped_path("mcp.json")

    def redacted(self) -> dict[str, Any]:
        """The config as logged at start: every field typed as a secret is masked."""
        return redact(self)


def shipped_path(name: str) -> Path:
    return Path(str(resources.files("whet.config") / name))


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings a YAML config file holds, as written (a :class:`ConfigError` saying what to fix otherwise)."""
    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except UnicodeError:
        raise ConfigError(str(path), "the config file is not UTF-8 text", "save it as UTF-8") from None
    except (OSError, RuntimeError, ValueError) as exc:  # missing, ~nobody, a NUL in the path
        reason = exc.strerror if isinstance(exc, OSError) else exc
        raise ConfigError(str(path), f"cannot read the config file ({reason})", "pass an existing file to --config") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"not valid YAML: {exc}", "fix the YAML syntax at the position shown") from None
    except RecursionError:
        raise ConfigError(str(path), "nested too deeply to read", "the config is a few levels of sections and keys") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "the top level must be a mapping of sections", "start the file with e.g. 'model:'")
    _check_section_names(data, str(path))
    return data


def _check_section_names(data: Mapping[Any, Any], source: str) -> None:
    """Top-level keys become keyword arguments: a number or ``null`` there must be a ConfigError, not a TypeError."""
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(repr(key), f"a section name must be text, not {type(key).__name__}",
                              f"use a section name such as 'model' (in {source})")  # fmt: skip


def load_config(path: Path | str | None = None, overrides: Mapping[str, Any] | None = None) -> WhetConfig:
    """Shipped defaults, then ``path``, then ``WHET_*`` env, then ``overrides`` (CLI flags).

    Raises :class:`ConfigError` naming the first bad key and how to fix it.
    """
    _check_env_sections(os.environ)
    data = read_config_file(shipped_path("whet.yaml"))
    if path is not None:
        data = _merge(data, read_config_file(Path(path)))
    if overrides:
        _check_section_names(overrides, "the overrides")
    try:
        config = WhetConfig(**data)
        if overrides:
            dumped = config.model_dump()
            if config._scope_auto:  # resolved again, over the overrides' keys
                dumped["learner"]["scope"] = "auto"
            read = _ENV_READ.set(True)
            try:
                config = WhetConfig(**_merge(dumped, overrides))
            finally:
                _ENV_READ.reset(read)
    except ValidationError as exc:
        raise _config_error(exc) from None
    except (SettingsError, RecursionError) as exc:  # a WHET_* value pydantic-settings could not decode as JSON
        raise _env_error(exc, os.environ) from None
    return config


def _check_env_sections(environ: Mapping[str, str]) -> None:
    """A ``WHET_<SECTION>__<KEY>`` variable must name a section: pydantic-settings drops unknown ones
    silently, so a typo (``WHET_SERVERR__PORT``) would change nothing without a word."""
    sections = {name for name, info in WhetConfig.model_fields.items()
                if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)}  # fmt: skip
    for variable in environ:
        if not variable.upper().startswith("WHET_") or "__" not in variable:
            continue
        section = variable[len("WHET_"):].split("__", 1)[0].lower()
        if section not in sections:
            raise ConfigError(variable, f"unknown config section '{section}' in this environment variable",
                              f"use one of {', '.join(sorted(sections))} (WHET_<SECTION>__<KEY>), or unset it")  # fmt: skip


def _env_error(exc: Exception, environ: Mapping[str, str]) -> ConfigError:
    """Name the variable: pydantic-settings names only the section (and says nothing on deep nesting)."""
    found = re.search(r'field "(\w+)"', str(exc))
    prefix = f"WHET_{found.group(1)}".upper() if found else "WHET_"
    candidates = [name for name in environ if name.upper() == prefix or name.upper().startswith(prefix + ("" if found is None else "__"))]
    culprits = [name for name in candidates if not _is_json(environ[name])] or candidates or [prefix]
    return ConfigError(
        culprits[0],
        "not a value whet can read: a list or mapping in an environment variable is written as JSON",
        f"""write e.g. {culprits[0]}='["a", "b"]' or '{{"key": "value"}}', or unset it""",
    )


def _is_json(value: str) -> bool:
    try:
        parse_json(value)
    except JsonTextError:
        return False
    return True


def _config_error(exc: ValidationError) -> ConfigError:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        section = key.rsplit(".", 1)[0] if "." in key else "the top level"
        return ConfigError(key, "unknown key", f"remove it or check the spelling; see config/whet.yaml for the keys of {section}")
    if kind == "literal_error":
        return ConfigError(key, err["msg"], "use one of the values listed")
    return ConfigError(key, err["msg"], f"set {key} to a valid value (env: WHET_{key.upper().replace('.', '__')})")
