"""The page at / in a real browser: Debian's chromium, headless, driven by Playwright.

`whet serve` runs as a real process (keys on, the bundled MCP servers, the learner alongside);
its policy is an OpenAI-compatible fake we script, so the answers and the tool call are known.
Screenshots go to the test's tmp dir (and to $WHET_SCREENSHOTS when set) to be looked at.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from test_loopback import run_in_thread, whet_serve

pytestmark = pytest.mark.loopback

CHROMIUM = "/usr/bin/chromium"
KEY = "sk-browser"
CORRECTION = "Say only the number: 391"


def require_browser():
    """Playwright's sync API, or a skip in one line (a failure under CI=true)."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "playwright is not installed (pip install playwright)"
    if missing is None and not Path(CHROMIUM).exists():
        missing = f"{CHROMIUM} is missing (apt-get install -y chromium)"
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing} (CI=true: the browser test must run)")
        pytest.skip(missing)
    return sync_playwright


def policy_app() -> Starlette:
    """Asked for arithmetic it calls the bundled calculator, then reads the result; else it greets."""

    def call(name: str, arguments: dict) -> list[dict]:
        return [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]

    def reply(messages: list[dict]) -> tuple[str, list[dict]]:
        last = messages[-1]
        if last["role"] == "tool":
            if last["content"].startswith("error: the user rejected"):
                return "All right, I kept the note.", []
            result = json.loads(last["content"])
            if "deleted" in result:
                return f"Deleted “{result['deleted']['text']}”.", []
            if "id" in result:
                return f"Saved as note {result['id']}.", []
            return f"17 times 23 is {result['text']}.", []
        asked = last.get("content") or ""
        if "17*23" in asked:
            return "Let me calculate that.", call("calculate", {"expression": "17*23"})
        if asked.startswith("remember "):
            return "Noting it.", call("add_note", {"text": asked.removeprefix("remember ")})
        if asked.startswith("delete note "):
            return "I will delete it.", call("delete_note", {"note_id": int(asked.split()[-1])})
        return "Hello! Ask me to calculate something.", []

    async def completions(request: Request):
        body = await request.json()
        text, calls = reply(body["messages"])

        async def events():
            def chunk(delta: dict, finish: str | None = None) -> str:
                payload = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"],
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                return f"data: {json.dumps(payload)}\n\n"

            for word in text.split(" "):
                yield chunk({"content": word + " "})
            if calls:
                yield chunk({"tool_calls": [{"index": 0, **calls[0]}]})
            yield chunk({}, "tool_calls" if calls else "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


def test_a_person_chats_corrects_an_answer_and_sees_the_lesson_in_the_learning_view(tmp_path):
    sync_playwright = require_browser()
    shots = tmp_path / "screens"
    shots.mkdir()
    with run_in_thread(policy_app()) as policy_url:
        config = {"model": {"backend": "openai", "id": "policy", "base_url": policy_url},
                  "server": {"api_keys": {KEY: "tester"}}}
        with whet_serve(tmp_path, config) as base, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            try:
                drive(page, base, shots)
            finally:
                page.screenshot(path=str(shots / "last.png"))
                browser.close()
            lessons = httpx.get(f"{base}/v1/lessons", headers={"Authorization": f"Bearer {KEY}"}).json()
            assert lessons == []  # deleted on the page: gone from the store
    keep = os.environ.get("WHET_SCREENSHOTS")
    if keep:
        shutil.copytree(shots, keep, dirs_exist_ok=True)


def drive(page, base: str, shots: Path) -> None:
    from playwright.sync_api import expect

    page.goto(base)
    # keys are on: the page asks for one, keeps it, and then knows the model
    expect(page.locator("#key-dialog")).to_be_visible()
    page.fill("#key-input", KEY)
    page.click("#key-save")
    expect(page.locator("#model-name")).to_have_text("policy")

    page.fill("#prompt", "what is 17*23?")
    page.keyboard.press("Enter")
    answer = page.locator(".msg.assistant").last
    expect(answer.locator(".bubble")).to_have_text("Let me calculate that. 17 times 23 is 391.", timeout=30_000)
    expect(answer.locator(".tool")).to_contain_text("calculate")
    expect(answer.locator(".tool")).to_contain_text("391")
    expect(answer.locator(".foot .version")).to_have_text("adapter base")
    expect(page.locator("#session-list li")).to_have_count(1)
    page.screenshot(path=str(shots / "chat.png"))

    answer.locator("[data-action=down]").click()
    page.fill(".correct input", CORRECTION)
    page.click(".correct button")
    expect(answer.locator(".foot .sent")).to_contain_text("feedback recorded")
    page.screenshot(path=str(shots / "feedback.png"))

    # the learner judges the correction and keeps its lesson; the view shows it once there
    lesson = page.locator("#lessons li", has_text=CORRECTION)
    for _ in range(30):
        page.click("#tab-learning")
        page.wait_for_load_state("networkidle")
        if lesson.count():
            break
        page.click("#tab-chat")
        page.wait_for_timeout(500)  # polling the learner through the page: no event to wait on
    expect(lesson).to_have_count(1)
    expect(page.locator("#judged tbody tr").first).to_contain_text(CORRECTION)
    page.screenshot(path=str(shots / "learning.png"), full_page=True)

    lesson.locator("button").click()
    expect(lesson).to_have_count(0)


def test_a_person_approves_a_destructive_tool_call_on_the_page_and_the_answer_goes_on(tmp_path):
    sync_playwright = require_browser()
    shots = tmp_path / "screens"
    shots.mkdir()
    with run_in_thread(policy_app()) as policy_url:
        config = {"model": {"backend": "openai", "id": "policy", "base_url": policy_url},
                  "server": {"api_keys": {KEY: "tester"}}, "learner": {"enabled": False}}
        with whet_serve(tmp_path, config) as base, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            try:
                approve_on_page(page, base, shots)
            finally:
                page.screenshot(path=str(shots / "approval-last.png"))
                browser.close()
            auth = {"Authorization": f"Bearer {KEY}"}
            decided = httpx.get(f"{base}/v1/approvals?status=all", headers=auth).json()
            assert [(a["status"], a["calls"][0]["name"], a["decided_by"]) for a in decided] == [
                ("approved", "delete_note", "tester")]
    keep = os.environ.get("WHET_SCREENSHOTS")
    if keep:
        shutil.copytree(shots, keep, dirs_exist_ok=True)


def approve_on_page(page, base: str, shots: Path) -> None:
    from playwright.sync_api import expect

    page.goto(base)
    page.fill("#key-input", KEY)
    page.click("#key-save")
    expect(page.locator("#model-name")).to_have_text("policy")

    page.fill("#prompt", "remember buy milk")
    page.keyboard.press("Enter")
    saved = page.locator(".msg.assistant").last
    expect(saved.locator(".bubble")).to_have_text("Noting it. Saved as note 1.", timeout=30_000)

    expect(page.locator("#send")).to_be_enabled()  # the first answer is done
    page.fill("#prompt", "delete note 1")
    page.keyboard.press("Enter")
    answer = page.locator(".msg.assistant").last
    box = answer.locator(".approval")
    expect(box).to_contain_text("needs your approval", timeout=30_000)
    expect(box).to_contain_text("delete_note")
    expect(box).to_contain_text('{"note_id":1}')
    expect(answer.locator(".bubble")).to_have_text("I will delete it.")
    expect(answer.locator(".tool")).to_contain_text("waiting for approval")
    expect(answer.locator("[data-action=up]")).to_have_count(0)  # nothing to rate before the decision
    page.screenshot(path=str(shots / "approval-pending.png"))

    box.locator("[data-action=approve]").click()
    expect(answer.locator(".bubble")).to_have_text("I will delete it. Deleted “buy milk”.", timeout=30_000)
    expect(box).to_contain_text("approved")
    expect(answer.locator(".tool")).to_contain_text("buy milk")  # the call ran: its result is shown
    expect(answer.locator("[data-action=up]")).to_have_count(1)  # the continued answer can be rated
    page.screenshot(path=str(shots / "approval-approved.png"))
