"""Dates, times and timezones as MCP tools.

Timezones are IANA names read by zoneinfo (tzdata ships them where the OS does
not). People rarely type IANA names, so a timezone may also be written as a city
that is the last part of one ("Lisbon" -> Europe/Lisbon, "new york" ->
America/New_York), as a handful of big cities the database files under another
name ("San Francisco" -> America/Los_Angeles), as a common abbreviation meaning
the place with its daylight saving ("EST" -> America/New_York, not the fixed
UTC-5 zone tzdata calls EST), as "UTC"/"GMT", or as an offset ("UTC+5:30").

Dates are ISO (YYYY-MM-DD). Month arithmetic clamps to the end of the month
(Jan 31 + 1 month is Feb 28 or 29). The clock is injected so tests can pin it.
"""

from __future__ import annotations

import calendar
import difflib
import re
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta, timezone, tzinfo
from functools import cache
from typing import Annotated
from zoneinfo import ZoneInfo, available_timezones

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

_ABBREVIATIONS = {
    "EST": "America/New_York", "EDT": "America/New_York", "ET": "America/New_York",
    "CST": "America/Chicago", "CDT": "America/Chicago", "CT": "America/Chicago",
    "MST": "America/Denver", "MDT": "America/Denver", "MT": "America/Denver",
    "PST": "America/Los_Angeles", "PDT": "America/Los_Angeles", "PT": "America/Los_Angeles",
    "BST": "Europe/London", "WET": "Europe/Lisbon", "WEST": "Europe/Lisbon",
    "CET": "Europe/Paris", "CEST": "Europe/Paris", "EET": "Europe/Athens", "EEST": "Europe/Athens",
    "IST": "Asia/Kolkata", "JST": "Asia/Tokyo", "KST": "Asia/Seoul",
    "AEST": "Australia/Sydney", "AEDT": "Australia/Sydney",
    "NZST": "Pacific/Auckland", "NZDT": "Pacific/Auckland",
}  # fmt: skip
# Big cities the tz database files under a neighbour's name.
_CITIES = {
    "san_francisco": "America/Los_Angeles", "seattle": "America/Los_Angeles",
    "las_vegas": "America/Los_Angeles",
    "washington": "America/New_York", "boston": "America/New_York", "miami": "America/New_York",
    "atlanta": "America/New_York", "philadelphia": "America/New_York", "dallas": "America/Chicago",
    "houston": "America/Chicago", "beijing": "Asia/Shanghai", "mumbai": "Asia/Kolkata",
    "delhi": "Asia/Kolkata", "new_delhi": "Asia/Kolkata", "bangalore": "Asia/Kolkata",
    "osaka": "Asia/Tokyo", "barcelona": "Europe/Madrid", "munich": "Europe/Berlin",
    "frankfurt": "Europe/Berlin", "milan": "Europe/Rome", "geneva": "Europe/Zurich",
    "porto": "Europe/Lisbon", "rio_de_janeiro": "America/Sao_Paulo", "rio": "America/Sao_Paulo",
}  # fmt: skip
_UTC_NAMES = {"utc", "gmt", "z", "zulu", "etc/utc", "universal"}
_OFFSET = re.compile(r"(?:utc|gmt)?\s*([+-])\s*(\d{1,2})(?::?(\d{2}))?", re.IGNORECASE)
_TIME = re.compile(r"(\d{1,2})(?::(\d{2}))?(?::(\d{2}))?(?:\s*([ap])\.?\s*m\.?)?", re.IGNORECASE)
# Spelled out: calendar.day_name follows the process locale.
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


class ClockError(ToolError):
    """A date, time or timezone the caller gave cannot be read; the message says how to write it.

    A ToolError, so a tool that lets it escape answers with an isError result carrying the message.
    """


def _city_key(text: str) -> str:
    return re.sub(r"[\s\-_]+", "_", text.strip()).casefold()


@cache
def _zone_index() -> tuple[dict[str, str], dict[str, str]]:
    """(case-folded IANA name -> name, case-folded last component -> name). Built on first use."""
    names = sorted(available_timezones())
    full = {name.casefold(): name for name in names}
    last: dict[str, str] = {}
    for name in names:  # sorted, so the longer canonical name wins over a legacy link deterministically
        last.setdefault(_city_key(name.rsplit("/", 1)[-1]), name)
    return full, last


def resolve_timezone(text: str) -> tuple[str, tzinfo]:
    """(display name, tzinfo) for an IANA name, city, abbreviation, UTC or offset; raises ClockError."""
    raw = text.strip()
    if not raw:
        raise ClockError("The timezone is empty; give an IANA name like Europe/Lisbon, a city, or UTC.")
    if raw.casefold() in _UTC_NAMES:
        return "UTC", UTC
    if offset := _OFFSET.fullmatch(raw):
        return _fixed_offset(raw, *offset.groups())
    full, last = _zone_index()
    name = _ABBREVIATIONS.get(raw.upper()) or full.get(raw.casefold()) or last.get(_city_key(raw))
    name = name or _CITIES.get(_city_key(raw))
    if name is None:
        close = difflib.get_close_matches(_city_key(raw), [*last, *_CITIES], n=3, cutoff=0.75)
        hint = f" Did you mean {', '.join(last.get(c) or _CITIES[c] for c in close)}?" if close else ""
        raise ClockError(
            f"Unknown timezone {text!r}.{hint} Use an IANA zone name (Area/City), the name of a city, "
            "'UTC', or an offset from UTC such as UTC+5 or UTC-3."
        )
    return name, ZoneInfo(name)


def _fixed_offset(raw: str, sign: str, hours: str, minutes: str | None) -> tuple[str, tzinfo]:
    delta = timedelta(hours=int(hours), minutes=int(minutes or 0))
    if delta > timedelta(hours=14) or int(minutes or 0) >= 60:
        raise ClockError(f"{raw!r} is not a UTC offset: offsets run from -14:00 to +14:00.")
    zone = timezone(-delta if sign == "-" else delta)
    return f"UTC{_format_offset(zone.utcoffset(None))}", zone


def _format_offset(offset: timedelta | None) -> str:
    seconds = int((offset or timedelta()).total_seconds())
    sign = "-" if seconds < 0 else "+"
    hours, minutes = divmod(abs(seconds) // 60, 60)
    return f"{sign}{hours:02d}:{minutes:02d}"


def parse_date(text: str, field: str = "date") -> date:
    """An ISO date (YYYY-MM-DD); an ISO datetime is cut to its date. Raises ClockError naming `field`."""
    raw = text.strip()
    try:
        return date.fromisoformat(raw)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(raw).date()
    except ValueError:
        raise ClockError(f"{field} {text!r} is not a date; write it as YYYY-MM-DD (2024-03-15).") from None


def parse_time(text: str) -> time:
    """A time of day: 24-hour HH:MM[:SS], or 12-hour with am/pm ("3pm", "3:30 p.m.")."""
    match = _TIME.fullmatch(text.strip())
    problem = "write it as HH:MM (24-hour) or like 3:30pm"
    if match is None:
        raise ClockError(f"time {text!r} is not a time of day; {problem}.")
    hour, minute, second = (int(g or 0) for g in match.groups()[:3])
    meridiem = (match.group(4) or "").lower()
    if meridiem:
        if not 1 <= hour <= 12:
            raise ClockError(f"time {text!r}: with am/pm the hour runs from 1 to 12.")
        hour = hour % 12 + (12 if meridiem == "p" else 0)
    try:
        return time(hour, minute, second)
    except ValueError as exc:
        raise ClockError(f"time {text!r} is not valid ({exc}); {problem}.") from None


def add_months(day: date, months: int) -> date:
    """`day` moved by whole months, clamped to the last day of the target month."""
    year, month_index = divmod(day.year * 12 + day.month - 1 + months, 12)
    if not 1 <= year <= 9999:
        raise ClockError("The result falls outside the years 1 to 9999.")
    last_day = calendar.monthrange(year, month_index + 1)[1]
    return date(year, month_index + 1, min(day.day, last_day))


class DateInfo(BaseModel):
    date: str = Field(description="ISO date, YYYY-MM-DD.")
    weekday: str
    iso_weekday: int = Field(description="1 is Monday, 7 is Sunday.")
    iso_week: int
    day_of_year: int


class Moment(BaseModel):
    timezone: str = Field(description="The resolved timezone (IANA name, UTC, or UTC offset).")
    datetime: str = Field(description="ISO 8601 with UTC offset.")
    date: str
    time: str = Field(description="HH:MM:SS, 24-hour.")
    weekday: str
    utc_offset: str
    abbreviation: str | None
    is_dst: bool


class Span(BaseModel):
    start: str
    end: str
    days: int = Field(description="end minus start; negative when end is earlier.")
    text: str


class TimeConversion(BaseModel):
    source: Moment
    target: Moment
    day_change: int = Field(description="Target calendar date minus source calendar date (-1, 0 or +1).")
    text: str


def _date_info(day: date) -> DateInfo:
    iso = day.isocalendar()
    return DateInfo(
        date=day.isoformat(),
        weekday=_WEEKDAYS[day.weekday()],
        iso_weekday=iso.weekday,
        iso_week=iso.week,
        day_of_year=day.timetuple().tm_yday,
    )


def _moment(instant: datetime, zone_name: str) -> Moment:
    return Moment(
        timezone=zone_name,
        datetime=instant.isoformat(timespec="seconds"),
        date=instant.date().isoformat(),
        time=instant.strftime("%H:%M:%S"),
        weekday=_WEEKDAYS[instant.weekday()],
        utc_offset=_format_offset(instant.utcoffset()),
        abbreviation=instant.tzname(),
        is_dst=bool(instant.dst()),
    )


def _localise(day: date, moment: time, zone: tzinfo, zone_name: str) -> datetime:
    """`day` at `moment` in `zone`; the earlier reading when ambiguous, ClockError when skipped by DST."""
    local = datetime.combine(day, moment, tzinfo=zone)
    round_trip = local.astimezone(UTC).astimezone(zone)
    if round_trip.replace(tzinfo=None) != local.replace(tzinfo=None):
        raise ClockError(
            f"{moment.isoformat('minutes')} does not exist on {day} in {zone_name}: "
            "the clocks skip it when daylight saving time starts."
        )
    return local


def _utc_now() -> datetime:
    return datetime.now(UTC)


_READ_ONLY = ToolAnnotations(
    readOnlyHint=True, destructiveHint=False, idempotentHint=True, openWorldHint=False
)
_DateText = Annotated[str, Field(description="ISO date, YYYY-MM-DD.")]
_ZoneText = Annotated[str, Field(description="IANA name (Europe/Lisbon), city (Lisbon), UTC, or UTC+5:30.")]


def build_server(now: Callable[[], datetime] | None = None) -> MCPServer:
    """An MCP server with now, add_to_date, days_between, weekday and convert_time.

    `now` returns the current instant (timezone-aware; a naive value is read as UTC).
    """
    clock = now or _utc_now
    server = MCPServer("whet-clock", instructions="Current time, date arithmetic and timezone conversion.")

    def current() -> datetime:
        instant = clock()
        return instant if instant.tzinfo else instant.replace(tzinfo=UTC)

    @server.tool(name="now", title="Current time", annotations=_READ_ONLY)
    def now_tool(timezone: _ZoneText = "UTC") -> Moment:
        """The current date and time in a timezone (default UTC), with weekday and UTC offset."""
        zone_name, zone = resolve_timezone(timezone)
        return _moment(current().astimezone(zone), zone_name)

    @server.tool(title="Add to date", annotations=_READ_ONLY)
    def add_to_date(
        date: _DateText, days: int = 0, weeks: int = 0, months: int = 0, years: int = 0
    ) -> DateInfo:
        """Move a date by years, months, weeks and days (negative to go back).

        Years and months apply first and clamp to the month's end (2024-01-31 + 1 month is 2024-02-29),
        then weeks and days.
        """
        moved = add_months(parse_date(date), years * 12 + months)
        try:
            return _date_info(moved + timedelta(days=days, weeks=weeks))
        except OverflowError:
            raise ClockError("The result falls outside the years 1 to 9999.") from None

    @server.tool(title="Days between dates", annotations=_READ_ONLY)
    def days_between(start: _DateText, end: _DateText) -> Span:
        """Whole days from start to end (negative if end is earlier)."""
        first, last = parse_date(start, "start"), parse_date(end, "end")
        days = (last - first).days
        unit = "day" if abs(days) == 1 else "days"
        text = f"{last} is {abs(days)} {unit} {'after' if days >= 0 else 'before'} {first}"
        return Span(start=first.isoformat(), end=last.isoformat(), days=days, text=text)

    @server.tool(title="Weekday of a date", annotations=_READ_ONLY)
    def weekday(date: _DateText) -> DateInfo:
        """The weekday (and ISO week, day of year) of a date."""
        return _date_info(parse_date(date))

    @server.tool(title="Convert time between timezones", annotations=_READ_ONLY)
    def convert_time(
        time: Annotated[str, Field(description="Time of day: HH:MM (24-hour) or like 3:30pm.")],
        from_timezone: _ZoneText,
        to_timezone: _ZoneText,
        date: Annotated[str | None, Field(description="YYYY-MM-DD; default today in from_timezone.")] = None,
    ) -> TimeConversion:
        """What a wall-clock time in one timezone is in another, on a given date (DST-aware)."""
        source_name, source_zone = resolve_timezone(from_timezone)
        target_name, target_zone = resolve_timezone(to_timezone)
        day = parse_date(date) if date is not None else current().astimezone(source_zone).date()
        local = _localise(day, parse_time(time), source_zone, source_name)
        converted = local.astimezone(target_zone)
        source, target = _moment(local, source_name), _moment(converted, target_name)
        return TimeConversion(
            source=source,
            target=target,
            day_change=(converted.date() - local.date()).days,
            text=f"{source.time[:5]} {source_name} on {source.date} is "
            f"{target.time[:5]} {target_name} on {target.date}",
        )

    return server


if __name__ == "__main__":
    build_server().run("stdio")
