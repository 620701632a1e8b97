"""Behaviour-log builder: an events table -> DIN-style samples with user histories.

Each target event becomes one sample: its user, item, category and timestamp, a label, and
the user's history — the items (and categories) of that user's events strictly before the
target's timestamp, most recent last, at most ``max_len``. With ``negatives: k`` each
positive target also yields ``k`` samples of items drawn by popularity, with the same
history and label 0. This is the recipe for "recently clicked a phone -> recommend
earphones".

Everything is vectorised over the sorted events (searchsorted on (user, time) keys and one
gather for all histories); memory is that of the events table plus the output.

Example::

    build_sequences("UserBehavior.csv", "samples.parquet", BuildOptions(
        columns=["user", "item", "category", "behavior", "ts"], header=False,
        positive=["buy", "cart", "fav"], max_len=50, negatives=1))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sampan.config import DataConfig
from sampan.data.sources import ColumnRoles, DataError, RejectLog, expand_paths, iter_source


@dataclass
class BuildOptions:
    user: str = "user_id"
    item: str = "item_id"
    category: str | None = "category_id"
    time: str = "timestamp"
    action: str | None = "behavior"
    positive: list[str] | None = None  # actions that are positives; None: every event
    history_actions: list[str] | None = None  # actions that enter histories; None: all
    targets: str = "all"  # "all" events, or only "positive" ones (with sampled negatives)
    max_len: int = 50
    negatives: int = 0
    seed: int = 0
    format: str = "auto"
    header: bool = True
    columns: list[str] | None = None
    delimiter: str | None = None
    extra: list[str] = field(default_factory=list)  # other columns copied to the output


@dataclass
class BuildReport:
    events: int
    rejected: int
    samples: int
    positives: int
    negatives: int
    users: int
    mean_history: float


def build_sequences(events: str | list[str], out: str | Path, opt: BuildOptions) -> BuildReport:
    """Read the events, build the samples and write them to ``out`` (Parquet)."""
    if opt.format == "sequence_lines":
        # such lines hold items only: no category, no action
        opt = dataclasses.replace(opt, category=None, action=None)
        t, read = _sequence_lines(events, opt)
        samples = build_from_table(t, opt)
        return _write(samples, out, opt, t, read, 0)
    cfg = DataConfig(train=events, format=opt.format, header=opt.header, columns=opt.columns,
                     delimiter=opt.delimiter)
    cats = [c for c in (opt.user, opt.item, opt.category, opt.action, *opt.extra) if c]
    roles = ColumnRoles(numeric=[opt.time], categorical=cats, required=[opt.time, opt.user,
                                                                        opt.item])
    if opt.header and not opt.columns:
        for path in expand_paths(events):
            _check_header(path, opt, roles)
    rejects = Path(out).with_suffix(".rejects.jsonl")
    rejects.unlink(missing_ok=True)  # this run's rejects only
    log = RejectLog(rejects)
    try:
        parts = list(iter_source(cfg, expand_paths(events), roles, log))
    finally:
        log.close()
    if not parts:
        raise DataError(f"no usable events in {events}")
    t = pa.concat_tables(parts).drop_columns(["_line"])
    return _write(build_from_table(t, opt), out, opt, t, log.read, log.rejected)


def _check_header(path: Path, opt: BuildOptions, roles: ColumnRoles) -> None:
    """A text file whose first line looks like data (as ``sampan data inspect`` guesses)
    and names none of the columns asked for is refused with the fix, instead of taking
    its first event for column names."""
    from sampan.data.inspect import _guess_delimiter, _guess_header
    from sampan.data.sources import detect_format, open_input

    if detect_format(path, opt.format) not in ("csv", "tsv"):
        return
    with open_input(path) as f:
        lines = f.read(65536).decode("utf-8", "replace").splitlines()[:20]
    if not lines:
        return
    delimiter = opt.delimiter or _guess_delimiter(lines)
    first = [v.strip().strip('"') for v in lines[0].split(delimiter)]
    if any(c in first for c in roles.all) or _guess_header(lines, delimiter):
        return
    raise DataError(f"{path}: the first line {lines[0][:80]!r} looks like data, not a header "
                    f"(it names none of {roles.all}); pass --columns naming its "
                    f"{len(first)} columns in file order, e.g. --columns "
                    + ",".join(f"name{i + 1}" for i in range(len(first))))


def _write(samples: pa.Table, out: str | Path, opt: BuildOptions, events: pa.Table, read: int,
           rejected: int) -> BuildReport:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(samples, out)
    lab = samples.column("label").to_numpy()
    lens = pc.list_value_length(samples.column(f"hist_{opt.item}")).to_numpy()
    return BuildReport(events=read, rejected=rejected, samples=samples.num_rows,
                       positives=int(lab.sum()), negatives=int((lab == 0).sum()),
                       users=len(pc.unique(events.column(opt.user))),
                       mean_history=float(lens.mean()) if len(lens) else 0.0)


def _sequence_lines(files: str | list[str], opt: BuildOptions) -> tuple[pa.Table, int]:
    """``user item_1 item_2 ...`` per line (SASRec / S3-Rec files), items in time order ->
    events with the position in the line as timestamp."""
    from sampan.data.io.lines import iter_lines, tokens

    users, items, times = [], [], []
    for path in expand_paths(files):
        for raw, _, _ in iter_lines(path, 4 << 20):
            flat, rows = tokens(raw.cast(pa.string()))
            first = np.concatenate([[True], rows[1:] != rows[:-1]]) if len(rows) else \
                np.array([], bool)
            starts = np.nonzero(first)[0]
            user_of_row = pc.filter(flat, pa.array(first))
            # events: every token but the first of its line
            ev = np.nonzero(~first)[0]
            line_idx = np.searchsorted(starts, ev, side="right") - 1
            users.append(user_of_row.take(pa.array(line_idx)))
            items.append(flat.take(pa.array(ev)))
            times.append(ev - starts[line_idx])
    t = pa.table({opt.user: pa.concat_arrays(users), opt.item: pa.concat_arrays(items),
                  opt.time: pa.array(np.concatenate(times).astype(np.float64))})
    return t, t.num_rows


def build_from_table(t: pa.Table, opt: BuildOptions) -> pa.Table:
    """The builder on an in-memory events table (columns named as in ``opt``)."""
    t = t.sort_by([(opt.user, "ascending"), (opt.time, "ascending")])
    user_codes = pc.dictionary_encode(t.column(opt.user).combine_chunks()).indices
    u = user_codes.to_numpy().astype(np.int64)
    ts = t.column(opt.time).to_numpy().astype(np.float64)
    t_rank = np.unique(ts, return_inverse=True)[1].astype(np.int64)
    span = int(t_rank.max()) + 2 if len(t_rank) else 2
    key = u * span + t_rank  # orders events by (user, time)

    action = t.column(opt.action).combine_chunks() if opt.action else None
    is_pos = np.ones(len(t), dtype=bool) if opt.positive is None or action is None else \
        pc.is_in(action, value_set=pa.array(opt.positive)).to_numpy(zero_copy_only=False)
    in_hist = np.ones(len(t), dtype=bool) if opt.history_actions is None or action is None \
        else pc.is_in(action, value_set=pa.array(opt.history_actions)).to_numpy(
            zero_copy_only=False)

    hist_idx = np.nonzero(in_hist)[0]
    hkey = key[hist_idx]
    targets = np.arange(len(t)) if opt.targets == "all" else np.nonzero(is_pos)[0]
    end = np.searchsorted(hkey, key[targets], side="left")  # strictly earlier timestamps
    first = np.searchsorted(hkey, u[targets] * span, side="left")
    start = np.maximum(first, end - opt.max_len)
    lengths = end - start
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    gather = hist_idx[np.repeat(start - offsets[:-1], lengths) + np.arange(offsets[-1])] \
        if offsets[-1] else np.array([], dtype=np.int64)

    def hist(col: str) -> pa.Array:
        values = t.column(col).combine_chunks().take(pa.array(gather))
        return pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64)), values)

    cols: dict[str, pa.Array] = {}
    sel = pa.array(targets)
    for c in [opt.user, opt.item, opt.category, opt.time, *opt.extra]:
        if c:
            cols[c] = t.column(c).combine_chunks().take(sel)
    cols["label"] = pa.array(is_pos[targets].astype(np.float64))
    cols[f"hist_{opt.item}"] = hist(opt.item)
    if opt.category:
        cols[f"hist_{opt.category}"] = hist(opt.category)
    out = pa.table(cols)
    if opt.negatives > 0:
        out = pa.concat_tables([out, _negatives(t, out, is_pos[targets], opt)])
        # samples of one target stay together: positive first, then its negatives
        order = np.argsort(np.concatenate([np.arange(len(targets)),
                                           np.repeat(np.nonzero(is_pos[targets])[0],
                                                     opt.negatives)]), kind="stable")
        out = out.take(pa.array(order))
    return out


def _negatives(events: pa.Table, samples: pa.Table, positive: np.ndarray,
               opt: BuildOptions) -> pa.Table:
    """``opt.negatives`` items per positive sample, drawn by popularity, never the target."""
    items = events.column(opt.item).combine_chunks()
    vc = pc.value_counts(items)
    catalog = vc.field("values")
    p = vc.field("counts").to_numpy().astype(np.float64)
    p /= p.sum()
    pos_idx = np.nonzero(positive)[0]
    if len(catalog) < 2:
        raise DataError(f"negatives: the events hold {len(catalog)} distinct item(s); sampling "
                        "negatives needs at least two")
    rng = np.random.default_rng(opt.seed)
    draw = rng.choice(len(catalog), size=(len(pos_idx), opt.negatives), p=p)
    target = pc.index_in(samples.column(opt.item).combine_chunks().take(pa.array(pos_idx)),
                         value_set=catalog).to_numpy(zero_copy_only=False)
    clash = draw == target[:, None]
    draw[clash] = (draw[clash] + 1) % len(catalog)  # never the positive item itself
    draw = draw.reshape(-1)
    rep = pa.array(np.repeat(pos_idx, opt.negatives))
    neg = samples.take(rep)
    neg = neg.set_column(neg.schema.get_field_index(opt.item), opt.item,
                         catalog.take(pa.array(draw)))
    if opt.category:
        first = pc.index_in(catalog, value_set=items).to_numpy(zero_copy_only=False)
        cat_of = events.column(opt.category).combine_chunks().take(pa.array(first))
        neg = neg.set_column(neg.schema.get_field_index(opt.category), opt.category,
                             cat_of.take(pa.array(draw)))
    return neg.set_column(neg.schema.get_field_index("label"), "label",
                          pa.array(np.zeros(len(draw))))
