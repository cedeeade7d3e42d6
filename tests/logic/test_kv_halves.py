"""The KV package's plug-in points keep their contracts: each side of each connector half has
every method its protocol names, with the same parameters (pdserve_core/kv/halves.py), and each
registered transport is a data plane under its own name (pdserve_core/kv/transport)."""

from __future__ import annotations

import inspect

import pytest

from pdserve_core.kv.halves import CONTRACTS, HALVES
from pdserve_core.kv.settings import ConnectorSettings
from pdserve_core.kv.transport import PLANES, plane_class
from pdserve_core.kv.transport.plane import DataPlane


def members(protocol: type) -> list[str]:
    return [name for name in vars(protocol) if not name.startswith("_")]


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize("half, side", list(CONTRACTS), ids=lambda x: str(x))
def test_each_side_of_each_half_keeps_its_protocol(half, side):
    cls = HALVES[half].load(side)
    contract = CONTRACTS[(half, side)]
    assert members(contract), contract
    for name in members(contract):
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        wanted, got = inspect.getattr_static(contract, name), inspect.getattr_static(cls, name)
        if isinstance(wanted, property):
            assert isinstance(got, property), f"{cls.__name__}.{name} is not a property"
            continue
        assert parameters(got) == parameters(wanted), f"{cls.__name__}.{name}"


def test_a_side_that_breaks_its_contract_is_refused_when_built(monkeypatch):
    from pdserve_core.kv import connector

    class Partial:
        def __init__(self, *args):
            pass

        def start(self, pulls):
            pass

    monkeypatch.setitem(connector.HALVES, "consumer", connector.HALVES["consumer"]._replace(
        module=__name__, worker="PARTIAL"))  # fmt: skip
    monkeypatch.setitem(globals(), "PARTIAL", Partial)
    with pytest.raises(TypeError, match="does not keep ConsumerWorker's contract"):
        connector._half("consumer", "worker", ConnectorSettings(secret="s"))


@pytest.mark.parametrize("name", list(PLANES))
def test_each_registered_transport_is_a_data_plane_of_its_name(name):
    cls = plane_class(name)
    assert issubclass(cls, DataPlane) and cls.name == name
    assert not cls.__abstractmethods__, f"{cls.__name__} leaves {set(cls.__abstractmethods__)}"
