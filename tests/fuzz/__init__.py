"""Fuzz suites; ``SAMPAN_FUZZ_EXAMPLES`` sets the bounded example count CI runs."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("SAMPAN_FUZZ_EXAMPLES", "150"))


def fuzz(examples: int = EXAMPLES):  # type: ignore[no-untyped-def]
    """Hypothesis settings for ``examples`` cases, no deadline, no example database."""
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
