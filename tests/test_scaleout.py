"""The scale-out deployment on one machine: PostgreSQL + Mosquitto + two `whet serve --no-learner` + `whet learn`.

Real processes on free ports with the tiny model; they share only the store, the bus and the
adapter folder (``data_dir``), as replicas behind a load balancer would. The replicas' store
poll is slow on purpose (600 s): what reaches them within the test came over MQTT.
"""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx
import pytest
from test_learning_loop import chat, wait_for

from test_loopback import free_port, spawn_whet, stop, tiny_model, wait_healthy  # noqa: F401 (fixture)

pytestmark = pytest.mark.loopback

BATCH = 4
CORRECTION = "No, I meant Lisbon time"


def prompt_text(client: httpx.Client, turn_id: str) -> str:
    turn = client.get(f"/v1/turns/{turn_id}").json()
    return json.dumps(turn["prompt_messages"])


def test_two_replicas_and_a_learner_share_turns_adapters_lessons_and_lose_no_turn_to_a_kill(
    tmp_path,
    tiny_model,  # noqa: F811
    postgres_schema_url,
    mqtt_url,
):
    mcp_file = tmp_path / "mcp.json"
    mcp_file.write_text(json.dumps({"mcpServers": {}}))
    config = {
        "data_dir": str(tmp_path / "data"),  # shared: the learner writes adapters where the replicas read them
        "model": {"id": str(tiny_model), "served_name": "tiny", "max_new_tokens": 8},
        "mcp": {"config": str(mcp_file)},
        "store": {"url": postgres_schema_url},
        "bus": {"url": f"{mqtt_url}/whet-test-{uuid.uuid4().hex[:8]}"},
        "learner": {"enabled": False, "batch_size": BATCH, "batch_timeout_s": 3600, "poll_s": 600,
                    "gate": {"holdout_fraction": 0.0, "regression_set": None}},
    }  # fmt: skip
    learn_config = {**config, "learner": {**config["learner"], "enabled": True, "poll_s": 1}}
    procs = {}
    try:
        bases = {}
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            port = free_port()
            procs[name] = spawn_whet(tmp_path / name, config, "serve", "--no-learner", "--port", str(port))
            bases[name] = f"http://127.0.0.1:{port}"
        procs["learn"] = spawn_whet(tmp_path, learn_config, "learn", name="learn")
        for name, base in bases.items():
            wait_healthy(base, *procs[name])
        with (
            httpx.Client(base_url=bases["a"], timeout=60) as a,
            httpx.Client(base_url=bases["b"], timeout=60) as b,
        ):
            check_the_deployment(a, b, procs["a"][0], tmp_path / "data" / "adapters")
    finally:
        for proc, _ in procs.values():
            stop(proc)
        for name, (_, log) in procs.items():
            print(f"--- {name}: {Path(log).read_text()[-1500:]}")


def check_the_deployment(
    a: httpx.Client, b: httpx.Client, a_process: subprocess.Popen, adapters: Path
) -> None:
    # turns from both replicas make one batch; feedback may reach either replica
    turns = {"a": [chat(a, f"Remind me about task {i}") for i in range(BATCH // 2)],
             "b": [chat(b, f"Remind me about chore {i}") for i in range(BATCH // 2)]}  # fmt: skip
    rated = [(b, turns["a"][0], {"thumbs": "up"}), (a, turns["a"][1], {"score": -1, "text": CORRECTION}),
             (a, turns["b"][0], {"thumbs": "up"}), (b, turns["b"][1], {"thumbs": "down"})]  # fmt: skip
    for client, turn_id, feedback in rated:
        response = client.post("/v1/feedback", json={"turn_id": turn_id, **feedback})
        assert response.status_code == 201, response.text

    # the learner trains on all four and publishes; both replicas serve the new version
    version = wait_for(lambda: a.get("/health").json()["adapter"], deadline_s=120)
    wait_for(lambda: b.get("/health").json()["adapter"] == version, deadline_s=30)
    state = json.loads((adapters / "global" / version / "trainer_state.json").read_text())
    assert sorted(state["batch"]) == sorted(turns["a"] + turns["b"])
    for client in (a, b):
        assert client.get(f"/v1/turns/{chat(client, 'Remind me again')}").json()["policy_version"] == version

    # the correction became a lesson that replica b retrieves; deleting it on a takes it out of b too
    [lesson] = wait_for(lambda: a.get("/v1/lessons").json(), deadline_s=30)
    assert "Lisbon" in lesson["text"]
    assert wait_for(lambda: "Lisbon" in prompt_text(b, chat(b, "What time is it at home?")), deadline_s=30)
    assert a.delete(f"/v1/lessons/{lesson['id']}").status_code == 204
    assert wait_for(
        lambda: "Lisbon" not in prompt_text(b, chat(b, "What time is it at home?")), deadline_s=30
    )

    # SIGKILL replica a while requests are in flight: every answer it gave is a turn in the store
    acknowledged = []
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(chat, a, f"Remind me about errand {i}") for i in range(6)]
        for future in as_completed(futures):
            try:
                acknowledged.append(future.result())
            except (httpx.HTTPError, AssertionError):
                continue  # cut off by the kill: never acknowledged
            if len(acknowledged) == 2:
                a_process.send_signal(signal.SIGKILL)
    assert a_process.wait(timeout=10) == -signal.SIGKILL
    assert len(acknowledged) >= 2
    for turn_id in acknowledged:
        assert b.get(f"/v1/turns/{turn_id}").status_code == 200, f"acknowledged turn {turn_id} was lost"
    assert b.get(f"/v1/turns/{chat(b, 'Still there?')}").json()["policy_version"] == version
