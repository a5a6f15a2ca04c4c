"""Schemathesis against the app in-process (ASGI): every route, every check, every phase.

The app is the real one: the tiny in-process model (so what the tokenizer and the sampler make of
generated text is under test, not a script), the bundled MCP servers, SQLite in a temporary folder,
and an API key (so the schema's bearer security and the 401s are checked too). All built-in
checks run, in both generation modes: a request the schema calls valid must be served (2xx, or a
404 for an id that does not exist), one it calls invalid must be refused with a 4xx, and every
answer must be one the schema declares (status, content type, headers, body, Allow on a 405).

Schemathesis's pytest plugin cannot load a schema from a fixture under pytest 9 (it writes
``node._nodeid``, which pytest 9 no longer has), so this drives its engine, the same run as
``schemathesis run``: examples, coverage, fuzzing and stateful phases.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from schemathesis.engine import events, from_schema
from schemathesis.generation import GenerationMode
from test_api import bundled_tools, make_config

from whet.memory.index import HashingEmbedder
from whet.runtime.schemas import ChatCompletionRequest

pytestmark = pytest.mark.loopback

KEY = "sk-alice"
EXAMPLES = 60  # per operation and phase: the whole run stays under ~3 minutes on one core
PROMPT_ROOM = 512  # tokens the agent adds to a chat request's messages (system prompt, lessons)


def within_what_json_schema_cannot_say(app, backend):
    """Valid chat requests (positive mode) are generated within the two rules the schema states in
    words only, as JSON Schema has no keyword for them: the last message is from the user or a tool
    result, and the rendered prompt fits the model's context (counted with the engine's own
    tokenizer, with room for the system prompt and lessons the agent adds). A request breaking
    either is a 400 naming ``messages`` (tests/test_limits.py, test_bad_input.py). Invalid requests
    (negative mode) and every other route pass unchanged."""

    def filter_case(context, case) -> bool:
        body = case.body
        if case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE or case.path != "/v1/chat/completions":
            return True
        messages = body.get("messages") if isinstance(body, dict) else None
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") not in ("user", "tool"):
            return False
        try:
            request = ChatCompletionRequest.model_validate(body)
        except ValueError:
            return True  # the server's answer is checked as is
        tools = app.state.resources.tools.openai_tools() + [t.model_dump() for t in request.tools or ()]
        prompt = backend.prompt_ids([m.to_openai() for m in request.messages], tools)
        return len(prompt) < backend.context_tokens - PROMPT_ROOM

    return filter_case


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    from whet.learner.tiny import build_tiny_model
    from whet.runtime.app import create_app
    from whet.runtime.hf import TransformersBackend

    data = tmp_path_factory.mktemp("schemathesis")
    model_dir = build_tiny_model(data / "model")
    # rate limit off: thousands of requests a minute are the point here (see README, Limits)
    config = make_config(data, model={"id": "tiny", "max_new_tokens": 4},
                         server={"api_keys": {KEY: "alice"}, "rate_limit_per_minute": 0})  # fmt: skip
    backend = TransformersBackend(str(model_dir), model_name="tiny", workers=1)
    app = create_app(config, backend=backend, tools=bundled_tools(data), embedder=HashingEmbedder())
    settings = schemathesis.Config.from_dict({
        "headers": {"Authorization": f"Bearer {KEY}"},
        "workers": 1,
        "generation": {"max-examples": EXAMPLES, "deterministic": True},
    })  # fmt: skip
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=settings,
                                            headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    schema.hook("filter_case")(within_what_json_schema_cannot_say(app, backend))
    return schema


def failures_of(event: events.ScenarioFinished) -> list[str]:
    found = []
    for case_id, checks in event.recorder.checks.items():
        for check in checks:
            if check.failure_info is None:
                continue
            failure = check.failure_info.failure
            interaction = event.recorder.interactions.get(case_id)
            sent = answer = "?"
            if interaction is not None:
                sent = f"{interaction.request.method} {interaction.request.uri} {(interaction.request.body or b'')[:300]!r}"
            if interaction is not None and interaction.response is not None:
                answer = f"{interaction.response.status_code} {interaction.response.content[:300]!r}"
            found.append(f"[{event.phase.value}] {failure.operation}: {check.name}: {failure.title}\n"
                         f"  {failure.message[:600]}\n  sent: {sent}\n  answer: {answer}")  # fmt: skip
    return found


def test_every_route_answers_as_its_schema_says_under_every_check(api_schema):
    from schemathesis.checks import CHECKS, load_all_checks

    load_all_checks()
    enabled = [c.__name__ for c in CHECKS.get_all() if api_schema.config.checks_config_for().get_by_name(name=c.__name__).enabled]
    assert "positive_data_acceptance" in enabled and "negative_data_rejection" in enabled and "ignored_auth" in enabled
    failures, errors, tested, answered = [], [], set(), Counter()
    for event in from_schema(api_schema).execute():
        if isinstance(event, events.ScenarioFinished):
            failures += failures_of(event)
            if event.recorder.interactions:
                tested.add(event.recorder.label)
            for interaction in event.recorder.interactions.values():
                if interaction.response is not None:
                    answered[(event.recorder.label, interaction.response.status_code // 100)] += 1
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            errors.append(str(getattr(event, "value", None) or getattr(event, "exception", None)))
    operations = {op.ok().label for op in api_schema.get_all_operations()}
    assert not errors, errors
    assert operations <= tested, f"never called: {operations - tested}"
    # not a run of refusals only: valid chat requests were answered, and invalid ones refused
    assert answered[("POST /v1/chat/completions", 2)] >= 10 and answered[("POST /v1/chat/completions", 4)] >= 10, answered
    assert not failures, "\n\n".join(dict.fromkeys(failures))
