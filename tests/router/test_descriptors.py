"""router/http/descriptors.py: how many HTTP connections fit beside the descriptors kept back."""
from __future__ import annotations

import os
import resource

import pytest

from router.http import descriptors


@pytest.fixture
def limits(monkeypatch):
    """A soft limit of 1,000 under a hard one of 4,000; setrlimit's calls recorded (nothing changed)."""
    calls = []
    monkeypatch.setattr(descriptors.resource, "getrlimit", lambda which: (1000, 4000))
    monkeypatch.setattr(descriptors.resource, "setrlimit", lambda which, value: calls.append(value))
    return calls


def test_the_soft_limit_is_raised_to_hold_every_connection_beside_the_reserve(limits):
    in_use = len(os.listdir("/dev/fd"))
    assert descriptors.fitted_max_connections(2000, 64, 300) == 2000
    assert limits == [(in_use + 300 + 64 + 2000, 4000)]


def test_reserved_descriptors_come_out_of_the_connections_when_the_hard_limit_is_short(limits):
    in_use = len(os.listdir("/dev/fd"))
    small, large = (descriptors.fitted_max_connections(5000, 64, reserved) for reserved in (128, 1128))
    assert small == 4000 - in_use - 128 - 64
    assert large == small - 1000


def test_a_refused_setrlimit_keeps_the_soft_limit_and_serves_what_fits(monkeypatch, caplog):
    monkeypatch.setattr(descriptors.resource, "getrlimit", lambda which: (1000, 4000))

    def refuse(which, value):
        raise ValueError("not allowed to raise the limit")
    monkeypatch.setattr(descriptors.resource, "setrlimit", refuse)
    in_use = len(os.listdir("/dev/fd"))
    assert descriptors.fitted_max_connections(2000, 64, 128) == 1000 - in_use - 128 - 64
    assert "could not raise the file descriptor limit" in caplog.text


def test_an_unlimited_soft_limit_serves_every_connection(monkeypatch):
    monkeypatch.setattr(descriptors.resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert descriptors.fitted_max_connections(10**6, 64, 128) == 10**6
