"""Time-derived categories (``time:`` on a categorical feature): the hour, weekday, day of
the month or month of a timestamp column, in the feature's ``timezone``.

A value is epoch seconds (a number), or an ISO 8601 string: ``2026-12-01``, ``2026-12-01
13:45``, ``2026-12-01T13:45:00.250``, with ``Z`` or an offset (``+08:00``) or without one
(then it is a time in the feature's timezone). A value that is neither is missing. All in
Arrow compute: no loop over rows. Arrow's timezone rules end in 2037: later times get the
zone's standard offset (no daylight saving time).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

PARTS = ("hour", "weekday", "day_of_month", "month")
_NUMBER = r"^\s*-?\d+(\.\d+)?\s*$"
_OFFSET = r"(Z|[+-]\d\d:?\d\d)$"


def _utc(values: pa.Array, tz: str) -> pa.Array:
    """``values`` (numbers or strings) as ``timestamp[s, tz=UTC]``; null where unreadable."""
    if pa.types.is_floating(values.type) or pa.types.is_integer(values.type):
        secs = pc.floor(values.cast(pa.float64()))
        return secs.cast(pa.int64()).cast(pa.timestamp("s", tz="UTC"))
    s = pc.utf8_trim_whitespace(values.cast(pa.string()))
    number = pc.fill_null(pc.match_substring_regex(s, _NUMBER), False)
    secs = pc.if_else(number, s, pa.scalar(None, pa.string())).cast(pa.float64())
    from_number = pc.floor(secs).cast(pa.int64()).cast(pa.timestamp("s", tz="UTC"))
    # ISO: one layout, "YYYY-MM-DD HH:MM:SS", then with or without an offset
    t = pc.replace_substring_regex(s, r"^(\d{4}-\d\d-\d\d)[T ]", r"\1 ")
    t = pc.replace_substring_regex(t, r"^(\d{4}-\d\d-\d\d)$", r"\1 00:00:00")
    t = pc.replace_substring_regex(t, r"^(\d{4}-\d\d-\d\d \d\d:\d\d)($|[Z+-])", r"\1:00\2")
    t = pc.replace_substring_regex(t, r"(:\d\d)\.\d+", r"\1")  # fractions of a second
    t = pc.replace_substring_regex(t, r"Z$", "+0000")
    t = pc.replace_substring_regex(t, r"([+-]\d\d):(\d\d)$", r"\1\2")
    offset = pc.fill_null(pc.match_substring_regex(t, r"[+-]\d{4}$"), False)
    aware = pc.strptime(pc.if_else(offset, t, pa.scalar(None, pa.string())),
                        format="%Y-%m-%d %H:%M:%S%z", unit="s", error_is_null=True)
    naive = pc.strptime(pc.if_else(offset, pa.scalar(None, pa.string()), t),
                        format="%Y-%m-%d %H:%M:%S", unit="s", error_is_null=True)
    local = pc.assume_timezone(naive, timezone=tz, ambiguous="earliest",
                               nonexistent="earliest").cast(pa.timestamp("s", tz="UTC"))
    aware = aware.cast(pa.timestamp("s", tz="UTC"))
    return pc.coalesce(from_number, aware, local)


def time_part(values: pa.Array, part: str, tz: str) -> pa.Array:
    """The ``part`` (:data:`PARTS`) of every timestamp in ``values`` in timezone ``tz``, as
    text (``"0"`` to ``"23"`` for hours, ``"0"`` Monday to ``"6"`` Sunday, ``"1"`` to
    ``"31"``, ``"1"`` to ``"12"``); null where a value is missing or unreadable.

    >>> time_part(pa.array(["2026-12-01T13:45:00Z", "1796150000", "noon", None]),
    ...           "hour", "Asia/Shanghai").to_pylist()
    ['21', '2', None, None]
    """
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    when = _utc(values, tz).cast(pa.timestamp("s", tz=tz))  # components read local time
    if part == "hour":
        out = pc.hour(when)
    elif part == "weekday":
        out = pc.day_of_week(when)  # Monday 0
    elif part == "day_of_month":
        out = pc.day(when)
    elif part == "month":
        out = pc.month(when)
    else:
        raise ValueError(f"time part {part!r}: expected one of {PARTS}")
    return out.cast(pa.string())
