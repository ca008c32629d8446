"""Tests on emulated hosts (``testbed.hosts``) need root and ``ip``, ``tc``, ``nsenter``, ``unshare``. Where
those are missing they are skipped, except in CI (``CI`` set), where a missing prerequisite fails them: CI
machines have them, and a skip there would hide that nothing crossed a host."""

from __future__ import annotations

import os

import pytest

from testbed.hosts import available


@pytest.fixture(autouse=True)
def _emulated_hosts_available() -> None:
    why = available()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the tests across emulated hosts: {why}")
    pytest.skip(why)
