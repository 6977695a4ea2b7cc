"""The rendered overlays, one module-scoped fixture each."""

from __future__ import annotations

import pytest

from tests.k8s_render import (
    ALL_OVERLAYS,
    OVERLAYS,
    Obj,
    render,
)
from tests.unit.k8s.manifests import (
    OBJECT_STORAGE,
)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def objs(overlay: str) -> list[Obj]:
    return render(overlay)


@pytest.fixture(scope="module")
def object_storage_objs() -> list[Obj]:
    return render(OBJECT_STORAGE)


@pytest.fixture(scope="module", params=ALL_OVERLAYS)
def any_overlay(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return str(request.param), render(str(request.param))
