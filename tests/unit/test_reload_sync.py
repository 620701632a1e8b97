"""The reload file shared by the workers of `sampan serve --workers N`, with stand-in
server states: who loads what, and when."""

import pytest

from sampan.serving.rest import ReloadSync


class Counter:
    def __init__(self):
        self.counts = {}

    def labels(self, outcome):
        counter = self

        class _Inc:
            def inc(self):
                counter.counts[outcome] = counter.counts.get(outcome, 0) + 1
        return _Inc()


class State:
    """Records the load calls a worker makes."""

    def __init__(self, fail=()):
        self.loaded = []
        self.fail = set(fail)
        self.reloads = Counter()

    def load(self, bundle, retrieval_bundle=None):
        if bundle in self.fail:
            raise ValueError(f"bad {bundle}")
        self.loaded.append((bundle, retrieval_bundle))
        return bundle, retrieval_bundle


@pytest.fixture
def workers(tmp_path):
    path = tmp_path / "bundle.json"
    ReloadSync.create(path, "b0", None)
    a, b = State(), State()
    sa, sb = ReloadSync(path, a, interval=3600), ReloadSync(path, b, interval=3600)
    yield (a, sa), (b, sb)
    sa.close()
    sb.close()


def test_a_reload_reaches_the_other_worker_once(workers):
    (a, sa), (b, sb) = workers
    assert sb.reload("b1", None)[2] == 1
    assert b.loaded == [("b1", None)]
    sa.poll()
    sa.poll()
    assert a.loaded == [("b1", None)]  # once, and only the bundle that changed
    sb.poll()
    assert b.loaded == [("b1", None)]  # its own reload is not loaded again
    sa.reload(None, "r1")
    sb.poll()
    assert b.loaded[-1] == (None, "r1")


def test_the_same_path_reloaded_is_loaded_again(workers):
    (a, sa), (b, sb) = workers
    sb.reload("b1", None)
    sa.poll()
    sb.reload("b1", None)  # exported again to the same directory, then reloaded
    sa.poll()
    assert a.loaded == [("b1", None), ("b1", None)]


def test_interleaved_reloads_of_different_bundles_converge(workers):
    (a, sa), (b, sb) = workers
    # b swaps the retrieval bundle while a is busy reloading the ranking bundle: a's own
    # reload writes the later generation, and a still picks up b's retrieval bundle
    sb.reload(None, "r1")
    sa.reload("b1", None)
    sa.poll()
    sb.poll()
    assert a.loaded == [("b1", None), (None, "r1")]
    assert b.loaded == [(None, "r1"), ("b1", None)]
    assert sa.read()["generation"] == 2


def test_a_bundle_that_fails_in_one_worker_is_counted_and_not_retried(workers, capsys):
    (a, sa), (b, sb) = workers
    a.fail.add("b1")
    sb.reload("b1", None)
    sa.poll()
    sa.poll()
    assert a.loaded == [] and a.reloads.counts == {"failed": 1}
    assert "cannot load generation 1" in capsys.readouterr().err
