"""Unit tables and conversion for the calc server.

Every unit is a point on one dimension's scale: ``base = value * factor + offset``,
where the base is the SI unit (metre, kilogram, cubic metre, kelvin, second,
metre per second, byte). The offset is zero for every unit but the temperature
scales, which are affine. Speeds are also composed on the fly from any length
and time unit written ``length/time`` or ``length per time`` ("km/h",
"miles per hour", "ft/min").

Lookup tries the exact spelling first (so "Mb" is a megabit and "MB" a
megabyte), then the case-folded spelling, where the first unit registered wins
(bytes are registered before bits, so "mb" reads as megabytes, as people mean it).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Unit:
    """One unit: its canonical symbol, dimension, and affine map onto the dimension's base unit."""

    symbol: str
    dimension: str
    factor: float
    offset: float = 0.0

    def to_base(self, value: float) -> float:
        return value * self.factor + self.offset

    def from_base(self, value: float) -> float:
        return (value - self.offset) / self.factor


class UnitError(ValueError):
    """A unit the caller named cannot be used; the message says why and what would work."""


# (symbol, factor to base, aliases). Word aliases get a plural "s" added automatically.
_LENGTH = [
    ("m", 1.0, ["meter", "metre"]),
    ("km", 1e3, ["kilometer", "kilometre"]),
    ("cm", 1e-2, ["centimeter", "centimetre"]),
    ("mm", 1e-3, ["millimeter", "millimetre"]),
    ("µm", 1e-6, ["um", "micrometer", "micrometre", "micron"]),
    ("nm", 1e-9, ["nanometer", "nanometre"]),
    ("mi", 1609.344, ["mile"]),
    ("yd", 0.9144, ["yard"]),
    ("ft", 0.3048, ["foot", "feet", "'"]),
    ("in", 0.0254, ["inch", "inches", '"']),
    ("nmi", 1852.0, ["nautical mile"]),
    ("au", 149_597_870_700.0, ["astronomical unit"]),
    ("ly", 9_460_730_472_580_800.0, ["light year", "light-year", "lightyear"]),
]
_MASS = [
    ("kg", 1.0, ["kilogram", "kilogramme", "kilo"]),
    ("g", 1e-3, ["gram", "gramme"]),
    ("mg", 1e-6, ["milligram", "milligramme"]),
    ("µg", 1e-9, ["ug", "mcg", "microgram"]),
    ("t", 1e3, ["tonne", "metric ton", "metric tonne"]),
    ("lb", 0.45359237, ["lbs", "pound", "pound mass"]),
    ("oz", 0.028349523125, ["ounce"]),
    ("st", 6.35029318, ["stone"]),
    ("ton", 907.18474, ["short ton", "us ton"]),
    ("long ton", 1016.0469088, ["imperial ton", "uk ton"]),
]
_VOLUME = [
    ("m³", 1.0, ["m3", "m^3", "cubic meter", "cubic metre"]),
    ("L", 1e-3, ["l", "liter", "litre", "dm3", "dm³"]),
    ("mL", 1e-6, ["ml", "milliliter", "millilitre", "cm3", "cm³", "cc"]),
    ("cL", 1e-5, ["cl", "centiliter", "centilitre"]),
    ("dL", 1e-4, ["dl", "deciliter", "decilitre"]),
    ("gal", 3.785411784e-3, ["gallon", "us gallon", "us gal"]),
    ("imp gal", 4.54609e-3, ["imperial gallon", "uk gallon", "uk gal"]),
    ("qt", 9.46352946e-4, ["quart", "us quart"]),
    ("pt", 4.73176473e-4, ["pint", "us pint"]),
    ("imp pt", 5.6826125e-4, ["imperial pint", "uk pint"]),
    ("cup", 2.365882365e-4, ["us cup"]),
    ("fl oz", 2.95735295625e-5, ["floz", "fluid ounce", "us fluid ounce", "us fl oz"]),
    ("tbsp", 1.478676478125e-5, ["tablespoon"]),
    ("tsp", 4.92892159375e-6, ["teaspoon"]),
    ("ft³", 0.028316846592, ["ft3", "cubic foot", "cubic feet"]),
    ("in³", 1.6387064e-5, ["in3", "cubic inch", "cubic inches"]),
]
_TIME = [
    ("s", 1.0, ["sec", "second"]),
    ("ms", 1e-3, ["millisecond", "msec"]),
    ("µs", 1e-6, ["us", "microsecond"]),
    ("ns", 1e-9, ["nanosecond"]),
    ("min", 60.0, ["minute", "mins"]),
    ("h", 3600.0, ["hr", "hrs", "hour"]),
    ("d", 86_400.0, ["day"]),
    ("wk", 604_800.0, ["week", "wks"]),
    # Mean Gregorian month and year: the only lengths that are right on average.
    ("month", 2_629_746.0, ["mo"]),
    ("yr", 31_556_952.0, ["year", "y", "yrs"]),
]
_SPEED = [
    ("m/s", 1.0, ["mps"]),
    ("km/h", 1 / 3.6, ["kph", "kmh", "kmph"]),
    ("mph", 0.44704, []),
    ("kn", 1852.0 / 3600.0, ["knot", "kt", "kts"]),
    ("ft/s", 0.3048, ["fps"]),
]
# Bytes before bits: the case-folded "mb" must read as megabytes.
_DATA = [
    ("B", 1.0, ["byte", "octet"]),
    ("kB", 1e3, ["KB", "kilobyte"]),
    ("MB", 1e6, ["megabyte"]),
    ("GB", 1e9, ["gigabyte"]),
    ("TB", 1e12, ["terabyte"]),
    ("PB", 1e15, ["petabyte"]),
    ("KiB", 2.0**10, ["kibibyte"]),
    ("MiB", 2.0**20, ["mebibyte"]),
    ("GiB", 2.0**30, ["gibibyte"]),
    ("TiB", 2.0**40, ["tebibyte"]),
    ("PiB", 2.0**50, ["pebibyte"]),
    ("bit", 0.125, ["b"]),
    ("kbit", 125.0, ["Kb", "kilobit"]),
    ("Mbit", 1.25e5, ["Mb", "megabit"]),
    ("Gbit", 1.25e8, ["Gb", "gigabit"]),
    ("Tbit", 1.25e11, ["Tb", "terabit"]),
]
_TEMPERATURE = [
    # (symbol, factor, offset, aliases): kelvin = value * factor + offset.
    ("K", 1.0, 0.0, ["kelvin", "kelvins", "°K"]),
    ("°C", 1.0, 273.15, ["C", "ºC", "degC", "deg C", "celsius", "centigrade", "degrees celsius"]),
    ("°F", 5 / 9, 273.15 - 32 * 5 / 9, ["F", "ºF", "degF", "deg F", "fahrenheit", "degrees fahrenheit"]),
]
DIMENSIONS = {
    "length": _LENGTH,
    "mass": _MASS,
    "volume": _VOLUME,
    "time": _TIME,
    "speed": _SPEED,
    "data": _DATA,
}


def _spellings(symbol: str, aliases: list[str]) -> list[str]:
    """The symbol, its aliases, and a plural of every word alias ("mile" -> "miles")."""
    words = [a for a in aliases if re.fullmatch(r"[a-z][a-z -]+[a-z]", a) and not a.endswith(("s", "feet"))]
    return [symbol, *aliases, *(w + "s" for w in words)]


@cache
def _tables() -> tuple[dict[str, Unit], dict[str, Unit]]:
    """(exact spelling -> unit, case-folded spelling -> first unit registered under it)."""
    entries = [(s, Unit(s, dim, f), a) for dim, rows in DIMENSIONS.items() for s, f, a in rows]
    entries += [(s, Unit(s, "temperature", f, o), a) for s, f, o, a in _TEMPERATURE]
    exact: dict[str, Unit] = {}
    folded: dict[str, Unit] = {}
    for symbol, unit, aliases in entries:
        for spelling in _spellings(symbol, aliases):
            exact.setdefault(spelling, unit)
            folded.setdefault(spelling.casefold(), unit)
    return exact, folded


def _normalise(text: str) -> str:
    # The Greek mu and the micro sign look alike; the tables use the micro sign.
    text = " ".join(text.replace("_", " ").replace("\u03bc", "\u00b5").split())
    text = re.sub(r"\s+per\s+", "/", text, flags=re.IGNORECASE)
    text = re.sub(r"\s*/\s*", "/", text)
    return re.sub(r"^degrees?\s+", "", text, flags=re.IGNORECASE)


def _lookup(spelling: str) -> Unit | None:
    exact, folded = _tables()
    return exact.get(spelling) or folded.get(spelling.casefold())


def _composed_speed(spelling: str) -> Unit | None:
    """A speed written as length/time, e.g. "km/h", "miles/hour", "ft/min"."""
    if spelling.count("/") != 1:
        return None
    top, bottom = (_lookup(part) for part in spelling.split("/"))
    if top is None or bottom is None or top.dimension != "length" or bottom.dimension != "time":
        return None
    return Unit(f"{top.symbol}/{bottom.symbol}", "speed", top.factor / bottom.factor)


def find_unit(name: str) -> Unit:
    """The unit spelled `name` (symbol, name, plural, or alias); raises UnitError naming close matches."""
    spelling = _normalise(name)
    unit = _lookup(spelling) or _composed_speed(spelling)
    if unit is not None:
        return unit
    exact, _ = _tables()
    close = difflib.get_close_matches(spelling, list(exact), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise UnitError(
        f"Unknown unit {name!r}.{hint} Known units cover {', '.join(known_dimensions())}; "
        "list_units shows every spelling."
    )


def known_dimensions() -> list[str]:
    return [*DIMENSIONS, "temperature"]


def units_by_dimension() -> dict[str, list[str]]:
    """Canonical symbols of every unit, grouped by dimension."""
    grouped = {dim: [row[0] for row in rows] for dim, rows in DIMENSIONS.items()}
    grouped["temperature"] = [row[0] for row in _TEMPERATURE]
    return grouped


def convert(value: float, source: Unit, target: Unit) -> float:
    """`value` in `source` expressed in `target`; UnitError across dimensions or below absolute zero."""
    if source.dimension != target.dimension:
        raise UnitError(
            f"Cannot convert {source.symbol} ({source.dimension}) to {target.symbol} ({target.dimension}): "
            "they measure different things. Pick two units of the same dimension."
        )
    base = source.to_base(value)
    if source.dimension == "temperature" and base < -1e-9:  # tolerance: -459.67 °F rounds just below 0 K
        raise UnitError(f"{value:g} {source.symbol} is below absolute zero (-273.15 °C); no temperature is.")
    return target.from_base(base)
