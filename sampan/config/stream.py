"""The ``stream`` section: online training from a Kafka topic or time-partitioned
directories (``sampan stream``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sampan.config.base import _Strict


class KafkaConfig(_Strict):
    """A Kafka topic read through ``confluent-kafka`` (the ``stream`` extra)."""

    brokers: str = Field(description="bootstrap servers, host:port[,host:port...]")
    topic: str = Field(description="the topic to read; every partition it has when the "
                       "stream starts is assigned to this trainer")
    group: str = Field("sampan", description="consumer group; offsets are committed to it "
                       "after each checkpoint (for monitoring: a restart resumes from the "
                       "checkpoint's own offsets)")
    start: Literal["earliest", "latest"] = Field(
        "earliest", description="where a new stream starts on a partition it has no "
        "checkpointed offset for")
    options: dict[str, str] = Field(default_factory=dict, description="more librdkafka "
                                    "consumer settings (security.protocol, sasl.*, ...)")


class DirectoryConfig(_Strict):
    """Time-partitioned directories, PaddleRec style: ``root/20261201/13/part-*.csv``.

    A partition is a folder holding data files, at any depth under ``root``; partitions are
    read in the order of their paths (zero-padded dates and hours sort in time order), each
    once. A partition is complete when it holds ``done_file``, or, with ``quiet_seconds``,
    when none of its files has changed for that long."""

    root: str = Field(description="a local folder, or a URI pyarrow opens (file://, "
                      "hdfs://, s3://)")
    done_file: str | None = Field("_SUCCESS", description="the marker a finished partition "
                                  "holds; null: use quiet_seconds alone")
    quiet_seconds: float | None = Field(None, gt=0, description="a partition without the "
                                        "done-file is complete after this many seconds "
                                        "without a change")
    poll_seconds: float = Field(2.0, gt=0, description="how often to look for new "
                                "partitions")

    @model_validator(mode="after")
    def _finishes(self) -> DirectoryConfig:
        if self.done_file is None and self.quiet_seconds is None:
            raise ValueError("stream.directory needs done_file or quiet_seconds (or both) to "
                             "know when a partition is complete")
        return self


class PublishConfig(_Strict):
    """Pushing fresh models to serving: each version is a full bundle in ``dir``."""

    dir: str = Field(description="the model directory `sampan serve --watch` reads")
    every_windows: int | None = Field(None, gt=0, description="a new version once this many "
                                      "windows have passed since the last (checked at each "
                                      "checkpoint); null: by every_seconds alone")
    every_seconds: float | None = Field(20.0, gt=0, description="with the window's 20 s, "
                                        "a new id reaches serving in well under a minute")
    keep: int = Field(5, gt=0, description="versions kept in dir (older ones are removed)")


class StreamConfig(_Strict):
    """Online training: windows of rows from the stream, each scored before it is trained
    on (progressive validation), with the stream position checkpointed with the model."""

    source: Literal["kafka", "directory"] = Field(
        description="where records come from: a Kafka topic (kafka) or time-partitioned "
        "directories (directory)")
    kafka: KafkaConfig | None = Field(None, description="the topic to read: {brokers, topic, "
                                      "group, start, options}; required when source is kafka")
    directory: DirectoryConfig | None = Field(
        None, description="the directories to read: {root, done_file, quiet_seconds, "
        "poll_seconds}; required when source is directory")
    format: Literal["auto", "jsonl", "csv", "tsv", "parquet", "libsvm", "slot"] = Field(
        "auto", description="the records' format. Kafka: one record per message, jsonl, csv "
        "or tsv (csv/tsv columns from data.columns). Directories: auto picks by file "
        "extension")
    window_rows: int = Field(50_000, gt=0, description="a window closes at this many rows...")
    window_seconds: float | None = Field(20.0, gt=0, description="...or this many seconds "
                                         "after its first row, whichever comes first")
    time_column: str | None = Field(None, description="event time (seconds since the epoch): "
                                    "each window logs its lag, event time to training time")
    checkpoint_every_windows: int = Field(1, gt=0, description="weights, optimizer state and "
                                          "stream position are checkpointed every this many "
                                          "windows, and at the end")
    average_windows: int = Field(10, gt=0, description="progressive validation's moving "
                                 "average spans this many windows")
    max_windows: int | None = Field(None, gt=0, description="stop after this many windows "
                                    "(default: run until stopped)")
    idle_stop_seconds: float | None = Field(None, gt=0, description="stop when no record "
                                            "arrived for this long (default: wait forever)")
    publish: PublishConfig | None = Field(None, description="push fresh models to serving: "
                                          "{dir, every_windows, every_seconds, keep}; null: "
                                          "no publishing")

    @model_validator(mode="after")
    def _one_source(self) -> StreamConfig:
        if self.source == "kafka" and self.kafka is None:
            raise ValueError("stream.source is kafka: give stream.kafka (brokers, topic)")
        if self.source == "directory" and self.directory is None:
            raise ValueError("stream.source is directory: give stream.directory (root)")
        if self.source == "kafka" and self.format in ("parquet", "auto"):
            if self.format == "parquet":
                raise ValueError("stream.format parquet cannot come from Kafka messages; "
                                 "expected jsonl, csv or tsv")
            self.format = "jsonl"
        return self
