"""The bundled MCP servers, driven through the real protocol (in-process), plus one stdio launch."""

from __future__ import annotations

import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from whet.servers import calc, clock, notes

pytestmark = pytest.mark.anyio

PINNED_NOW = datetime(2024, 7, 15, 12, 30, 0, tzinfo=UTC)  # a Monday, summer time in Europe


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """Call a tool that must succeed; return its structured result."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


async def call_error(client: Client, tool: str, **arguments: Any) -> str:
    """Call a tool that must fail as a tool error (not a crash); return the message."""
    result = await client.call_tool(tool, arguments)
    assert result.is_error, result.structured_content
    text = result.content[0].text  # type: ignore[union-attr]
    assert text != f"Error executing tool {tool}", "the tool crashed instead of reporting the problem"
    return text


async def assert_every_tool_is_annotated(client: Client, expected: set[str]) -> dict[str, Any]:
    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == expected
    for tool in tools.values():
        assert tool.description, tool.name
        assert tool.annotations is not None, tool.name
        assert tool.annotations.read_only_hint is not None, tool.name
        assert tool.annotations.destructive_hint is not None, tool.name
        assert tool.input_schema["type"] == "object", tool.name
    return tools


# --- notes -----------------------------------------------------------------------------------


async def test_notes_tools_are_annotated_and_only_deleting_is_destructive() -> None:
    async with Client(notes.build_server(":memory:", forget_tool=True)) as client:
        tools = await assert_every_tool_is_annotated(
            client, {"add_note", "list_notes", "search_notes", "complete_todo", "delete_note", "whet_forget_user"}
        )
    destructive = {name for name, tool in tools.items() if tool.annotations.destructive_hint}
    read_only = {name for name, tool in tools.items() if tool.annotations.read_only_hint}
    assert destructive == {"delete_note", "whet_forget_user"}
    assert read_only == {"list_notes", "search_notes"}


async def test_added_todo_is_listed_in_its_list_until_completed() -> None:
    async with Client(notes.build_server(":memory:")) as client:
        milk = await call(client, "add_note", text="buy milk", list_name="Groceries", kind="todo")
        await call(client, "add_note", text="finish report", list_name="work", kind="todo")
        await call(client, "add_note", text="oat milk is nicer", list_name="groceries")
        assert milk["list"] == "groceries" and milk["kind"] == "todo" and not milk["done"]

        groceries = await call(client, "list_notes", list_name="groceries")
        assert [n["text"] for n in groceries["notes"]] == ["buy milk", "oat milk is nicer"]
        todos = await call(client, "list_notes", kind="todo")
        assert [n["text"] for n in todos["notes"]] == ["buy milk", "finish report"]

        done = await call(client, "complete_todo", note_id=milk["id"])
        assert done["done"] and done["completed_at"]
        again = await call(client, "complete_todo", note_id=milk["id"])
        assert again["completed_at"] == done["completed_at"]

        open_groceries = await call(client, "list_notes", list_name="groceries")
        assert [n["text"] for n in open_groceries["notes"]] == ["oat milk is nicer"]
        everything = await call(client, "list_notes", list_name="groceries", include_completed=True)
        assert everything["count"] == 2


async def test_search_matches_every_word_case_insensitively() -> None:
    async with Client(notes.build_server(":memory:")) as client:
        await call(client, "add_note", text="Call the Dentist on Friday")
        await call(client, "add_note", text="dentist bill paid", list_name="money")
        await call(client, "add_note", text="call mum", kind="todo")
        found = await call(client, "search_notes", query="dentist CALL")
        assert [n["text"] for n in found["notes"]] == ["Call the Dentist on Friday"]
        in_money = await call(client, "search_notes", query="dentist", list_name="money")
        assert [n["list"] for n in in_money["notes"]] == ["money"]
        assert (await call(client, "search_notes", query="holiday"))["count"] == 0


async def test_list_limit_reports_truncation() -> None:
    async with Client(notes.build_server(":memory:")) as client:
        for number in range(3):
            await call(client, "add_note", text=f"note {number}")
        page = await call(client, "list_notes", limit=2)
        assert page["count"] == 2 and page["truncated"]
        assert not (await call(client, "list_notes", limit=3))["truncated"]


async def test_delete_removes_the_note_and_unknown_ids_are_tool_errors() -> None:
    async with Client(notes.build_server(":memory:")) as client:
        note = await call(client, "add_note", text="temporary")
        deleted = await call(client, "delete_note", note_id=note["id"])
        assert deleted["deleted"]["text"] == "temporary"
        assert (await call(client, "list_notes"))["count"] == 0
        assert f"id {note['id']}" in await call_error(client, "delete_note", note_id=note["id"])
        assert "id 999" in await call_error(client, "complete_todo", note_id=999)


async def test_bad_note_requests_are_tool_errors_with_reasons() -> None:
    async with Client(notes.build_server(":memory:")) as client:
        plain = await call(client, "add_note", text="just a note")
        assert "not a todo" in await call_error(client, "complete_todo", note_id=plain["id"])
        assert "empty" in await call_error(client, "add_note", text="   ")
        assert "kind" in await call_error(client, "add_note", text="x", kind="reminder")
        assert "empty" in await call_error(client, "search_notes", query="  ")


async def test_notes_survive_a_restart_of_the_server(tmp_path: Path) -> None:
    db_path = tmp_path / "notes.db"
    async with Client(notes.build_server(db_path)) as client:
        await call(client, "add_note", text="remember me", kind="todo")
    async with Client(notes.build_server(db_path)) as client:
        listed = await call(client, "list_notes")
    assert [n["text"] for n in listed["notes"]] == ["remember me"]


def test_notebook_serves_concurrent_writers_each_their_own_note(tmp_path: Path) -> None:
    notebook = notes.NoteBook(tmp_path / "notes.db")
    mixed_up: list[tuple[str, str]] = []

    def write(writer: int) -> None:
        for number in range(25):
            text = f"{writer}-{number}"
            returned = notebook.add("", text, "load", "note").text
            if returned != text:
                mixed_up.append((text, returned))

    threads = [threading.Thread(target=write, args=(writer,)) for writer in range(8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        listed = notebook.find("", [], "load", None, True, 500)
    finally:
        notebook.close()
    assert mixed_up == []
    assert listed.count == 200 and len({note.id for note in listed.notes}) == 200


# --- calc ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "text"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-2 ** 2", "-4"),
        ("2 ** 3 ** 2", "512"),
        ("2^10", "1024"),
        ("7 // 2", "3"),
        ("7 % 3", "1"),
        ("10 / 4", "2.5"),
        ("0.1 + 0.2", "0.3"),
        ("15% of 80", "12"),
        ("200 * 5%", "10"),
        ("sqrt(16) + abs(-3)", "7"),
        ("round(2.5) + round(3.14159, 2)", "6.14"),
        ("min(4, 2, 8) * max(1, 5)", "10"),
        ("log(1000) + ln(e) + log(8, 2)", "7"),
        ("sin(pi / 2) + cos(0) + tan(0)", "2"),
        ("2 ** 100", "1267650600228229401496703205376"),
    ],
)
async def test_calculate_evaluates_arithmetic(expression: str, text: str) -> None:
    async with Client(calc.build_server()) as client:
        result = await call(client, "calculate", expression=expression)
    assert result["text"] == text
    assert result["result"] == pytest.approx(float(text))


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os')", "strings are not supported"),
        ("__import__(1)", "not a known function"),
        ("().__class__", "attribute access"),
        ("open", "Unknown name 'open'"),
        ("x + 1", "Unknown name 'x'"),
        ("9**9**9", "more than 1000 digits"),
        ("10**999 * 10**999", "more than 1000 digits"),
        ("1 / 0", "Division by zero"),
        ("sqrt(-1)", "undefined"),
        ("(-8) ** (1/3)", "not a real number"),
        ("2pi", "operator is missing"),
        ("(1 + 2", "never closed"),
        ("1 +", "end of the expression"),
        ("", "empty"),
        ("(" * 200 + "1" + ")" * 200, "nests deeper"),
        ("round(1, 10**9)", "digits between"),
    ],
)
async def test_calculate_refuses_bad_or_unsafe_expressions_with_reasons(expression: str, reason: str) -> None:
    async with Client(calc.build_server()) as client:
        message = await call_error(client, "calculate", expression=expression)
    assert reason in message


@pytest.mark.parametrize(
    ("value", "source", "target", "expected"),
    [
        (5, "km", "miles", 3.10685596119),
        (1, "mile", "kilometre", 1.609344),
        (10, "lbs", "kg", 4.5359237),
        (100, "°C", "fahrenheit", 212),
        (32, "F", "celsius", 0),
        (0, "celsius", "K", 273.15),
        (1, "gallon", "l", 3.785411784),
        (90, "minutes", "hours", 1.5),
        (100, "km/h", "mph", 62.1371192237),
        (60, "miles per hour", "m/s", 26.8224),
        (1, "GiB", "MB", 1073.741824),
        (8, "Mbit", "MB", 1),
        (1, "kilometer", "m", 1000),
    ],
)
async def test_convert_handles_units_and_aliases(
    value: float, source: str, target: str, expected: float
) -> None:
    async with Client(calc.build_server()) as client:
        result = await call(client, "convert", value=value, from_unit=source, to_unit=target)
    assert result["result"] == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert "=" in result["text"]


async def test_convert_errors_name_the_problem() -> None:
    async with Client(calc.build_server()) as client:
        incompatible = await call_error(client, "convert", value=1, from_unit="kg", to_unit="km")
        unknown = await call_error(client, "convert", value=1, from_unit="furlongz", to_unit="m")
        too_cold = await call_error(client, "convert", value=-300, from_unit="C", to_unit="K")
        not_a_number = await call_error(client, "convert", value="lots", from_unit="m", to_unit="km")
    assert "mass" in incompatible and "length" in incompatible
    assert "Unknown unit 'furlongz'" in unknown
    assert "absolute zero" in too_cold
    assert "value" in not_a_number


async def test_calc_tools_are_annotated_read_only() -> None:
    async with Client(calc.build_server()) as client:
        tools = await assert_every_tool_is_annotated(client, {"calculate", "convert", "list_units"})
        catalogue = await call(client, "list_units")
    assert all(tool.annotations.read_only_hint for tool in tools.values())
    dimensions = {"length", "mass", "volume", "temperature", "time", "speed", "data"}
    assert dimensions <= set(catalogue["dimensions"])


@pytest.mark.loopback
async def test_calc_runs_as_a_stdio_subprocess(tmp_path: Path) -> None:
    params = StdioServerParameters(command=sys.executable, args=["-m", "whet.servers.calc"])
    stderr_path = tmp_path / "stderr.log"
    with stderr_path.open("w") as errlog, anyio.fail_after(60):
        # The client (and so the subprocess) is opened and closed in this one task.
        async with Client(stdio_client(params, errlog=errlog)) as client:
            result = await call(client, "calculate", expression="6 * 7")
            refused = await call_error(client, "calculate", expression="__import__('os')")
    assert result["text"] == "42", stderr_path.read_text()
    assert "strings are not supported" in refused


# --- clock -----------------------------------------------------------------------------------


def pinned_clock() -> Any:
    return clock.build_server(now=lambda: PINNED_NOW)


async def test_clock_tools_are_annotated_read_only() -> None:
    async with Client(pinned_clock()) as client:
        tools = await assert_every_tool_is_annotated(
            client, {"now", "add_to_date", "days_between", "weekday", "convert_time"}
        )
    assert all(tool.annotations.read_only_hint for tool in tools.values())


async def test_now_reads_the_injected_clock_in_the_named_timezone() -> None:
    async with Client(pinned_clock()) as client:
        utc = await call(client, "now")
        lisbon = await call(client, "now", timezone="Lisbon")
        new_york = await call(client, "now", timezone="america/new_york")
        offset = await call(client, "now", timezone="UTC+5:30")
    assert utc["datetime"] == "2024-07-15T12:30:00+00:00" and utc["weekday"] == "Monday"
    assert lisbon["timezone"] == "Europe/Lisbon" and lisbon["time"] == "13:30:00" and lisbon["is_dst"]
    assert new_york["timezone"] == "America/New_York" and new_york["time"] == "08:30:00"
    assert offset["time"] == "18:00:00"


async def test_unknown_timezone_is_a_tool_error_with_a_suggestion() -> None:
    async with Client(pinned_clock()) as client:
        message = await call_error(client, "now", timezone="Lisbn")
    assert "Unknown timezone 'Lisbn'" in message and "Europe/Lisbon" in message


async def test_add_to_date_clamps_months_to_their_end() -> None:
    async with Client(pinned_clock()) as client:
        leap = await call(client, "add_to_date", date="2024-01-31", months=1)
        common = await call(client, "add_to_date", date="2023-01-31", months=1)
        back = await call(client, "add_to_date", date="2024-02-29", years=-1)
        mixed = await call(client, "add_to_date", date="2024-12-25", weeks=1, days=-2)
    assert leap["date"] == "2024-02-29"
    assert common["date"] == "2023-02-28"
    assert back["date"] == "2023-02-28"
    assert mixed["date"] == "2024-12-30" and mixed["weekday"] == "Monday"


async def test_days_between_and_weekday() -> None:
    async with Client(pinned_clock()) as client:
        forward = await call(client, "days_between", start="2024-01-01", end="2024-12-25")
        backward = await call(client, "days_between", start="2024-03-01", end="2024-02-28")
        day = await call(client, "weekday", date="2000-01-01")
    assert forward["days"] == 359
    assert backward["days"] == -2
    assert day["weekday"] == "Saturday" and day["iso_weekday"] == 6


async def test_bad_dates_and_times_are_tool_errors() -> None:
    async with Client(pinned_clock()) as client:
        assert "YYYY-MM-DD" in await call_error(client, "weekday", date="2024-02-30")
        assert "YYYY-MM-DD" in await call_error(client, "days_between", start="tomorrow", end="2024-01-01")
        assert "years 1 to 9999" in await call_error(client, "add_to_date", date="9999-12-01", months=1)
        bad_time = {"time": "25:00", "from_timezone": "UTC", "to_timezone": "Tokyo"}
        assert "25:00" in await call_error(client, "convert_time", **bad_time)


async def test_convert_time_between_zones_follows_daylight_saving() -> None:
    async with Client(pinned_clock()) as client:
        lisbon_to_tokyo = {"from_timezone": "Lisbon", "to_timezone": "Tokyo"}
        summer = await call(client, "convert_time", time="9:00", date="2024-07-15", **lisbon_to_tokyo)
        winter = await call(client, "convert_time", time="9am", date="2024-01-15", **lisbon_to_tokyo)
        today = await call(client, "convert_time", time="23:00", from_timezone="UTC", to_timezone="Berlin")
        new_york = {"from_timezone": "New York", "to_timezone": "UTC"}
        gap = await call_error(client, "convert_time", time="02:30", date="2024-03-10", **new_york)
    assert summer["target"]["time"] == "17:00:00" and summer["day_change"] == 0
    assert winter["target"]["time"] == "18:00:00"
    assert today["source"]["date"] == "2024-07-15"  # the pinned clock's date in the source zone
    assert today["target"]["date"] == "2024-07-16" and today["day_change"] == 1
    assert "does not exist" in gap


async def test_notes_are_kept_apart_per_user_named_in_the_request_meta() -> None:
    async with Client(notes.build_server(":memory:", forget_tool=True)) as client:
        alice, bob = {"whet/user": "alice"}, {"whet/user": "bob"}
        await client.call_tool("add_note", {"text": "bank PIN 4711"}, meta=alice)
        await client.call_tool("add_note", {"text": "standalone note"})
        bobs = await client.call_tool("list_notes", {}, meta=bob)
        assert bobs.structured_content["count"] == 0
        found = await client.call_tool("search_notes", {"query": "PIN"}, meta=bob)
        assert found.structured_content["count"] == 0
        assert (await client.call_tool("delete_note", {"note_id": 1}, meta=bob)).is_error
        assert (await client.call_tool("complete_todo", {"note_id": 1}, meta=bob)).is_error
        standalone = await client.call_tool("list_notes", {})
        assert [n["text"] for n in standalone.structured_content["notes"]] == ["standalone note"]
        forgotten = await client.call_tool("whet_forget_user", {}, meta=alice)
        assert forgotten.structured_content == {"user": "alice", "deleted": 1}
        assert (await client.call_tool("list_notes", {}, meta=alice)).structured_content["count"] == 0
        assert (await client.call_tool("whet_forget_user", {})).is_error  # no user named: nothing wiped
        assert (await client.call_tool("list_notes", {})).structured_content["count"] == 1
        # whet's default user (keys off) is the standalone namespace, and can be forgotten by name
        default = await client.call_tool("list_notes", {}, meta={"whet/user": "default"})
        assert [n["text"] for n in default.structured_content["notes"]] == ["standalone note"]
        assert (await client.call_tool("whet_forget_user", {}, meta={"whet/user": "default"})).structured_content[
            "deleted"] == 1  # fmt: skip


async def test_the_in_process_notebook_lists_no_forget_tool_and_serves_calls_without_a_request() -> None:
    server = notes.build_server(":memory:")
    assert "whet_forget_user" not in {tool.name for tool in await server.list_tools()}
    added = await server.call_tool("add_note", {"text": "no request here"})  # no request context at all
    assert not added.is_error and added.structured_content["text"] == "no request here"


def test_a_notebook_from_before_users_keeps_its_notes_in_the_standalone_namespace(tmp_path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY AUTOINCREMENT, text TEXT NOT NULL, list TEXT NOT NULL,"
                   " kind TEXT NOT NULL, created_at TEXT NOT NULL, completed_at TEXT)")
        db.execute("INSERT INTO notes (text, list, kind, created_at) VALUES ('old', 'inbox', 'note', 'x')")
    book = notes.NoteBook(path)
    try:
        assert [n.text for n in book.find(notes.STANDALONE_OWNER, [], None, None, True, 10).notes] == ["old"]
        assert book.find("alice", [], None, None, True, 10).count == 0
    finally:
        book.close()
