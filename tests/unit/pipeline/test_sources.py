"""keyroute.pipeline.sources: the columns a spec names must be in the source, and a missing one is named
with the column it is likely a typo of. Pure: column names only, no Spark session."""

from __future__ import annotations

import pytest

from keyroute.pipeline.errors import DataError
from keyroute.pipeline.sources import value_columns_of
from keyroute.pipeline.spec import Mode, SourceFormat, StoreSpec

AVAILABLE = ["customer_id", "ts", "fare", "route"]


def latest(**fields: object) -> StoreSpec:
    spec = {"key": "customer_id", "order_by": "ts", "columns": None, **fields}
    return StoreSpec(
        name="trips",
        source="/data",
        format=SourceFormat.JSON,
        partitions=2,
        mode=Mode.LATEST,
        **spec,  # type: ignore[arg-type]
    )


def test_the_value_columns_are_every_column_but_the_key_or_the_listed_ones() -> None:
    assert value_columns_of(latest(), AVAILABLE) == ("ts", "fare", "route")
    assert value_columns_of(latest(columns=("fare",)), AVAILABLE) == ("fare",)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"order_by": "tss"},
            "store 'trips': order_by column 'tss' is not in the source (did you mean 'ts'?); available: "
            "'customer_id', 'ts', 'fare', 'route'",
        ),
        (
            {"key": "customer"},
            "store 'trips': key column 'customer' is not in the source (did you mean 'customer_id'?); available:",
        ),
        ({"columns": ("Fare",)}, "value column 'Fare' is not in the source (column names are case-sensitive: "),
        ({"columns": ("price",)}, "store 'trips': value column 'price' is not in the source; available: "),
    ],
)
def test_a_missing_column_is_named_with_the_one_it_is_closest_to(fields: dict[str, object], message: str) -> None:
    with pytest.raises(DataError) as err:
        value_columns_of(latest(**fields), AVAILABLE)
    assert message in str(err.value)
