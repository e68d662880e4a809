"""The documentation pages that start a server run as written: the server in the background
until it answers, the blocks that call it, then SIGTERM, after which it must exit 0 (the
harness is ``tests/test_readme.py``'s; the other pages run in ``tests/test_docs.py``)."""

from __future__ import annotations

import pytest

from test_docs import page_id, pages, starts_a_server
from test_readme import check_page


@pytest.mark.parametrize("page", [p for p in pages() if starts_a_server(p)], ids=page_id)
def test_server_page_commands_run_as_written(page, tmp_path):
    failures = check_page(page, tmp_path)
    assert not failures, "\n\n".join(failures)
