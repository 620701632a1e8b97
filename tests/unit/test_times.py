"""Time-derived categories (``time:`` on a categorical feature), against Python's datetime."""

from __future__ import annotations

import datetime as dt
import zoneinfo

import numpy as np
import pyarrow as pa
import pytest

from sampan.config import ConfigError, load_config
from sampan.data.pipeline import FeaturePipeline
from sampan.data.times import time_part


def reference(epoch: float, part: str, tz: str) -> str:
    t = dt.datetime.fromtimestamp(int(np.floor(epoch)), zoneinfo.ZoneInfo(tz))
    return str({"hour": t.hour, "weekday": t.weekday(), "day_of_month": t.day,
                "month": t.month}[part])


@pytest.mark.parametrize("tz", ["UTC", "Asia/Shanghai", "America/New_York", "Asia/Kolkata"])
@pytest.mark.parametrize("part", ["hour", "weekday", "day_of_month", "month"])
def test_epoch_seconds_match_datetime(tz: str, part: str) -> None:
    rng = np.random.default_rng(0)
    # Arrow's timezone rules stop at 2037 (after it, no daylight saving time): up to then
    secs = rng.uniform(0, 2**31 - 1, 500)
    want = [reference(s, part, tz) for s in secs]
    assert time_part(pa.array(secs), part, tz).to_pylist() == want  # a numeric column
    assert time_part(pa.array([f"{s:.3f}" for s in secs]), part, tz).to_pylist() == want


def test_iso_strings_with_and_without_offsets() -> None:
    values = ["2026-12-01T13:45:00Z", "2026-12-01T13:45:00+08:00", "2026-12-01 13:45",
              "2026-12-01T13:45:07.250", "2026-12-01", " 2026-12-01T23:59:59-05:00 ",
              "noon", "2026-13-45T10:00:00", "", None]
    got = time_part(pa.array(values), "hour", "Asia/Shanghai").to_pylist()
    # UTC 13:45 -> 21 in Shanghai; +08:00 is Shanghai's own; naive times are Shanghai's;
    # 23:59 at -05:00 is 04:59 UTC next day -> 12 in Shanghai; unreadable -> missing
    assert got == ["21", "13", "13", "13", "0", "12", None, None, None, None]
    days = time_part(pa.array(values[:6]), "day_of_month", "Asia/Shanghai").to_pylist()
    assert days == ["1", "1", "1", "1", "1", "2"]


def test_a_time_feature_in_the_pipeline_and_its_config() -> None:
    raw = {"data": {"train": "x.csv"}, "features": {"label": "click", "categorical": [
        {"name": "hour", "column": "ts", "time": "hour", "timezone": "Asia/Shanghai",
         "min_count": 1}, {"name": "weekday", "column": "ts", "time": "weekday",
                           "min_count": 1}]}}
    pipe = FeaturePipeline(load_config(raw=raw).features)
    t = pa.table({"click": [1.0, 0.0, 1.0], "ts": ["1796150000", "2026-12-05 08:00", None]})
    ids = pipe.fit([t]).transform(t)["sparse"]
    # two hours (2 and 8 in Shanghai), two weekdays; a missing time gets neither's id
    assert len({int(i) for i in ids[:2, 0]}) == 2 and int(ids[2, 0]) not in ids[:2, 0]
    assert len({int(i) for i in ids[:2, 1]}) == 2
    report = pipe.feature_report()
    assert report[0]["transform"] == "hour of ts (Asia/Shanghai)"
    bad = {**raw, "features": {"label": "click", "categorical": [
        {"name": "h", "column": "ts", "time": "hour", "timezone": "Europe/Berln"}]}}
    with pytest.raises(ConfigError, match="did you mean 'Europe/Berlin'"):
        load_config(raw=bad)
    with pytest.raises(ConfigError, match="time cannot be combined"):
        load_config(raw={**raw, "features": {"label": "click", "categorical": [
            {"name": "h", "column": "ts", "time": "hour", "bucketize": "quantile"}]}})
