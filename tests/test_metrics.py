"""Prometheus /metrics: request latency by route, tool calls by tool, verdicts, adapters, live version."""

from __future__ import annotations

import pytest
from test_api import CALC_CALL, chat_body, serve

from whet.memory.tables import Adapter, Judgment
from whet.runtime.scripted import ScriptedBackend

pytestmark = pytest.mark.anyio

BAD_CALC = '<tool_call>{"name": "calculate", "arguments": {"expression": "1/"}}</tool_call>'


async def test_metrics_name_routes_tools_verdicts_adapter_versions_and_the_live_version(tmp_path):
    backend = ScriptedBackend([CALC_CALL, BAD_CALC, "391."])
    async with serve(tmp_path, backend, learner={"enabled": False}) as (http, res):
        reply = (await http.post("/v1/chat/completions", json=chat_body("17*23?"))).json()
        await http.get("/v1/turns/turn_nope")
        steps = await res.store.request_turns((await res.store.get_turn(reply["id"])).request_id)
        for turn, score in zip(steps, (-1, 1, 1), strict=True):
            await res.store.save_judgment(Judgment(turn_id=turn.id, user_id=turn.user_id,
                                                   request_id=turn.request_id, score=score))  # fmt: skip
        await res.store.add_adapter(Adapter(id="global-0001", scope="global", path="/x", status="rejected"))
        await res.store.add_adapter(Adapter(id="global-0002", scope="global", path="/y", status="candidate"))
        text = (await http.get("/metrics")).text
    assert 'whet_http_request_seconds_count{method="POST",route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'whet_http_request_seconds_count{method="GET",route="/v1/turns/{turn_id}",status="404"} 1.0' in text
    assert 'whet_tool_calls_total{outcome="ok",server="calc",tool="calculate"} 1.0' in text
    assert 'whet_tool_calls_total{outcome="error",server="calc",tool="calculate"} 1.0' in text
    assert 'whet_judged_turns{verdict="-1"} 1.0' in text and 'whet_judged_turns{verdict="+1"} 2.0' in text
    assert 'whet_judged_turns{verdict="0"} 0.0' in text
    assert 'whet_adapter_versions{status="rejected"} 1.0' in text
    assert 'whet_adapter_versions{status="candidate"} 1.0' in text
    assert 'whet_live_adapter_info{version="base"} 1.0' in text

