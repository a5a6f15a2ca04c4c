"""The loop closes on one machine: serve -> record -> judge -> train -> gate -> swap, in a live `whet serve`.

A real uvicorn process on a tiny local model with the learner alongside (the
default deployment); the test only talks HTTP to it and reads the store file
afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import httpx
import pytest
import yaml

from whet.memory.store import open_store

from test_loopback import tiny_model, whet_serve  # noqa: F401 (fixture)

pytestmark = pytest.mark.loopback

BATCH = 4


def chat(client: httpx.Client, text: str) -> str:
    """One request in a fresh session; returns the turn id of the answer."""
    # greedy: a sampled reply of the untrained model may hold a tool call (a third judged turn)
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
    response = client.post("/v1/chat/completions", json=body, headers={"X-Whet-Session": uuid.uuid4().hex})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def wait_for(check, deadline_s: float = 120.0, every_s: float = 0.02):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every_s)  # polling a separate process over HTTP: there is no event to wait on
    pytest.fail(f"not reached within {deadline_s}s")


def test_feedback_bearing_turns_put_a_new_adapter_live_without_a_restart(tmp_path, tiny_model):  # noqa: F811
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {}}))
    config = {
        "model": {"id": str(tiny_model), "served_name": "tiny", "max_new_tokens": 8},
        "mcp": {"config": str(mcp_file)},
        "learner": {"batch_size": BATCH, "batch_timeout_s": 3600, "poll_s": 0.2, "gate": {"holdout_fraction": 0.0}},
    }
    with whet_serve(tmp_path, config) as base, httpx.Client(base_url=base, timeout=60) as client:
        started = client.get("/health").json()
        assert started["adapter"] is None
        for i in range(BATCH):
            turn_id = chat(client, f"Remind me about task {i}")
            assert client.get(f"/v1/turns/{turn_id}").json()["policy_version"] is None
            thumbs = "up" if i % 2 == 0 else "down"
            assert client.post("/v1/feedback", json={"turn_id": turn_id, "thumbs": thumbs}).status_code == 201
        version = wait_for(lambda: client.get("/health").json()["adapter"])
        serving_at = time.time()
        after = client.get("/health").json()
        assert after["uptime_s"] >= started["uptime_s"], "the same process, not a restart"
        later = chat(client, "Remind me about the next task")
        assert client.get(f"/v1/turns/{later}").json()["policy_version"] == version

    async def read_store():
        store = open_store(f"sqlite:///{tmp_path / 'data' / 'whet.db'}")
        try:
            adapter = await store.get_adapter(version)
            judged = await store.list_judgments(trained_in=version)
            return adapter, judged
        finally:
            await store.aclose()

    adapter, judged = anyio.run(read_store)
    assert adapter.status == "live" and adapter.metrics["gate"]["accepted"]
    # where the step's time went, phase by phase (the first step's start loads the model)
    seconds = adapter.metrics["seconds"]
    assert set(seconds) == {"start", "replay_before", "train", "repair", "replay_after", "pinned_after"}
    assert all(s >= 0 for s in seconds.values()) and seconds["train"] > 0
    # the shipped learner checks for repair (learner.rehearsal.repair_passes: 4): one count a check, each check
    # the chats near a call and the watched replies lost, the last one 0 or after the last pass
    repairs = adapter.metrics["repairs"]
    assert 1 <= len(repairs) <= 5 and all(n >= 0 for n in repairs) and (repairs[-1] == 0 or len(repairs) == 5)
    assert len(judged) == BATCH and {j.score for j in judged} == {1, -1}
    assert Path(adapter.path, "adapter_model.safetensors").is_file()
    latency = serving_at - max(j.created_at.timestamp() for j in judged)
    print(f"\nlast judged turn of the batch -> {version} serving: {latency:.2f} s")
    assert latency > 0


def whet_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WHET_")}
    return subprocess.run([sys.executable, "-m", "whet.runtime.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def test_serve_without_learner_and_whet_learn_elsewhere_talk_only_through_postgresql_and_mqtt(
    tmp_path, tiny_model, postgres_schema_url, mqtt_url  # noqa: F811
):
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {}}))
    bus = f"{mqtt_url}/whet-test-{uuid.uuid4().hex[:8]}"
    config = {
        "model": {"id": str(tiny_model), "served_name": "tiny", "max_new_tokens": 8},
        "mcp": {"config": str(mcp_file)},
        "store": {"url": postgres_schema_url},
        "bus": {"url": bus},
        # the server's store poll is slow on purpose: what reaches it within the test came over MQTT
        "learner": {"enabled": False, "batch_size": 2, "poll_s": 600, "gate": {"holdout_fraction": 0.0}},
    }
    learn_config = tmp_path / "learn.yaml"
    learn_config.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"), **config,
                                            "learner": {**config["learner"], "enabled": True}}))  # fmt: skip
    with whet_serve(tmp_path, config) as base, httpx.Client(base_url=base, timeout=60) as client:
        for i, thumbs in enumerate(("up", "down")):
            turn_id = chat(client, f"Add milk to list {i}")
            assert client.post("/v1/feedback", json={"turn_id": turn_id, "thumbs": thumbs}).status_code == 201

        learned = whet_cli("learn", "--once", "--config", str(learn_config))
        assert learned.returncode == 0, learned.stderr
        assert "steps 1 (1 promoted" in learned.stdout
        version = wait_for(lambda: client.get("/health").json()["adapter"], deadline_s=30)
        assert version == "global-0001"
        assert client.get(f"/v1/turns/{chat(client, 'Add eggs')}").json()["policy_version"] == version

        listed = whet_cli("adapters", "list", "--json", "--config", str(learn_config))
        assert listed.returncode == 0, listed.stderr
        [row] = json.loads(listed.stdout)
        assert row["id"] == version and row["status"] == "live" and len(row["trained_on"]) == 2

        rolled = whet_cli("adapters", "rollback", "--config", str(learn_config))
        assert rolled.returncode == 0 and "now serving the base weights" in rolled.stdout, rolled.stderr
        wait_for(lambda: client.get("/health").json()["adapter"] is None, deadline_s=30)
        assert client.get(f"/v1/turns/{chat(client, 'Add tea')}").json()["policy_version"] is None

        promoted = whet_cli("adapters", "promote", version, "--config", str(learn_config))
        assert promoted.returncode == 0, promoted.stderr
        wait_for(lambda: client.get("/health").json()["adapter"] == version, deadline_s=30)

        missing = whet_cli("adapters", "show", "global-9999", "--config", str(learn_config))
        assert missing.returncode == 1 and "whet adapters list" in missing.stderr and "Traceback" not in missing.stderr


PROBES = ["What is 17 times 23?", "Write a haiku about autumn.", "What time is it at home?"]


def _answers(client: httpx.Client, key: str) -> list[tuple[str, str | None]]:
    """bob's probe set at temperature 0, never learnt from (store: false): each answer's text and
    the adapter version that served it."""
    out = []
    for text in PROBES:
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8,
                "temperature": 0, "store": False}  # fmt: skip
        response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}",
                                                                            "X-Whet-Session": uuid.uuid4().hex})  # fmt: skip
        assert response.status_code == 200, response.text
        turn = client.get(f"/v1/turns/{response.json()['id']}", headers={"Authorization": f"Bearer {key}"}).json()
        out.append((response.json()["choices"][0]["message"]["content"], turn["policy_version"]))
    return out


def test_one_users_flood_of_wrong_feedback_leaves_another_users_answers_exactly_as_they_were(tmp_path, tiny_model):  # noqa: F811
    """Two API keys and the default learner.scope (auto, so per user): alice thumbs down every
    answer and contradicts it until the learner has trained and put live an adapter of hers; bob's
    probe set (general requests and one of his own) then gets the same greedy answers from the same
    (base) weights. (Run with learner.scope: global instead, the same flood reaches bob: his answers
    then come from the adapter alice's flood trained, which is what the per-user default prevents.)"""
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {}}))
    keys = {"sk-alice": "alice", "sk-bob": "bob"}
    learner = {"batch_size": BATCH, "batch_timeout_s": 3600, "poll_s": 0.2, "gate": {"holdout_fraction": 0.0}}
    config = {
        "model": {"id": str(tiny_model), "served_name": "tiny", "max_new_tokens": 8},
        "mcp": {"config": str(mcp_file)},
        "server": {"api_keys": keys},
        "learner": learner,
    }
    alice = {"Authorization": "Bearer sk-alice"}
    with whet_serve(tmp_path, config) as base, httpx.Client(base_url=base, timeout=60) as client:
        before = _answers(client, "sk-bob")
        assert {version for _, version in before} == {None}

        def flood_once() -> str | None:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "What time is it at home?"}],
                    "max_tokens": 8}  # fmt: skip
            response = client.post("/v1/chat/completions", json=body,
                                   headers={**alice, "X-Whet-Session": uuid.uuid4().hex})  # fmt: skip
            assert response.status_code == 200, response.text
            turn_id = response.json()["id"]
            wrong = {"turn_id": turn_id, "thumbs": "down", "text": "No, that is wrong: I meant Reykjavik."}
            assert client.post("/v1/feedback", json=wrong, headers=alice).status_code == 201
            return client.get(f"/v1/turns/{turn_id}", headers=alice).json()["policy_version"]

        for _ in range(BATCH):
            flood_once()
        alices = wait_for(flood_once, deadline_s=180, every_s=0.5)  # her answers come from an adapter trained on her flood
        after = _answers(client, "sk-bob")
    assert alices.startswith("user-alice-")
    assert after == before  # the same words from the same weights: success and general skill did not move
